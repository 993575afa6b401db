"""Configuration sources: the TOML file, TOKENFLOWD_* variables and flags merge into one frozen,
validated config (later sources win key by key); `serve --print-config` writes what `--config`
reads back."""
from __future__ import annotations

import argparse
import re
from dataclasses import replace

import pytest

from tokenflowd.cli import main, serve_configs
from tokenflowd.config import ENV_PREFIX, env_config, load_config_file, merge_sources

FILE = """
[server]
port = 8100
log_level = "WARNING"
[engine]
policy = "andes"
max_num_seqs = 32
[policy]
schedule_interval = 0.7
"""


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**kw)


def test_env_values_are_typed_by_their_field():
    env = {"TOKENFLOWD_PORT": "9000", "TOKENFLOWD_SCHEDULE_INTERVAL": "1.5", "TOKENFLOWD_ENABLE_PREFIX_CACHING": "no",
           "TOKENFLOWD_KV_CACHE_MEMORY": "2GiB", "TOKENFLOWD_MAX_BODY_SIZE": "64KiB", "TOKENFLOWD_ENGINES": "",
           "TOKENFLOWD_API_KEY": "secret", "OTHER": "x"}
    got = env_config(env)
    assert got == {"server": {"port": 9000, "max_body_size": 65536, "engines": None},
                   "engine": {"enable_prefix_caching": False, "kv_cache_memory": 2 * 2**30},
                   "policy": {"schedule_interval": 1.5}}


@pytest.mark.parametrize("var,value,msg", [
    ("TOKENFLOWD_PROT", "1", "unknown environment variable TOKENFLOWD_PROT"),
    ("TOKENFLOWD_PORT", "eighty", "not a valid int"),
    ("TOKENFLOWD_ENABLE_PREFIX_CACHING", "maybe", "not a valid bool"),
])
def test_bad_env_values_are_refused_by_name(var, value, msg):
    with pytest.raises(ValueError, match=msg):
        env_config({var: value})


def test_file_then_env_then_flags(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text(FILE)
    env = {f"{ENV_PREFIX}PORT": "8200", f"{ENV_PREFIX}MAX_NUM_SEQS": "16"}
    assert merge_sources(load_config_file(str(path)), env_config(env))["server"]["port"] == 8200
    server, engine = serve_configs(args(config=str(path), port=8300, log_level=None), env)
    assert server.port == 8300  # flag over environment over file
    assert server.log_level == "WARNING"  # file only
    assert engine.max_num_seqs == 16 and engine.policy == "andes"  # environment over file
    assert engine.policy_params.schedule_interval == 0.7
    with pytest.raises(ValueError, match="log_level"):
        serve_configs(args(config=str(path), log_level="LOUD"), {})


def test_print_config_round_trips_through_config_check(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TOKENFLOWD_SCHEDULE_INTERVAL", "0.9")
    assert main(["serve", "--print-config", "--policy", "tokenflow", "--port", "8123"]) == 0
    printed = capsys.readouterr().out
    assert "port = 8123" in printed and "schedule_interval = 0.9" in printed and 'policy = "tokenflow"' in printed
    path = tmp_path / "printed.toml"
    path.write_text(printed)
    monkeypatch.delenv("TOKENFLOWD_SCHEDULE_INTERVAL")
    assert main(["config", "check", str(path)]) == 0
    assert capsys.readouterr().out == printed
    path.write_text("[server]\nport = -1\n")
    assert main(["config", "check", str(path)]) == 2
    assert "port must be in" in capsys.readouterr().err


def test_engines_beyond_the_gpus_share_them_round_robin_with_a_share_of_the_memory(monkeypatch):
    from tokenflowd.daemon import launcher
    from tokenflowd.config import EngineConfig

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    cfg = EngineConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.9)
    placed = launcher.engine_configs(cfg, 3)
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in placed] == ["2", "5", "2"]
    assert [c.gpu_memory_utilization for c, _ in placed] == [0.45, 0.9, 0.45]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launcher.engine_configs(cfg, None)] == ["2", "5"]
    assert len(launcher.engine_configs(cfg, 1)) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(launcher, "_cuda_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        launcher.engine_configs(cfg, None)


def test_with_the_pool_on_each_engine_sees_the_other_gpus_after_its_own_for_peer_access(monkeypatch):
    """Pooled engines may map peers' caches on other GPUs (pool/cuda_ipc.py): each sees every GPU
    of the node, its own first (its cuda:0, where it allocates). Without the pool, or with
    --no-pool-ipc, each sees its own alone."""
    from tokenflowd.config import EngineConfig
    from tokenflowd.daemon import launcher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    pooled = EngineConfig(device="cuda", dtype="bfloat16", pool_mode="read")
    seen = [env["CUDA_VISIBLE_DEVICES"] for _, env in launcher.engine_configs(pooled, 3)]
    assert seen == ["2,5", "5,2", "2,5"]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launcher.engine_configs(replace(pooled, pool_mode="query"), 2)] \
        == ["2,5", "5,2"]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launcher.engine_configs(replace(pooled, pool_ipc=False), 2)] \
        == ["2", "5"]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launcher.engine_configs(replace(pooled, pool_mode="off"), 2)] \
        == ["2", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in launcher.engine_configs(pooled, 2)] == ["3", "3"]


