"""When the engine computing a new segment that is homed on a peer writes it into its home
(`--pool-placement home`; pool/engine_hooks.py `_hand_off`, and the node simulator's twin).

    prompt   once the request's whole prompt is computed: the rest of the prompt attends to its own
             pages, but the engine first needs room for all of the prompt it computes, and takes it
             from what its cache keeps for the pool, only to let those pages go once they move
    segment  each whole segment as soon as it is computed: room for one chunk, and every later
             chunk of the prompt attends to the segments gone before it through the pool's path
    auto     (the default) segment by segment while the part of the prompt this engine has still
             to compute is over a quarter of its KV pages, then at the prompt's end (what is handed
             off leaves the request's own prompt: a 12K-token prompt on 28K of KV sends its first
             segments as they are computed and the rest of them once the prompt is)

Node simulator, 8 engines, a quarter of the A100's KV (28K tokens an engine), 32 runs of 12K-token
documents (bench/node_contexts.py: 4 workloads, seeds 0-3, light and overload): throughput over
routing's, geo mean 1.06x at the prompt's end (0.73x-1.76x), 1.09x segment by segment
(0.90x-1.49x), 1.09x auto (0.997x-1.49x: the three below 1x at a light load); within TokenLake's
SLO 0.78, 0.81, 0.81. Full KV (the A100's 113K, the H200's 803K): segment by segment fell to 0.71x
and 0.67x routing's throughput on the H200's documents in overload (within the SLO 0.44 and 0.13,
routing 0.94 and 0.73): every chunk's query rows went to the homes, where the whole prompt fitted;
auto kept the prompt's end there (1.03x, 1.09x) and went segment by segment for the A100's long
sessions (0.90x -> 1.14x).
"""
from __future__ import annotations
# auto: a prompt computed here that would take over 1/ROOM_SHARE of the engine's KV goes segment by
# segment. Between the simulator's cases: the A100's documents (24K tokens on average on 113K of KV,
# about a fifth) served more at the prompt's end in overload (1.03x routing's against 0.97x), its
# sessions (contexts to 32K, over a quarter) and a quarter of its KV (12K-token documents on 28K)
# more segment by segment.
ROOM_SHARE = 4


def by_segment(hand_off: str, computed_tokens: int, kv_tokens: int) -> bool:
    """Whether a request computing `computed_tokens` of its prompt on an engine of `kv_tokens` of KV
    writes each new segment into its home as soon as it is computed (else once the prompt is).
    `hand_off`: one of config.POOL_HAND_OFFS (checked once with the config, not each step)."""
    return hand_off == "segment" or (hand_off == "auto" and computed_tokens * ROOM_SHARE > kv_tokens)


def tail_end(prompt_tokens: int, page_size: int, segment_pages: int) -> int:
    """Where the prompt's last whole segment ends, in pages: the segment the request's tail (the
    prompt's last, partial segment and its output) follows. A new segment ending there and homed on
    a peer stays in the computing engine's cache while the request runs, and goes to its home when
    the request finishes: the request reads it at every step, and where it is the request's own (a
    chat's turn behind a shared system prompt, a question behind its document's last part) no other
    reads it while it runs. Written into its home at once, every decode step read it over the link.
    The node simulator, full KV, seeds 0-1 (bench/results/node_contexts_tail_s0-1.json): the H200
    preset's short chats behind one system prompt went from 0.982x / 0.955x routing's throughput to
    0.999x / 0.984x at a light load, from 1.010x / 0.952x to 1.031x / 0.976x in overload. Over the
    A100's slower link the write at the end costs a little: its system prompt 1.009x / 1.066x ->
    0.984x / 1.048x at a light load, its trace in overload 2-3% of the pool's throughput."""
    return (prompt_tokens - 1) // page_size // segment_pages * segment_pages
