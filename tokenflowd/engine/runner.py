"""Owns the model, the KV cache tensor and the attention backend; turns a ScheduledBatch into tokens."""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np
import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.attention.base import AttentionBackend, AttentionInputs
from tokenflowd.engine.executor import Executor, Launched
from tokenflowd.engine.grammar import MaskWorker
from tokenflowd.engine.memory import kv_budget, step_reserve
from tokenflowd.engine.model.config import ModelConfig
from tokenflowd.engine.model.llama import LlamaModel
from tokenflowd.engine.model.weights import LoadedModel
from tokenflowd.engine.sampler import Logprobs, Sampler
from tokenflowd.engine.scheduler import ScheduledBatch
from tokenflowd.engine.staging import concat_to_device
from tokenflowd.engine.startup import ATTENTION, FUSED, GRAPHS, FastPaths, guarded
from tokenflowd.protocol import TokenLogprobs

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_MEMORY = 1 << 30


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    return cfg.kv_elements_per_token * page_size * torch.empty((), dtype=dtype).element_size()


class StepAttention(Protocol):
    """Wraps the attention the model's layers call (`forward(layer, q, k, v, kv_cache, meta)`) for one
    step, or returns None to leave it as it is. `query_start`: the batch's query offsets."""

    def __call__(self, attn: Any, batch: ScheduledBatch, query_start: list[int]) -> Any | None: ...


class LayerHook:
    """The attention the model's layers call, with `after(layer)` called once each layer's KV is in
    the cache (llama.py calls only `forward`)."""

    def __init__(self, inner, after: Callable[[int], None]) -> None:
        self.inner = inner
        self.after = after
        self.fused_ops = getattr(inner, "fused_ops", False)  # the layers' small ops: as the inner one's

    def forward(self, layer: int, q, k, v, kv_cache, meta):
        o = self.inner.forward(layer, q, k, v, kv_cache, meta)
        self.after(layer)
        return o


