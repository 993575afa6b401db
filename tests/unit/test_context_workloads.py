"""Synthetic workloads of shared long contexts (TokenLake's kind): their shapes, their sharing, and
the load generator and the simulators that take them."""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import replace

import pytest

from loadgen.cli import parse_args
from loadgen.measure import workload_from_args
from loadgen.workload import LoadWorkload, build_requests, describe, prompt_text
from tokenflowd.cli import main
from tokenflowd.sim.workload import (BLOCK_TOKENS, CHAT_LIMIT, CONTEXT_SHAPES, WorkloadSpec, build_workload,
                                     parse_context_shape)


def workload(shape: str, n: int = 400, **kw):
    return build_workload(WorkloadSpec("poisson", n, rate=2.0, contexts=parse_context_shape(shape), **kw))


def test_documents_share_whole_blocks_of_a_24k_mean_document_among_about_eight_questions():
    reqs = workload("documents", 2000)
    assert reqs == workload("documents", 2000)  # the same spec, the same requests
    by_doc = defaultdict(list)
    for r in reqs:
        by_doc[r.hash_ids[0]].append(r)
    doc_tokens, uses = [], []
    for doc in by_doc.values():
        blocks = min(len(r.hash_ids) for r in doc) - 1  # the document, then at least one question block
        shared = doc[0].hash_ids[:blocks]
        assert all(r.hash_ids[:blocks] == shared for r in doc)
        assert len({r.hash_ids[blocks:] for r in doc}) == len(doc)  # each its own question
        doc_tokens.append(blocks * BLOCK_TOKENS)
        uses.append(len(doc))
    assert 20_000 < statistics.fmean(doc_tokens) < 28_000  # LooGLE: a 24K-token mean (§7)
    assert 6 < statistics.fmean(uses) < 10  # about 8 questions a document
    assert all(len(r.hash_ids) == -(-r.prompt_len // BLOCK_TOKENS) for r in reqs)


def test_a_session_turn_carries_every_earlier_turn_and_sessions_average_five_turns():
    reqs = workload("sessions:scale=0.1", 1000)
    sessions = defaultdict(list)
    for r in reqs:
        sessions[r.hash_ids[0]].append(r)
    for turns in sessions.values():
        for before, after in zip(turns, turns[1:]):
            assert after.arrival_time >= before.arrival_time
            # the next turn's prompt begins with this turn's whole prompt (its last block shared too)
            assert after.hash_ids[: len(before.hash_ids)] == before.hash_ids
            assert after.prompt_len > before.prompt_len + before.output_len - BLOCK_TOKENS
    assert 4 < statistics.fmean(len(t) for t in sessions.values()) < 6
    firsts = [t[0].prompt_len for t in sessions.values()]
    assert 0.8 * 22_700 < statistics.fmean(firsts) < 1.2 * 22_700  # 227K, scaled by 0.1


def test_every_chat_carries_the_one_system_prompt_and_stays_under_the_sharegpt_bound():
    reqs = workload("system-prompt")
    system = reqs[0].hash_ids[: 2048 // BLOCK_TOKENS]
    assert all(r.hash_ids[: len(system)] == system for r in reqs)
    assert len({r.hash_ids[len(system):] for r in reqs}) == len(reqs)
    assert all(r.prompt_len - 2048 + r.output_len <= CHAT_LIMIT for r in reqs)


def test_active_contexts_bound_the_working_set_and_scale_shrinks_them():
    few = {r.hash_ids[0] for r in workload("documents:active=2", 40)}
    many = {r.hash_ids[0] for r in workload("documents:active=32", 40)}
    assert len(few) < len(many)
    small = workload("documents:scale=0.01", 200)
    assert statistics.fmean(r.prompt_len for r in small) < 1_000


def test_a_prompt_cap_cuts_documents_and_ends_sessions_that_would_outgrow_it():
    for shape in ("documents", "sessions"):
        reqs = workload(shape, 300, max_prompt_len=8_192)
        assert max(r.prompt_len for r in reqs) <= 8_192
        assert all(len(r.hash_ids) == -(-r.prompt_len // BLOCK_TOKENS) for r in reqs)


@pytest.mark.parametrize("spec", ["docs", "documents:active=0", "documents:uses=0.5", "documents:colour=3",
                                  "sessions:scale=x", "documents:active"])
def test_a_bad_context_shape_is_refused(spec):
    with pytest.raises(ValueError):
        parse_context_shape(spec)


def test_a_trace_takes_no_context_shape():
    with pytest.raises(ValueError, match="trace"):
        WorkloadSpec("trace", 10, contexts=CONTEXT_SHAPES["documents"])


def test_loadgen_sends_synthetic_documents_whose_texts_share_the_document():
    a = parse_args(["run", "--dataset-name", "synthetic", "--contexts", "documents:scale=0.05:active=2",
                    "--block-tokens", "64", "--num-prompts", "12", "--request-rate", "4"])
    w = workload_from_args(a)
    reqs = build_requests(w)
    assert reqs == build_requests(w)
    assert describe(w)["contexts"]["kind"] == "documents" and describe(w)["arrivals"] == "poisson"
    by_doc = defaultdict(list)
    for r in reqs:
        by_doc[r.hash_ids[0]].append(r)
    shared = max(by_doc.values(), key=len)
    assert len(shared) >= 2
    blocks = min(len(r.hash_ids) for r in shared) - 1
    texts = [prompt_text(r) for r in shared]
    head = prompt_text(replace(shared[0], prompt_len=blocks * 64, hash_ids=shared[0].hash_ids[:blocks]))
    assert all(t.startswith(head) for t in texts) and len(set(texts)) == len(texts)
    with pytest.raises(ValueError, match="--contexts"):
        LoadWorkload(dataset="synthetic")
    with pytest.raises(ValueError, match="--contexts"):
        LoadWorkload(dataset="random", contexts=CONTEXT_SHAPES["documents"])


def test_the_node_simulators_take_a_synthetic_workload(tmp_path, capsys):
    out = tmp_path / "node.json"
    assert main(["sim-node", "--contexts", "documents:scale=0.05:active=4", "--rate", "4", "--num-prompts", "40",
                 "--engines", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"].startswith("synthetic documents")
    assert set(doc["summaries"]) == {"routing", "pool", "pool-write", "pool-local"}
    # the documents are read again: routing's own caches and the pool both hit
    assert all(s["hit_rate"] > 0.3 for s in doc["summaries"].values()), doc["summaries"]
    assert main(["sim-pool", "--contexts", "sessions:scale=0.05", "--rate", "4", "--num-prompts", "40",
                 "--engines", "2"]) == 0
    assert "synthetic sessions" in capsys.readouterr().out
    assert main(["sim-node", "--contexts", "documents", "--num-prompts", "10"]) != 0
    assert "--contexts needs --rate" in capsys.readouterr().err
