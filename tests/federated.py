"""A federated cluster on one machine, for tests and benches (root: tests/netns.py): each node and
the conductor a real `tokenflowd` process in a network namespace of its own.

    Cluster(tmp, node_args, prefill=["prefill"], decode=["decode"], remote=["remote"],
            conductor="prfaas_period = 2\n")

Prefill nodes start first; decode nodes take KV from every prefill node (--federation-peers),
remote ones too. `remote` nodes are prefill nodes marked `remote = true` in the conductor's
[[nodes]] (PrfaaS). `conductor` is more of the [conductor] table.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from daemon import Daemon, free_port, terminate
from netns import Network

MODEL = "smollm2-135m"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Cluster:
    def __init__(self, tmp: Path, node_args: tuple[str, ...], prefill=("prefill",), decode=("decode",), remote=(),
                 conductor: str = "ttft_slo = 600\ntbt_slo = 60\n", start_timeout: float = 240) -> None:
        names = [*prefill, *remote, *decode]
        self.net = Network([*names, "conductor"])
        self.nodes: dict[str, Daemon] = {}
        self.conductor: subprocess.Popen | None = None
        addr = self.net.addr
        try:
            for name in names:
                role = "decode" if name in decode else "prefill"
                peers = ["--federation-peers", ",".join(self.nodes[n].base_url for n in (*prefill, *remote))] \
                    if role == "decode" else []
                self.nodes[name] = Daemon("--role", role, "--kv-host", addr[name], *peers, *node_args,
                                          netns=self.net.ns[name], host=addr[name], wait=False,
                                          log_path=str(tmp / f"{name}.log"))
            config = tmp / "cluster.toml"
            config.write_text(f'[conductor]\nmodel = "{MODEL}"\npoll_interval = 0.2\n{conductor}\n'
                              + "".join(f'[[nodes]]\nname = "{n}"\nurl = "{self.nodes[n].base_url}"\n'
                                        f'remote = {"true" if n in remote else "false"}\n\n' for n in names))
            port = free_port()
            self.url = f"http://{addr['conductor']}:{port}"
            self.log = open(tmp / "conductor.log", "w")
            self.conductor = subprocess.Popen(
                ["ip", "netns", "exec", self.net.ns["conductor"], sys.executable, "-m", "tokenflowd.cli", "conductor",
                 "--config", str(config), "--host", addr["conductor"], "--port", str(port)],
                stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ROOT})  # this checkout's
            for node in self.nodes.values():
                node.wait_healthy(start_timeout)
            self.wait(lambda h: all(h["nodes"][n]["serving"] for n in names), 60)
        except BaseException:
            self.close()
            raise

    def __getattr__(self, name: str) -> Daemon:  # cluster.prefill, cluster.decode, ...
        nodes = self.__dict__.get("nodes", {})
        if name in nodes:
            return nodes[name]
        raise AttributeError(name)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait(self, ready, timeout: float) -> dict:
        """The conductor's /health once `ready` holds of it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                h = self.health()
                if ready(h):
                    return h
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError("the conductor did not reach the state awaited")

    def close(self) -> None:
        if self.conductor is not None:
            terminate(self.conductor)
            self.log.close()
            self.conductor = None
        for node in self.nodes.values():
            node.stop()
        self.nodes = {}
        self.net.close()