def test_engines_sharing_a_gpu_run_under_the_mps_daemon_that_runs_and_mps_is_reported(monkeypatch, tmp_path, caplog):
    """The MPS unit's pipe directory is found with CUDA_MPS_PIPE_DIRECTORY unset, and engines that
    share a GPU get it; where no control daemon runs, the launcher warns, and an engine reports
    none (/health `mps`)."""
    from tokenflowd.config import EngineConfig
    from tokenflowd.config.platform import mps_pipe_directory
    from tokenflowd.daemon import launcher

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr("tokenflowd.config.platform.MPS_DEFAULT_PIPE", str(tmp_path / "none"))
    monkeypatch.setattr(launcher, "UNIT_MPS_PIPE", str(tmp_path / "pipe"))
    cfg = EngineConfig(device="cuda", dtype="bfloat16")
    assert mps_pipe_directory() == ""
    assert all("CUDA_MPS_PIPE_DIRECTORY" not in env for _, env in launcher.engine_configs(cfg, 2))
    assert "without CUDA MPS" in caplog.text
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "control").touch()  # the control daemon's pipe
    placed = launcher.engine_configs(cfg, 2)
    assert [env["CUDA_MPS_PIPE_DIRECTORY"] for _, env in placed] == [str(tmp_path / "pipe")] * 2
    assert "CUDA_MPS_PIPE_DIRECTORY" not in launcher.engine_configs(cfg, 1)[0][1], "one engine a GPU: no need"
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "pipe"))
    assert mps_pipe_directory() == str(tmp_path / "pipe")


@pytest.mark.parametrize("text,msg", [
    ('[server]\nport = "x"\n', "[server] port must be an integer, got 'x'"),
    ("[engine]\nenable_prefix_caching = 1\n", "enable_prefix_caching must be true or false"),
    ("[policy]\nschedule_interval = true\n", "schedule_interval must be a number"),
    ("[engine]\nkv_cache_memory = 1.5\n", "kv_cache_memory must be a size"),
])
def test_a_value_of_the_wrong_type_is_a_clear_error(tmp_path, text, msg):
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(msg)):
        load_config_file(str(path))


def test_values_of_the_right_type_load(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[server]\nmax_body_size = "64KiB"\n[engine]\nkv_cache_memory = 4096\n[policy]\nschedule_interval = 1\n')
    got = load_config_file(str(path))
    assert got["server"]["max_body_size"] == 65536 and got["engine"]["kv_cache_memory"] == 4096
    assert got["policy"]["schedule_interval"] == 1


@pytest.mark.parametrize("text,msg", [
    ("[policy]\nschedule_interval = inf\n", "schedule_interval must be a finite number"),
    ("[policy]\nstall_penalty = inf\n", "stall_penalty must be a finite number"),
    ("[policy]\nmax_stall = nan\n", "max_stall must be a finite number"),
    ("[policy]\nmax_stall = 0.0\n", "max_stall must be above 0 s"),
    ("[server]\nrestart_backoff_max = -1.0\n", "restart_backoff_max must be a finite number of seconds >= 0"),
    ("[server]\nheartbeat_interval = 1e-6\n", "heartbeat_interval must be at least 0.01 s"),
    ("[engine]\nnum_pages = -4\n", "num_pages must be >= 0"),
    ("[engine]\nnum_threads = -1\n", "num_threads must be >= 1"),
    ("[engine]\nnum_threads = 0\n", "num_threads must be >= 1"),
    ('[engine]\nkv_cache_memory = "0"\n', "kv_cache_memory must be above 0 bytes"),
    ('[engine]\npool_hand_off = "layer"\n', "pool_hand_off must be auto, prompt or segment"),
    ("[engine]\npool_read_rows = 0\n", "pool_read_rows must be at least 1"),
])
def test_values_that_would_break_the_daemon_are_refused_by_config_check(tmp_path, capsys, text, msg):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["config", "check", str(path)]) == 2
    assert msg in capsys.readouterr().err


def test_federation_peers_from_a_flag_the_environment_or_a_file_are_held_in_one_spelling(tmp_path):
    from tokenflowd.federation.peers import Peers

    want = ("http://10.0.0.1:8000", "https://prefill.example/tf")
    flag = serve_configs(args(role="decode", federation_peers="HTTP://10.0.0.1:8000/, https://Prefill.EXAMPLE:443/tf/"),
                         {})[1]
    env = serve_configs(args(role="decode"), {"TOKENFLOWD_FEDERATION_PEERS": "http://10.0.0.1:8000,"
                                                                           "https://prefill.example/tf"})[1]
    path = tmp_path / "t.toml"
    path.write_text('[engine]\nrole = "decode"\n'
                    'federation_peers = ["http://10.0.0.1:8000/", "https://prefill.example/tf"]\n')
    file = serve_configs(args(config=str(path)), {})[1]
    assert flag.federation_peers == env.federation_peers == file.federation_peers == want
    peers = Peers(want)
    assert peers.named("http://10.0.0.1:8000/") == peers.named("HTTP://10.0.0.1:8000") == "http://10.0.0.1:8000"
    for other in ("http://10.0.0.1:8001", "http://10.0.0.2:8000", "https://10.0.0.1:8000", "http://10.0.0.1:8000/x",
                  "http://10.0.0.1:8000@evil.example", "http://evil.example/?u=http://10.0.0.1:8000", "10.0.0.1:8000"):
        assert peers.named(other) is None, other


@pytest.mark.parametrize("text,msg", [
    ('[engine]\nrole = "decode"\n', "a decode node takes KV only from the prefill nodes named by federation_peers"),
    ('[engine]\nrole = "decode"\nfederation_peers = ["10.0.0.1:8000"]\n', "federation_peers must be the http(s) base"),
    ('[engine]\nfederation_peers = ["http://10.0.0.1:8000"]\n', "a node of role both exchanges none"),
    ('[engine]\nrole = "decode"\nfederation_peers = "http://10.0.0.1:8000"\n', "federation_peers must be a list of"),
])
def test_federation_peers_that_cannot_serve_are_refused_by_config_check(tmp_path, capsys, text, msg):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert main(["config", "check", str(path)]) == 2
    assert msg in capsys.readouterr().err
