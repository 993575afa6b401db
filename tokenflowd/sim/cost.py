"""How long a step takes on a given GPU and model: a roofline, for the simulator's executor.

A step computes some new tokens of some requests (a chunk of n tokens of a request whose first
`computed` tokens already have KV). Its time is

    t_step = step_overhead + max(t_compute, t_memory) + (1 − overlap) · min(t_compute, t_memory)

    t_compute = flops / (peak_flops · compute_efficiency)
    t_memory  = bytes / (mem_bandwidth · bandwidth_efficiency)

    flops = 2 · num_params · Σ n                                  (every new token through the weights)
          + 4 · num_layers · num_heads · head_dim · Σ attended    (QKᵀ and PV, causal)
    bytes = weight_bytes + kv_bytes_per_token · Σ (computed + n)  (weights once, each context's KV once)

where `attended` of a chunk is the context its query tokens see, summed: n·computed + n(n+1)/2.
A decode step (n = 1 per request) is memory-bound until the batch is large; a prefill chunk of
thousands of tokens is compute-bound. `overlap` is how much of the shorter time hides under the
longer: 1 on a GPU (the plain roofline, the presets), lower on a CPU whose cores stall on memory
instead of computing meanwhile (a calibration fits it). `num_params` leaves out the input embedding (a lookup, not a
matmul) and, for simplicity, counts the LM head for every token rather than only sampled ones
(+7% of a Llama3-8B prefill's FLOPs).

The KV pool: `kv_memory` bytes → `num_pages` pages of `page_size` tokens of `kv_bytes_per_token`.
The host link (`host_link_bandwidth`, one direction) gives the time to move KV between the device
and host memory (`transfer_time`), for the offload tier.

Figures of the presets, and where they come from
------------------------------------------------
Llama3-8B (meta-llama/Meta-Llama-3-8B model card and config.json): 8,030,261,248 parameters,
bf16; 32 layers, hidden 4096, 32 query heads and 8 KV heads of head_dim 128, vocab 128,256,
untied embeddings. So weight_bytes = 2 · 8.03e9 = 16.06 GB (15,316 MiB); the input embedding is
128,256 · 4096 = 525,336,576 parameters, leaving num_params = 7,504,924,672; KV per token =
2 (K, V) · 32 layers · 8 heads · 128 · 2 bytes = 131,072 bytes = 128 KiB.

H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): 141 GB HBM3e at 4.8 TB/s; BF16 Tensor Core
1,979 TFLOPS "with sparsity", so 989.5 TFLOPS dense; host interconnect PCIe Gen5 128 GB/s, i.e.
64 GB/s each way. The TokenFlow paper (§7.3) runs SGLang at mem-frac 0.3: weights plus KV pool
take 0.3 of the memory. The datasheet's "141 GB" is rounded; the card reports 143,771 MiB [inf:
HBM stacks are binary-sized, as on every NVIDIA part], and SGLang's fraction multiplies what the
card reports: KV memory = 0.3 · 143,771 MiB − 16.06 GB = 29.2 GB → 222,512 tokens in pages of 16.

RTX 4090 (NVIDIA Ada GPU architecture whitepaper, appendix table for the RTX 4090): 24 GB GDDR6X
(24,564 MiB reported) at 1,008 GB/s; BF16 Tensor 165.2 TFLOPS dense with FP32 accumulate (330.4
with sparsity; only FP16 with FP16 accumulate reaches 330.3 dense, and cuBLAS's BF16 GEMMs
accumulate in FP32); PCIe 4.0 x16: 16 GT/s · 16 lanes · 128/130 / 8 = 31.5 GB/s each way. The
paper gives no mem-frac for it; SGLang's default heuristic (server_args.py,
_handle_gpu_memory_settings) reserves 512 MiB + 1.5 MiB · max(chunked_prefill 2048, 2048) +
2 MiB · cuda_graph_max_bs 24 + 128 MiB = 3,760 MiB on a card under 35 GiB, so mem-frac 0.847 and
KV memory = 20,804 MiB − 16.06 GB = 5.75 GB → 43,888 tokens in pages of 16.

Llama-2-7B on an A100 80 GB (TokenLake §7: 8 A100 80 GB per server, NVLink 400 GB/s, the
LWM-1M-Text model, a long-context Llama-2-7B). Llama-2-7B (meta-llama/Llama-2-7b-hf config.json):
6,738,415,616 parameters, fp16/bf16; 32 layers, hidden 4096, 32 query heads and 32 KV heads (no
GQA) of head_dim 128, vocab 32,000, untied embeddings. So weight_bytes = 13.48 GB, num_params =
6,738,415,616 − 32,000 · 4096 = 6,607,343,616, KV per token = 2 · 32 · 32 · 128 · 2 = 524,288
bytes = 512 KiB. A100 SXM4 80 GB (NVIDIA A100 datasheet): 2,039 GB/s HBM2e; BF16 Tensor Core 312
TFLOPS dense; PCIe Gen4 x16, 31.5 GB/s each way. The paper states no memory fraction; 0.85 of the
card's 81,920 MiB is assumed [inf: SGLang's default for cards above 80 GiB is 0.85–0.88]: KV memory
= 0.85 · 81,920 MiB − 13.48 GB = 59.5 GB → 113,552 tokens in pages of 16. The paper's instances
run TP 2 (two GPUs each); `a100-llama2-7b` is one GPU, and the pool simulator counts engines.

Engine limits: max_num_batched_tokens is SGLang's default chunked-prefill size for the card's
memory bucket (8,192 above 90 GiB, 2,048 under 35 GiB; same heuristic); max_num_seqs = 256 (the
CUDA-graph batch limit SGLang picks for an H200, and a bound the 4090's pool never reaches).

Efficiency factors (assumptions, not measurements; a `calibrated:` model replaces them by fits):
- bandwidth_efficiency 0.8: decode GEMV and paged-attention kernels stream at 75–85% of peak
  HBM/GDDR bandwidth. H200 batch-1 decode: 16.06 GB / 3.84 TB/s + 2 ms = 6.2 ms (~160 tokens/s).
- compute_efficiency 0.5: an 8B model's large prefill GEMMs reach 60–75% of dense peak, and the
  step also runs attention, norms and sampling; 0.5 is the step average.
- step_overhead 2 ms: scheduling, input preparation, sampling and launches between steps.
- host_link_efficiency 0.8: pinned-memory async copies reach about 80% of PCIe line rate.
"""
from __future__ import annotations

