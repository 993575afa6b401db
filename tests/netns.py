"""Network namespaces joined by veth pairs, for multi-node tests (root only).

    node namespaces ── veth ──┐
                              ├── bridge, in a switch namespace of its own
    this test's namespace ── veth ──┘   (so the test reaches every node at its address)

Every name carries this process's id, and `close` deletes the namespaces (their veth pairs go
with them), so runs never meet. `netem` shapes a node's link (tc), `link` takes it down or up.
"""
from __future__ import annotations

import os
import shutil
import subprocess


def available() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"tfprobe{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
        return "this machine refuses to make a network namespace"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class Network:
    def __init__(self, nodes: list[str]) -> None:
        pid = os.getpid()
        self.tag = f"tf{pid % 100000}"
        subnet = f"10.{100 + pid % 150}.{(pid // 150) % 250}"
        self.switch = f"{self.tag}-sw"
        self.ns = {name: f"{self.tag}-{name}" for name in nodes}
        self.addr = {name: f"{subnet}.{i + 1}" for i, name in enumerate(nodes)}
        self.host_addr = f"{subnet}.254"
        self._host_link = f"{self.tag}h"
        self._made: list[str] = []
        try:
            self._build(subnet)
        except BaseException:
            self.close()
            raise

    def _build(self, subnet: str) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Mooncake's TCP transport opens a connection per transfer: let closed ones' ports be
            # reused for new outgoing connections, as a federated node's operator must (README)
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"], check=True)
            a, b = f"{self.tag}{i}a", f"{self.tag}{i}b"
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            _ip("link", "set", a, "netns", ns)
            _ip("link", "set", b, "netns", self.switch)
            _ip("-n", ns, "link", "set", a, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", self.switch, "link", "set", b, "master", "br0", "up")
        peer = f"{self.tag}hb"
        _ip("link", "add", self._host_link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.switch)
        _ip("-n", self.switch, "link", "set", peer, "master", "br0", "up")
        _ip("addr", "add", f"{self.host_addr}/24", "dev", self._host_link)
        _ip("link", "set", self._host_link, "up")

    def has_netem(self) -> bool:
        """Whether the kernel has the netem qdisc (some kernels are built without it)."""
        ns = next(iter(self.ns.values()))
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", "lo", "root", "netem",
                            "delay", "1ms"], capture_output=True)
        subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        return r.returncode == 0

    def netem(self, node: str, *spec: str) -> None:
        """`tc qdisc replace ... netem SPEC` on the node's link (no spec: take it off)."""
        ns = self.ns[node]
        if spec:
            cmd = ["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", *spec]
        else:
            cmd = ["tc", "qdisc", "del", "dev", "eth0", "root"]
        subprocess.run(["ip", "netns", "exec", ns, *cmd], check=bool(spec), capture_output=True)

    def rate(self, node: str, rate: str | None) -> None:
        """Limit the node's outgoing link to `rate` (e.g. 1gbit; None: lift the limit)."""
        if rate is None:
            return self.netem(node)
        subprocess.run(["ip", "netns", "exec", self.ns[node], "tc", "qdisc", "replace", "dev", "eth0", "root", "tbf",
                        "rate", rate, "burst", "256kb", "latency", "50ms"], check=True, capture_output=True)

    def link(self, node: str, up: bool) -> None:
        _ip("-n", self.ns[node], "link", "set", "eth0", "up" if up else "down")

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self._host_link], capture_output=True)
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made = []