class ModelRunner(Executor):
    cold_start = True
    overlaps = True

    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 kv_memory: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> None:
        """`kv_memory(shape, dtype)`: a zeroed tensor to hold the KV cache (the pool's read mode
        puts it in shared memory); None: the device's memory."""
        self.config = config
        self.kv_memory = kv_memory
        # Wrappers the engine's optional features put around the attention for a step (the engine
        # process adds them: pool/engine_hooks.py reads prefixes that peers hold); each returns None
        # where it has nothing to do in that step, and a step with no wrapper may replay a graph.
        self.step_attention: list[StepAttention] = []
        # called with each layer's index once its KV is in the cache, for the step about to run
        # (federation/streaming.py: a prefill node sends each layer as it ends); None: no hook
        self.layer_hook: Callable[[int], None] | None = None
        self.model_config = loaded.config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # (--device cuda:N) what captures graphs and asks for peer access
        self.dtype = getattr(torch, config.dtype)
        self.page_size = config.page_size
        self._init_threads()
        self._init_model(loaded)
        # What a fast path raises while it is built is its failure, which start-up steps down from
        # (startup.py); the plain path's errors are the engine's.
        device = str(self.device)
        if config.attention_backend == "flashinfer" or (config.paged_kernel and self.device.type == "cpu"):
            guarded(ATTENTION, self._init_attention, device)
        else:
            self._init_attention()
        if self.attn.fused_ops:
            # the fused layer ops (their fp32 RoPE cache included), before the KV budget counts what
            # this process holds
            guarded(FUSED, lambda: self.model.ops_for(self.attn), device)
        self._init_kv_cache()
        self.graphs = None
        if config.cuda_graphs:
            guarded(GRAPHS, self._init_cuda_graphs, device)
        self.sampler = Sampler(config.seed)
        self._last_tokens: torch.Tensor | None = None  # the last step's sampled ids, on the device
        self._last_end = None  # on a GPU: the event at the end of the last launched step
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # on a CPU: computes launched steps
        # on a CPU: the last launched step, which copies of the KV it writes wait for (offload/copier.py)
        self.last_launched: concurrent.futures.Future | None = None
        self._logprobs: dict[int, TokenLogprobs] = {}  # the step last executed or collected: batch row -> its
        self.masks = MaskWorker(pin=self.device.type == "cuda")  # structured output's token masks, computed while the forward runs

    # -- start-up -----------------------------------------------------------------------------
    def _init_threads(self) -> None:
        if self.device.type == "cpu":
            # Denormal floats slow CPU arithmetic about tenfold (bench/results/code_figures.md);
            # flushing them to zero changes no result that matters.
            torch.set_flush_denormal(True)
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)

    def _init_model(self, loaded: LoadedModel) -> None:
        cfg = loaded.config
        max_len = min(self.config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.model = LlamaModel(cfg, max_len, self.dtype, self.device, self.config.quantization)
        self.model.load_weights(dict(loaded.weights))
        self.max_model_len = max_len

    def _kv_budget(self) -> int:
        """Bytes of KV cache: --kv-cache-memory, else on a GPU its --gpu-memory-utilization share
        less what this process holds or will hold besides the KV cache (kv_budget)."""
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_MEMORY
        total = torch.cuda.get_device_properties(self.device).total_memory
        own = torch.cuda.memory_allocated(self.device)  # the weights and the attention workspaces, built first
        reserved = step_reserve(self.config, self.model_config, self.dtype, self.max_model_len)
        budget = kv_budget(total, self.config.gpu_memory_utilization, own, sum(reserved.values()))
        free, _ = torch.cuda.mem_get_info(self.device)
        room = free - sum(reserved.values())
        log.info("KV budget: %.2f GiB = %.2f x %.1f GiB less %.2f GiB held (weights, workspaces) and %s",
                 budget / 2**30, self.config.gpu_memory_utilization, total / 2**30, own / 2**30,
                 ", ".join(f"{v / 2**30:.2f} GiB {k}" for k, v in reserved.items()))
        if budget > room:  # other processes hold more of the device than their share
            log.warning("the device has %.2f GiB free for a KV budget of %.2f GiB: the KV cache gets %.2f GiB "
                        "(another process uses more than 1 - gpu_memory_utilization of it)",
                        free / 2**30, budget / 2**30, room / 2**30)
            budget = room
        return int(budget)

    def _init_kv_cache(self) -> None:
        cfg = self.model_config
        pb = page_bytes(cfg, self.page_size, self.dtype)
        num_pages = self.config.num_pages or self._kv_budget() // pb
        if num_pages < 2:
            raise ValueError(
                f"the KV cache budget holds {num_pages} pages of {pb} bytes: raise --kv-cache-memory "
                f"(at least {2 * pb} bytes) or lower the model size"
            )
        self.num_pages = num_pages
        # kv_cache: [layers, *attn.kv_cache_shape(num_pages + 1)] dtype device
        # The extra last page is scratch for the padding rows of CUDA-graph batches; the pool never
        # hands it out.
        # NOTE: zeroed, not empty. Attention reads whole pages and masks the slots past a sequence's
        # end; masked weights are 0, and 0 * NaN from never-written memory would still be NaN.
        shape = (cfg.num_layers, *self.attn.kv_cache_shape(num_pages + 1))
        self.kv_cache = (self.kv_memory(shape, self.dtype) if self.kv_memory is not None
                         else torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.kv_layers = list(self.kv_cache.unbind(0))
        self.max_model_len = min(self.max_model_len, num_pages * self.page_size)
        log.info("KV cache: %d pages x %d tokens (%.1f MiB), max_model_len %d",
                 num_pages, self.page_size, num_pages * pb / 2**20, self.max_model_len)

    def _init_attention(self) -> None:
        cfg = self.model_config
        args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.page_size, self.dtype, self.device)
        if self.config.attention_backend == "flashinfer":
            from tokenflowd.engine.attention.flashinfer_backend import FlashInferBackend

            self.attn: AttentionBackend = FlashInferBackend(*args)
            self.attn.fused_ops = not self.config.plain_layer_ops
        else:
            from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend

            self.attn = TorchAttentionBackend(*args, paged_kernel=self.config.paged_kernel)

    def _init_cuda_graphs(self) -> None:
        from tokenflowd.engine.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.attn, self.kv_layers, scratch_page=self.num_pages,
                                   max_batch=self.config.max_num_seqs, max_model_len=self.max_model_len)

    @property
    def paths(self) -> FastPaths:
        """The fast paths this runner actually runs (a CPU kernel that could not be built is not one)."""
        return FastPaths(self.attn.name, self.graphs is not None, getattr(self.attn, "kernel", None) is not None,
                         self.attn.name == "flashinfer" and not self.attn.fused_ops)

    @property
    def logits_width(self) -> int:
        """Logits per row (the sampler's draws are this wide)."""
        return self.model.lm_head.shape[0]

    # -- one step -----------------------------------------------------------------------------
    def _prepare(self, batch: ScheduledBatch) -> "_Inputs":
        """Flat inputs of the step, the query rows that sample and the batch indices they belong to,
        and where a row's input id is a token an earlier launched step samples (`prev_sample`)."""
        ps = self.page_size
        ids, pos, slots = [], [], []
        query_start, seq_lens, tables, sample_rows, sampling = [0], [], [], [], []
        sub_at, sub_from = [], []
        offsets = batch.offsets or [0] * len(batch)
        prev = batch.prev_sample or [-1] * len(batch)
        for i, (start, n, block_table) in enumerate(zip(batch.positions, batch.num_tokens, batch.block_tables)):
            p = np.arange(start, start + n)
            table = np.asarray(block_table, dtype=np.int64)
            ids.append(np.asarray(batch.input_ids[i], dtype=np.int64))
            pos.append(p + offsets[i])  # in the sequence: after the prefix peers of the pool hold
            slots.append(table[p // ps] * ps + p % ps)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            tables.append(block_table)
            if prev[i] >= 0:  # its last input is a token still on the device
                sub_at.append(query_start[-1] - 1)
                sub_from.append(prev[i])
            if batch.sampling[i] is not None:  # the chunk reaches its last known token: it samples
                sample_rows.append(query_start[-1] - 1)
                sampling.append(i)
        T = query_start[-1]
        # one host buffer (page-locked on a GPU) and one non-blocking copy for every index of the step
        flat = concat_to_device([*ids, *pos, *slots, np.asarray(sample_rows + sub_at + sub_from, dtype=np.int64)],
                                torch.int64, self.device)
        S, U = len(sample_rows), len(sub_at)
        input_ids, positions, slot_mapping, rows, at, src = flat.split([T, T, T, S, U, U])
        return _Inputs(input_ids, positions, AttentionInputs(query_start, seq_lens, tables, slot_mapping),
                       rows, sampling, at, src)

    def compute_logits(self, batch: ScheduledBatch, inputs: "_Inputs | None" = None,
                       prev: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
        """Logits [S, vocab] fp32 for the S requests of the batch that sample this step, and their
        indices in the batch (a request samples when its chunk reaches its last known token).
        `prev`: the ids the step launched before this one sampled, which rows may read."""
        x = inputs or self._prepare(batch)
        input_ids = x.input_ids
        if len(x.sub_at):  # the tokens the step before sampled, never seen by the host
            # (none where that step failed: its requests ended with it, and these rows are dropped)
            input_ids[x.sub_at] = prev[x.sub_from] if prev is not None else 0
        T = input_ids.shape[0]
        attn = self.attn
        for wrap in self.step_attention:
            attn = wrap(attn, batch, x.attn_inputs.query_start) or attn
        if self.layer_hook is not None:
            attn = LayerHook(attn, self.layer_hook)
        if attn is not self.attn:
            hidden = self.model(input_ids, x.positions, self.kv_layers, attn, self.attn.prepare(x.attn_inputs))
        elif self.graphs is not None and T == len(batch) and T <= self.graphs.max_batch:
            hidden = self.graphs.run(input_ids, x.positions, x.attn_inputs)  # pure decode: replay a graph
        else:
            meta = self.attn.prepare(x.attn_inputs)
            hidden = self.model(input_ids, x.positions, self.kv_layers, self.attn, meta)
        return self.model.compute_logits(hidden[x.rows]), x.sampling

    def _sample(self, batch: ScheduledBatch,
                inputs: "_Inputs | None" = None) -> tuple[torch.Tensor, list[int], Logprobs | None]:
        """The step's sampled ids [S] on the device (kept for the next step's rows), their rows, and
        the logprobs of the rows that ask (on the device)."""
        prev, self._last_tokens = self._last_tokens, None  # a step that fails leaves nothing to read
        masks = self._start_masks(batch, prev)
        logits, sampling = self.compute_logits(batch, inputs, prev)
        pending = [batch.prev_sample[i] for i in sampling] if batch.prev_sample else None
        if sampling:
            rows = [batch.sampling[i] for i in sampling]
            if masks is not None:
                at = {i: j for j, i in enumerate(sampling)}
                masks = ([at[i] for i in masks[0]], masks[1].result())
            tokens, lp = self.sampler.sample_with_logprobs(logits, rows, prev, pending, masks)
        else:
            tokens, lp = torch.empty(0, dtype=torch.int64, device=self.device), None
        self._last_tokens = tokens
        return tokens, sampling, lp

    def _start_masks(self, batch: ScheduledBatch, prev: torch.Tensor | None) -> tuple[list[int], "Any"] | None:
        """(batch rows, a Future of their masks) for the rows a grammar constrains; None: no row."""
        rows = [i for i, r in enumerate(batch.sampling) if r is not None and r.grammar is not None]
        if not rows:
            return None
        pending = [batch.prev_sample[i] for i in rows] if batch.prev_sample else None
        samplings = [batch.sampling[i] for i in rows]
        # where each row's sampled token goes: ahead, the PLACEHOLDER scheduling put there
        ends = [batch.token_index[i] if batch.ahead else len(r.tokens) for i, r in zip(rows, samplings)]
        return rows, self.masks.start(samplings, ends, prev, pending)

    @staticmethod
    def _rows(n: int, sampling: list[int], tokens: list[int]) -> list[int | None]:
        out: list[int | None] = [None] * n
        for i, t in zip(sampling, tokens):
            out[i] = t
        return out

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Run one step, finished when it returns; the sampled token of each batch request, None for
        a mid-prompt chunk."""
        tokens, sampling, lp = self._sample(batch)
        self._logprobs = _host_logprobs(lp, sampling)
        if not sampling and self.device.type == "cuda":
            # nothing to read back, so nothing waited for the step: the scheduler publishes its
            # pages next, and a pool peer reads them from its own process (overlap is off under the
            # pool); the next plan, too, would rewrite flashinfer's page-locked buffer under this
            # step's queued copy
            torch.cuda.current_stream(self.device).synchronize()
        return self._rows(len(batch), sampling, tokens.tolist())

    def take_logprobs(self) -> dict[int, TokenLogprobs]:
        logprobs, self._logprobs = self._logprobs, {}
        return logprobs

    # -- overlapped steps (engine/core.py) -----------------------------------------------------
    def launch(self, batch: ScheduledBatch) -> Launched:
        """Start the step and return: on a GPU its kernels are queued on the compute stream and its
        tokens copied, non-blocking, into pinned memory behind an event; on a CPU a worker thread
        computes it (torch's kernels drop the GIL) while the engine schedules the next one."""
        x = self._prepare(batch)
        if self.device.type == "cuda":
            # NOTE: flashinfer's plan writes a page-locked host buffer that the last plan's copy may
            # not have read yet: planning waits for that copy (queued before the last step's
            # kernels, so it has run as soon as the step before ended), not for the last step.
            self.attn.wait_planned()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            tokens, sampling, lp = self._sample(batch, x)
            host = _to_host(tokens)
            if lp is not None:
                lp = lp._replace(chosen=_to_host(lp.chosen), top_ids=_to_host(lp.top_ids),
                                 top_logprobs=_to_host(lp.top_logprobs))
            end.record()
            self._last_end = end
            return Launched(batch, work=(start, end, host, sampling, lp))
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        future = self._worker.submit(self._timed_step, batch, x)
        self.last_launched = future
        return Launched(batch, work=future)

    @property
    def copy_fence(self) -> Callable[[], concurrent.futures.Future | None] | None:
        """What KV copies wait for before they touch pages (kv/copier.py `fence`): on a CPU the step
        last launched, on its worker thread; on a GPU nothing (the copy streams wait for the compute
        stream)."""
        return None if self.device.type == "cuda" else (lambda: self.last_launched)

    def _timed_step(self, batch: ScheduledBatch,
                    x: "_Inputs") -> tuple[list[int], list[int], float, dict[int, TokenLogprobs]]:
        t0 = time.perf_counter()
        tokens, sampling, lp = self._sample(batch, x)
        out = tokens.tolist()
        return out, sampling, time.perf_counter() - t0, _host_logprobs(lp, sampling)

    def collect(self, launched: Launched) -> list[int | None]:
        if isinstance(launched.work, concurrent.futures.Future):
            tokens, sampling, launched.seconds, self._logprobs = launched.work.result()
        else:
            start, end, host, sampling, lp = launched.work
            end.synchronize()
            launched.seconds = start.elapsed_time(end) / 1e3
            tokens = host.tolist()
            self._logprobs = _host_logprobs(lp, sampling)
        return self._rows(len(launched.batch), sampling, tokens)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.masks.close()


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of `t`, issued non-blocking (complete once the step's end event is)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _host_logprobs(lp: Logprobs | None, sampling: list[int]) -> dict[int, TokenLogprobs]:
    """Batch row -> its sampled token's logprobs, from the sampler's (host or finished) tensors."""
    if lp is None:
        return {}
    chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist()
    return {sampling[j]: TokenLogprobs(c, i[:k], v[:k])
            for j, k, c, i, v in zip(lp.rows, lp.ks, chosen, ids, values)}


class _Inputs(NamedTuple):
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_inputs: AttentionInputs
    rows: torch.Tensor  # query rows that sample
    sampling: list[int]  # their batch rows
    sub_at: torch.Tensor  # query rows whose input id is an earlier step's token ...
    sub_from: torch.Tensor  # ... its index among that step's sampled tokens
