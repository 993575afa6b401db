"""The memory budgets of a GPU node, as arithmetic (no GPU): the KV cache is a share of the device
less this process's own use, whatever else runs there; the host tiers of a node's engines split
a share of its RAM; the launcher tells each engine how many share the node and the GPU."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tokenflowd.config import EngineConfig
from tokenflowd.engine.model.dummy import DUMMY_PRESETS
from tokenflowd.engine.memory import activation_bytes, kv_budget, step_reserve
from tokenflowd.offload.build import HOST_POOLS_PER_DEVICE_POOL, HOST_RAM_SHARE, host_budget

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from memory_budget import table  # noqa: E402

GB, TB = 10**9, 10**12


def test_eight_engines_on_a_2tb_8x141gb_node_lock_a_quarter_of_ram_in_all():
    rows = {r["engines"]: r for r in table(2 * TB, 141 * GB, 8)}
    for engines, r in rows.items():
        assert r["host_node"] <= HOST_RAM_SHARE * 2 * TB  # never more than the node's share, whatever the count
        assert r["host_per_engine"] == min(HOST_POOLS_PER_DEVICE_POOL * r["kv_per_engine"],
                                           int(HOST_RAM_SHARE * 2 * TB) // engines)
    assert rows[8]["host_per_engine"] == 62.5 * GB and rows[1]["host_per_engine"] == 4 * rows[1]["kv_per_engine"]
    # the KV cache: 90% of 141 GB less the 8B model's 16 GB of weights, workspaces, graphs, staging
    kv = rows[8]["kv_per_engine"]
    assert 100 * GB < kv < 0.9 * 141 * GB - 16 * GB
    assert all(r["kv_per_engine"] == kv for r in rows.values())  # one GPU each: the same budget


def test_the_kv_budget_counts_what_the_process_holds_and_not_what_others_do():
    total, share = 141 * GB, 0.45  # two engines on one GPU (the launcher halves the share)
    first = kv_budget(total, share, own=17 * GB, reserved=4 * GB)
    second = kv_budget(total, share, own=17 * GB, reserved=4 * GB)  # started after the first took its part
    assert first == second == int(0.45 * total) - 21 * GB
    assert kv_budget(total, 0.1, own=17 * GB, reserved=4 * GB) < 0  # the engine refuses to start (runner.py)


def test_the_reserve_counts_activations_graphs_and_both_copy_lanes():
    cfg = DUMMY_PRESETS["llama3-8b"]
    base = dict(model="dummy:llama3-8b", device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                max_num_batched_tokens=8192, max_num_seqs=256)
    full = step_reserve(EngineConfig(**base, cuda_graphs=True), cfg, torch.bfloat16, 131072)
    assert set(full) == {"activations", "CUDA graphs", "copy staging"}
    assert full["activations"] == activation_bytes(cfg, 8192, 256, torch.bfloat16)
    assert full["copy staging"] == 2 * (512 << 20)
    assert full["CUDA graphs"] > 256 * (131072 // 16) * 4  # the shared page table of the largest graph, at least
    bare = step_reserve(EngineConfig(**base, cuda_graphs=False, offload="none"), cfg, torch.bfloat16, 131072)
    assert set(bare) == {"activations"}
    # the pool's pages wrappers, each planned for one source as a step first reads it: 9 MiB each
    pooled = step_reserve(EngineConfig(**base, cuda_graphs=False, offload="none", pool_mode="read"), cfg,
                          torch.bfloat16, 131072)
    assert pooled["pool pages plans"] == 8 * (9 << 20)


def test_host_budget_on_a_cpu_and_when_asked():
    cpu = EngineConfig(device="cpu", engines_on_node=8)
    assert host_budget(cpu, 3 * GB, ram=2 * TB) == 3 * GB  # the device pool is host memory too
    asked = EngineConfig(device="cuda", dtype="bfloat16", host_kv_memory=7 * GB, engines_on_node=8)
    assert host_budget(asked, 100 * GB, ram=2 * TB) == 7 * GB


def test_the_launcher_tells_engines_how_many_share_the_node_and_the_gpu(monkeypatch):
    from tokenflowd.daemon import launcher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    config = EngineConfig(device="cuda", dtype="bfloat16")
    configs = launcher.engine_configs(config, 4)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in configs] == ["0", "1", "0", "1"]
    assert all(c.engines_on_node == 4 for c, _ in configs)
    assert all(c.gpu_memory_utilization == pytest.approx(config.gpu_memory_utilization / 2) for c, _ in configs)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cpu = launcher.engine_configs(EngineConfig(device="cpu"), 2)
    assert [c.engines_on_node for c, _ in cpu] == [2, 2]
