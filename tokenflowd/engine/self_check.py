"""The engine's fast paths checked against its plain ones at start-up, before it says READY.

    attention   the configured backend (flashinfer on CUDA; on a CPU the torch backend with its
                paged decode kernel) against the torch backend gathering pages: one tiny prefill
                and one decode, each on a private KV cache of a few pages
    fused ops   where the attention check fails with flashinfer's fused layer ops, the same check
                with plain ops: passing, it is the fused ops that failed (only they step down)
    graphs      CUDA-graph decode replays (one request, and the largest captured batch) against the
                same decodes run eagerly, on the runner's own cache (no request holds a page yet)

A check that raises, or logits that disagree, fail that path: start-up steps down from it
(startup.py), says so in its log, and reports it (Ready.fallback: /health and /metrics).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenflowd.engine.attention.base import AttentionBackend, AttentionInputs
from tokenflowd.engine.startup import ATTENTION, FUSED, GRAPHS, describe_error

log = logging.getLogger(__name__)

PROMPT_LEN = 19  # tokens: over a page boundary at page_size 16, and a partial last page


def logits_differ(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None when `got` matches `want` as two kernels of one computation should in the engine's
    dtype: the same greedy token, and every logit within 5% of the logits' range (bf16 keeps 8
    bits of mantissa; accumulation order moves the last of them)."""
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return "non-finite logits"
    if not torch.equal(got.argmax(-1), want.argmax(-1)):
        return f"greedy tokens {got.argmax(-1).tolist()} != {want.argmax(-1).tolist()}"
    err = (got - want).abs().max().item()
    scale = (want.max() - want.min()).item() or 1.0
    return None if err <= 0.05 * scale else f"logits differ by {err:.3g} (range {scale:.3g})"


def run_tiny(model, attn: AttentionBackend, vocab_size: int) -> torch.Tensor:
    """Logits [2, vocab] of a PROMPT_LEN-token prefill's last position and of one decode after it,
    on a private KV cache (pages 0..n-1) of `attn`'s layout."""
    dev, ps = attn.device, attn.page_size
    num_pages = -(-(PROMPT_LEN + 1) // ps)
    kv_layers = [torch.zeros(attn.kv_cache_shape(num_pages), dtype=attn.dtype, device=dev)
                 for _ in range(model.cfg.num_layers)]
    table = list(range(num_pages))
    ids = [(7919 * i + 13) % vocab_size for i in range(PROMPT_LEN)]
    out = []
    for start, chunk in ((0, ids), (PROMPT_LEN, None)):
        if chunk is None:  # the decode: the prefill's greedy token
            chunk = [int(out[-1].argmax())]
        pos = np.arange(start, start + len(chunk))
        slots = torch.as_tensor(np.asarray(table)[pos // ps] * ps + pos % ps, dtype=torch.int64, device=dev)
        inputs = AttentionInputs([0, len(chunk)], [start + len(chunk)], [table], slots)
        hidden = model(torch.tensor(chunk, dtype=torch.int64, device=dev), torch.as_tensor(pos, device=dev),
                       kv_layers, attn, attn.prepare(inputs))
        out.append(model.compute_logits(hidden[-1:])[0])
    return torch.stack(out)


def check_attention(model, candidate: AttentionBackend, reference: AttentionBackend, vocab_size: int) -> str | None:
    """What is wrong with `candidate` against `reference` (None: nothing)."""
    try:
        return logits_differ(run_tiny(model, candidate, vocab_size), run_tiny(model, reference, vocab_size))
    except Exception as e:  # a kernel that cannot run here (architecture, build) is a failed check too
        return describe_error(e)


def check_graphs(runner) -> str | None:
    """Decodes replayed from CUDA graphs and run eagerly give the same logits: one request, and as
    many as the largest graph holds (each request its own last page, the pages before it shared),
    on the runner's own cache while no request holds a page. None, or what differs."""
    from tokenflowd.engine.request import SamplingParams, SamplingRow
    from tokenflowd.engine.scheduler import ScheduledBatch

    shared = PROMPT_LEN // runner.page_size  # pages before the one each decode writes its token in
    largest = max(1, min(runner.graphs.max_batch, runner.num_pages - shared))
    row = SamplingRow(SamplingParams(temperature=0.0), None, 0, frozenset())
    vocab = runner.model_config.vocab_size
    try:
        for n in sorted({1, largest}):
            tables = [list(range(shared)) + [shared + i] for i in range(n)]
            batch = ScheduledBatch([f"self-check-{i}" for i in range(n)], [1] * n, [PROMPT_LEN] * n,
                                   [[(7919 * i + 13) % vocab] for i in range(n)], tables, [row] * n)
            replayed, _ = runner.compute_logits(batch)
            graphs, runner.graphs = runner.graphs, None
            try:
                eager, _ = runner.compute_logits(batch)
            finally:
                runner.graphs = graphs
            problem = logits_differ(replayed, eager)
            if problem:
                return f"batch of {n}: {problem}"
        return None
    except Exception as e:
        return describe_error(e)


def self_check(runner) -> dict[str, str]:
    """What failed of the runner's fast paths, by path ("attention", "graphs"); empty when they
    agree with the plain ones, or it has none."""
    from tokenflowd.engine.attention.torch_backend import TorchAttentionBackend

    failed = {}
    a = runner.attn
    if not isinstance(a, TorchAttentionBackend) or a.kernel is not None:
        reference = TorchAttentionBackend(a.num_heads, a.num_kv_heads, a.head_dim, a.page_size, a.dtype, a.device,
                                          paged_kernel=False)
        problem = check_attention(runner.model, a, reference, runner.model_config.vocab_size)
        if problem and a.fused_ops:
            # the backend's fused layer ops, or its attention? The same check with plain ops tells.
            a.fused_ops = False
            try:
                plain = check_attention(runner.model, a, reference, runner.model_config.vocab_size)
            finally:
                a.fused_ops = True
            if plain is None:
                failed[FUSED] = f"{a.name}'s fused layer ops against the torch backend: {problem}"
                problem = None
        if problem:
            failed[ATTENTION] = f"{a.name} against the torch backend: {problem}"
    if runner.graphs is not None and not failed:
        problem = check_graphs(runner)
        if problem:
            failed[GRAPHS] = f"CUDA graph replay against eager: {problem}"
    return failed