import dataclasses
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tokenflowd.kv.pages import cdiv

MiB = 2**20


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one step computes and moves, in the roofline's units."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class CostModel:
    name: str
    # The model: where the FLOP and byte counts come from.
    num_params: float  # parameters every new token multiplies through (input embedding excluded)
    weight_bytes: float  # bytes of weights read once per step
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int  # bytes per KV element (2: bf16)
    # The device.
    peak_flops: float  # dense FLOP/s
    mem_bandwidth: float  # bytes/s
    kv_memory: int  # bytes of the KV pool
    host_link_bandwidth: float  # bytes/s, one direction (PCIe)
    compute_efficiency: float = 0.5
    bandwidth_efficiency: float = 0.8
    host_link_efficiency: float = 0.8
    step_overhead: float = 0.002  # s per step
    overlap: float = 1.0  # share of min(t_compute, t_memory) hidden under the max (1: roofline)
    # The engine's limits.
    page_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192  # the model's context: what bounds a request with no max_tokens (Llama 3: 8,192)
    source: str = ""  # where the figures come from (a preset's docstring, a calibration run)

    def __post_init__(self) -> None:
        for name in ("num_params", "peak_flops", "mem_bandwidth", "host_link_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cost model {self.name}: {name} must be above 0, got {getattr(self, name)}")
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "kv_dtype_bytes",
                     "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"cost model {self.name}: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"cost model {self.name}: overlap must be in [0, 1], got {self.overlap}")
        for name in ("compute_efficiency", "bandwidth_efficiency", "host_link_efficiency"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"cost model {self.name}: {name} must be in (0, 1], got {getattr(self, name)}")
        if self.weight_bytes < 0 or self.step_overhead < 0:
            raise ValueError(f"cost model {self.name}: weight_bytes and step_overhead must be >= 0")
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"cost model {self.name}: page_size must be a positive power of two, got {self.page_size}")
        if self.num_pages < 1:
            raise ValueError(
                f"cost model {self.name}: kv_memory {self.kv_memory} bytes holds no page of "
                f"{self.page_size * self.kv_bytes_per_token} bytes: raise kv_memory"
            )

    # -- memory -------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def num_pages(self) -> int:
        """Pages of the device KV pool."""
        return self.kv_memory // (self.kv_bytes_per_token * self.page_size)

    @property
    def max_tokens_in_pool(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    def transfer_time(self, num_tokens: int) -> float:
        """Seconds to move `num_tokens` of KV one way over the host link."""
        return num_tokens * self.kv_bytes_per_token / (self.host_link_bandwidth * self.host_link_efficiency)

    # -- time ---------------------------------------------------------------------------------
    def work(self, chunks: Iterable[tuple[int, int]]) -> StepWork:
        """FLOPs and bytes of a step computing, per request, (computed, n): n new tokens after
        `computed` tokens that already have KV."""
        tokens = attended = context = 0
        for computed, n in chunks:
            tokens += n
            attended += n * computed + n * (n + 1) // 2
            context += computed + n
        flops = 2.0 * self.num_params * tokens + 4.0 * self.num_layers * self.num_heads * self.head_dim * attended
        return StepWork(flops, self.weight_bytes + float(self.kv_bytes_per_token) * context)

    def attention_time(self, attended: int, kv_tokens: int) -> float:
        """Seconds of attention alone over `attended` (query row, key) pairs that read `kv_tokens`
        tokens' KV once: its FLOPs or that read, whichever bounds it."""
        flops = 4.0 * self.num_layers * self.num_heads * self.head_dim * attended
        read = kv_tokens * self.kv_bytes_per_token
        return max(flops / (self.peak_flops * self.compute_efficiency), read / (self.mem_bandwidth * self.bandwidth_efficiency))

    def time_of(self, work: StepWork) -> float:
        compute = work.flops / (self.peak_flops * self.compute_efficiency)
        memory = work.bytes / (self.mem_bandwidth * self.bandwidth_efficiency)
        return self.step_overhead + max(compute, memory) + (1.0 - self.overlap) * min(compute, memory)

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        return self.time_of(self.work(chunks))

    def decode_step_time(self, batch_size: int, context: int) -> float:
        """One decode step of `batch_size` requests that each hold `context` tokens of KV."""
        return self.step_time([(context, 1)] * batch_size)

    def prefill_time(self, prompt_len: int) -> float:
        """One request's whole prompt in steps of at most max_num_batched_tokens tokens."""
        t, done = 0.0, 0
        while done < prompt_len:
            n = min(self.max_num_batched_tokens, prompt_len - done)
            t += self.step_time([(done, n)])
            done += n
        return t

    # -- files --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cost model fields {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    def replace(self, **changes) -> "CostModel":
        return dataclasses.replace(self, **changes)


# -- presets ----------------------------------------------------------------------------------
_LLAMA3_8B = dict(
    num_params=8_030_261_248 - 128_256 * 4096, weight_bytes=2 * 8_030_261_248,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, kv_dtype_bytes=2,
)


def _h200_llama3_8b() -> CostModel:
    card = 143_771 * MiB  # what an H200 (datasheet: 141 GB) reports
    weights = _LLAMA3_8B["weight_bytes"]
    return CostModel(
        name="h200-llama3-8b", **_LLAMA3_8B,
        peak_flops=989.5e12, mem_bandwidth=4.8e12, kv_memory=int(0.3 * card - weights),
        host_link_bandwidth=64e9, max_num_seqs=256, max_num_batched_tokens=8192,
        source="H200 SXM datasheet; Llama3-8B model card; SGLang mem-frac 0.3 (tokenflow §7.3); see sim/cost.py",
    )


def _rtx4090_llama3_8b() -> CostModel:
    card = 24_564 * MiB
    weights = _LLAMA3_8B["weight_bytes"]
    reserved = (512 + 1.5 * 2048 + 2 * 24 + 128) * MiB  # SGLang's default reserve for a < 35 GiB card
    return CostModel(
        name="rtx4090-llama3-8b", **_LLAMA3_8B,
        peak_flops=165.2e12, mem_bandwidth=1008e9, kv_memory=int(card - reserved - weights),
        host_link_bandwidth=31.5e9, max_num_seqs=256, max_num_batched_tokens=2048,
        source="Ada architecture whitepaper (RTX 4090); Llama3-8B model card; SGLang default mem-frac; see sim/cost.py",
    )


def _a100_llama2_7b() -> CostModel:
    card = 81_920 * MiB
    weights = 2 * 6_738_415_616
    return CostModel(
        name="a100-llama2-7b", num_params=6_738_415_616 - 32_000 * 4096, weight_bytes=weights,
        num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, kv_dtype_bytes=2,
        peak_flops=312e12, mem_bandwidth=2039e9, kv_memory=int(0.85 * card - weights), host_link_bandwidth=31.5e9,
        max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=32_768,
        source="A100 SXM4 80GB datasheet; Llama-2-7B config; TokenLake §7 setup; mem-frac 0.85 assumed; "
               "see sim/cost.py",
    )


def fig6_cost_model() -> CostModel:
    """TokenFlow Fig. 6 (§4.1): every running request decodes at 40 tokens/s whatever the batch,
    two at a time; prefill costs next to nothing. The per-step overhead is the whole step."""
    return CostModel(
        name="fig6", num_params=1e3, weight_bytes=0.0, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1,
        kv_dtype_bytes=1, peak_flops=1e15, mem_bandwidth=1e15, kv_memory=4096 * 16 * 2,
        host_link_bandwidth=1e12, compute_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead=1 / 40,
        max_num_seqs=2, max_num_batched_tokens=512, source="tokenflow.txt §4.1, Fig. 6",
    )


PRESETS = types.MappingProxyType({
    "h200-llama3-8b": _h200_llama3_8b,
    "rtx4090-llama3-8b": _rtx4090_llama3_8b,
    "a100-llama2-7b": _a100_llama2_7b,
    "fig6": fig6_cost_model,
})

COST_MODEL_FILE_KIND = "tokenflowd-cost-model"


def save_cost_model(model: CostModel, path: str | Path, calibration: dict | None = None) -> None:
    data = {"kind": COST_MODEL_FILE_KIND, "cost_model": model.to_dict(), "calibration": calibration or {}}
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def load_cost_model_file(path: str | Path) -> CostModel:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read cost model file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"cost model file {path} is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != COST_MODEL_FILE_KIND:
        raise ValueError(f"{path} is not a cost model file (write one with `tokenflowd calibrate --out {path}`)")
    return CostModel.from_dict(data["cost_model"])


def cost_model(spec: str) -> CostModel:
    """A preset name, `calibrated:FILE.json`, or a path to such a file."""
    if spec in PRESETS:
        return PRESETS[spec]()
    if spec.startswith("calibrated:"):
        return load_cost_model_file(spec.split(":", 1)[1])
    if spec.endswith(".json"):
        return load_cost_model_file(spec)
    raise ValueError(f"unknown cost model {spec!r}; choose one of {', '.join(PRESETS)} or calibrated:FILE.json")
