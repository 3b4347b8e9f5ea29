"""Home networks behind NAT, built from network namespaces and iptables, for tests and benchmarks.

    with NatTopology(homes=2, tag="t1") as net:
        net.run_in(net.public, "python", "-m", "node", "join", ...)

The "internet" is a bridge in its own namespace with a globally routable /24 (45.<x>.<y>.0/24): libp2p
only advertises relay addresses of relays with public addresses, so a private 10/8 "internet" would
hide the very thing under test. Nothing leaves the namespaces, so the numbers never meet the real one. The public peer lives
in a namespace with an address on it. Each home ``h`` is a router namespace (WAN address on the
internet, LAN 192.168.<h>.1/24) and a host namespace behind it (192.168.<h>.2, default route via the
router). Each router masquerades its LAN and drops every new inbound connection from the internet:
what home routers do. A home can dial out; nobody can dial in, not even the other home.

Names carry ``tag`` and the creating process id, so parallel tests never share a namespace; the
context manager removes everything on exit, errors included. Needs root, ``ip`` and ``iptables``.
An optional ``rate_mbit`` shapes every host's link (upload and download) with ``tc tbf``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["NatTopology", "NsNode", "missing_tools", "Host"]


def missing_tools() -> str | None:
    """Why the topology cannot be built here (one line), or None when it can."""
    if os.geteuid() != 0:
        return "needs root for network namespaces and iptables"
    for tool in ("ip", "iptables", "tc"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` (make test-deps installs iptables where apt-get runs as root)"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


@dataclass
class Host:
    """One machine of the topology: its namespace and the address its programs listen on."""

    netns: str
    address: str
    behind_nat: bool


@dataclass
class NatTopology:
    homes: int = 2
    tag: str = "nat"
    rate_mbit: float | None = None
    public_hosts: int = 1
    public: list[Host] = field(default_factory=list)
    home: list[Host] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        uid = f"{self.tag}{os.getpid() % 100000}"
        self._prefix = f"lm{uid}"[:10]
        self._subnet = f"45.{100 + os.getpid() % 100}.{os.getpid() // 100 % 250}"

    def _ns(self, name: str) -> str:
        ns = f"{self._prefix}{name}"
        _sh("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        return ns

    def _wire(self, ns_a: str, dev_a: str, ns_b: str, dev_b: str) -> None:
        tmp_a, tmp_b = f"{self._prefix}x{len(self._namespaces)}a", f"{self._prefix}x{len(self._namespaces)}b"
        _sh("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        for tmp, ns, dev in ((tmp_a, ns_a, dev_a), (tmp_b, ns_b, dev_b)):
            _sh("ip", "link", "set", tmp, "netns", ns)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", tmp, "name", dev)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_mbit:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                "rate", f"{self.rate_mbit}mbit", "burst", "64kb", "latency", "400ms")

    def __enter__(self) -> "NatTopology":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        inet = self._ns("inet")
        _sh("ip", "netns", "exec", inet, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", inet, "ip", "link", "set", "br0", "up")

        def attach(ns: str, dev: str, address: str, n: int) -> None:
            self._wire(ns, dev, inet, f"p{n}")
            _sh("ip", "netns", "exec", inet, "ip", "link", "set", f"p{n}", "master", "br0")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", dev)

        for p in range(self.public_hosts):
            ns = self._ns(f"pub{p}")
            address = f"{self._subnet}.{10 + p}"
            attach(ns, "wan", address, p)
            self._shape(ns, "wan")
            self._shape(inet, f"p{p}")
            self.public.append(Host(ns, address, behind_nat=False))
        for h in range(self.homes):
            router, host = self._ns(f"r{h}"), self._ns(f"h{h}")
            attach(router, "wan", f"{self._subnet}.{100 + h}", 50 + h)
            self._wire(router, "lan", host, "eth0")
            lan = f"192.168.{h + 1}"
            _sh("ip", "netns", "exec", router, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan")
            _sh("ip", "netns", "exec", host, "ip", "addr", "add", f"{lan}.2/24", "dev", "eth0")
            _sh("ip", "netns", "exec", host, "ip", "route", "add", "default", "via", f"{lan}.1")
            _sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            ipt = ("ip", "netns", "exec", router, "iptables")
            _sh(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            _sh(*ipt, "-A", "FORWARD", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _sh(*ipt, "-A", "FORWARD", "-i", "wan", "-j", "DROP")
            _sh(*ipt, "-A", "INPUT", "-i", "wan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            _sh(*ipt, "-A", "INPUT", "-i", "wan", "-j", "DROP")
            self._shape(host, "eth0")
            self._shape(router, "lan")
            self.home.append(Host(host, f"{lan}.2", behind_nat=True))

    def router_wan(self, h: int) -> str:
        """The public address home ``h`` appears from (its router's WAN side)."""
        return f"{self._subnet}.{100 + h}"

    def close(self) -> None:
        for ns in reversed(self._namespaces):
            _sh("ip", "netns", "del", ns, check=False)
        self._namespaces.clear()

    def command(self, host: Host, *argv: str) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", host.netns, *argv]

    def can_connect(self, source: Host, address: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connection from ``source`` to ``address:port`` is accepted."""
        probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
                 "except OSError: sys.exit(1)")
        return _sh(*self.command(source, "python3", "-c", probe, address, str(port), str(timeout)), check=False).returncode == 0

    def listen_probe(self, host: Host) -> tuple[subprocess.Popen, int]:
        """A TCP listener in ``host`` that accepts forever (kill it when done), and its port."""
        port = _free_port()
        server = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
                  "s.bind(('0.0.0.0', int(sys.argv[1])));s.listen(16);print('up',flush=True)\n"
                  "while True:\n c,_=s.accept();c.close()")
        proc = subprocess.Popen(self.command(host, "python3", "-c", server, str(port)), stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        return proc, port


class NsNode:
    """One ``node join`` in a namespace, with its info file."""

    def __init__(self, net: NatTopology, host: Host, directory: Path, name: str, args: list[str], peers: list[str]) -> None:
        self.name, self.directory = name, directory / name
        self.directory.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "node", "join", *args, "--checkpoint-dir", str(self.directory),
               "--info-file", str(self.directory / "info.json")]
        if not host.behind_nat:  # the public peer listens on its public address (a server's usual setup)
            cmd += ["--listen", f"/ip4/{host.address}/tcp/0"]
        for peer in peers:
            cmd += ["--initial-peers", peer]
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCOMESH_")}
        self.process = subprocess.Popen(net.command(host, *cmd), stdout=open(self.directory / "log.txt", "w"),
                                        stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def info(self) -> dict[str, Any]:
        try:
            return json.loads((self.directory / "info.json").read_text())
        except (OSError, ValueError):
            return {}

    def log(self) -> str:
        return (self.directory / "log.txt").read_text(errors="replace")

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.info()
            if info and predicate(info):
                return info
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.process.returncode}) waiting for {what}:\n{self.log()[-3000:]}")
            time.sleep(0.5)
        raise AssertionError(f"{self.name}: no {what} after {timeout:.0f}s:\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
