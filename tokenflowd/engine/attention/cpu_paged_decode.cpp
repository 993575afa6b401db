// Decode attention read straight from the paged KV cache, for the torch backend on CPU.
//
// One query per request attends over the first seq_lens[b] tokens of its pages, in the torch
// backend's layout: a plane is [kv_heads, num_pages, page_size, head_dim], contiguous. Each
// (request, kv head) pair is one task: its `group` query heads share every K/V row they read,
// so each row is loaded once (GQA without repeating K/V). Scores, softmax and the weighted sum of
// V accumulate in fp32 whatever the cache's dtype. Nothing is gathered: the torch twin of this
// kernel copies every decode request's pages into one padded block per layer first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

template <typename T>
void paged_decode_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                       const at::Tensor& lens, double scale, at::Tensor& out, float* lse) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k.size(0), P = k.size(1), PS = k.size(2);
  const int64_t G = H / KVH, MP = table.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / KVH, h = w % KVH;
      const int64_t len = lp[b];
      scores.assign(G * len, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = qp + b * qs0 + (h * G + g) * qs1;
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qr[d]) * sc;
      }
      // scores[g, t] = q_g . k_t over the request's pages
      for (int64_t t0 = 0, j = 0; t0 < len; t0 += PS, ++j) {
        const int64_t page = tp[b * MP + j], n = std::min(PS, len - t0);
        const T* kr = kp + (h * P + page) * PS * D;
        for (int64_t t = 0; t < n; ++t, kr += D) {
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qg[d] * static_cast<float>(kr[d]);
            scores[g * len + t0 + t] = s;
          }
        }
      }
      // softmax over t, for each query head of the group
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - m);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
        if (lse != nullptr) lse[b * H + h * G + g] = m + std::log(sum);
      }
      // out_g = sum_t p[g, t] v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0, j = 0; t0 < len; t0 += PS, ++j) {
        const int64_t page = tp[b * MP + j], n = std::min(PS, len - t0);
        const T* vr = vp + (h * P + page) * PS * D;
        for (int64_t t = 0; t < n; ++t, vr += D) {
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * len + t0 + t];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * static_cast<float>(vr[d]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = op + (b * H + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                  const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [B, heads, head_dim] with rows contiguous");
  TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && v.is_contiguous() && k.sizes() == v.sizes(),
              "k, v: contiguous [kv_heads, num_pages, page_size, head_dim]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(k.size(3) == q.size(2) && q.size(1) % k.size(0) == 0, "head_dim and GQA grouping must agree");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == q.size(0) && table.is_contiguous() &&
                  table.scalar_type() == at::kInt,
              "block table: contiguous int32 [B, max_pages]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == q.size(0) && lens.is_contiguous() && lens.scalar_type() == at::kInt,
              "seq_lens: contiguous int32 [B]");
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t ps = k.size(2), mp = table.size(1), num_pages = k.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {  // a bad page must be an error, never a read out of bounds
    TORCH_CHECK(lp[b] > 0 && lp[b] <= mp * ps, "seq_lens[", b, "] = ", lp[b], " outside the block table");
    for (int64_t j = 0; j * ps < lp[b]; ++j)
      TORCH_CHECK(tp[b * mp + j] >= 0 && tp[b * mp + j] < num_pages, "page ", tp[b * mp + j], " out of range");
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                        const at::Tensor& lens, double scale) {
  check_inputs(q, k, v, table, lens);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode",
                                  [&] { paged_decode_impl<scalar_t>(q, k, v, table, lens, scale, out, nullptr); });
  return out;
}

// The same, with each row's log-sum-exp of its scaled scores (base e, fp32 [B, heads]), so the
// output can be merged with attention over context held elsewhere (partial.py).
std::tuple<at::Tensor, at::Tensor> paged_decode_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& table, const at::Tensor& lens, double scale) {
  check_inputs(q, k, v, table, lens);
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  float* lp = lse.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_lse",
                                  [&] { paged_decode_impl<scalar_t>(q, k, v, table, lens, scale, out, lp); });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(tokenflowd, m) {
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor block_table, Tensor seq_lens, float scale) -> Tensor");
  m.def("paged_decode_lse(Tensor q, Tensor k, Tensor v, Tensor block_table, Tensor seq_lens, float scale)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenflowd, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_lse", &paged_decode_lse);
}
