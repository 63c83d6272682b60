"""Network namespaces for multi-host and fault-injection tests (root only).

A :class:`Lab` is one private layer-2 segment: a bridge that lives in a namespace of
its own, and one namespace per host joined to it by a veth pair. Addresses exist only
inside the namespaces, so nothing here touches the machine's real network. Faults are
injected with what this kernel has (it has no netem): an interface or
bridge port taken down, an nft table that drops everything, iptables ``statistic``
drops for loss, a ``tbf`` qdisc for a rate limit, and NFQUEUE + a small Python holder
(``tests/delay_queue.py``) for delay.

Every namespace name starts with a tag unique to the run, and ``close()`` (called by
the fixtures in a ``finally``) kills what it started and deletes what it made, so a
failing test leaves nothing behind.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedagent.errors import FedagentError

HAVE_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None
SKIP_REASON = "network namespaces need root and iproute2 (ip)"

requires_netns = pytest.mark.skipif(not HAVE_NETNS, reason=SKIP_REASON)


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise FedagentError(f"{' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


class Lab:
    """Hosts on one bridge, addressed 10.77.<net>.<i+1>/24 (``net`` random per run)."""

    def __init__(
        self, work: Path, hosts: list[str], *, subnet: str | None = None, addresses: dict[str, str] | None = None
    ) -> None:
        """``addresses`` gives each host its own address instead (all in one /24), e.g.
        the ones a README example uses: they exist only inside the namespaces."""
        self.work = work
        # FEDAGENT_NETNS_PREFIX: parallel runs on one machine can tell their namespaces apart.
        self.tag = f"{os.environ.get('FEDAGENT_NETNS_PREFIX', 'fa')[:4]}{secrets.token_hex(3)}"
        prefix = subnet or f"10.77.{secrets.randbelow(250) + 1}"
        self.hosts = list(hosts)
        self.ip = dict(addresses) if addresses else {h: f"{prefix}.{i + 1}" for i, h in enumerate(self.hosts)}
        self.index = {h: i for i, h in enumerate(self.hosts)}
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.made: list[str] = []
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    # -- topology ------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def bridge_ns(self) -> str:
        return f"{self.tag}-br"

    def port(self, host: str) -> str:
        """The bridge-side end of ``host``'s veth pair (in the bridge namespace)."""
        return f"{self.tag}p{self.index[host]}"

    def up(self) -> Lab:
        # Also on an interrupted run that skips fixture teardown (close() is idempotent).
        atexit.register(self.close)
        br = self.bridge_ns
        sh("ip", "netns", "add", br)
        self.made.append(br)
        sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", br, "link", "set", "br0", "up")
        for host in self.hosts:
            i, ns = self.index[host], self.ns(host)
            sh("ip", "netns", "add", ns)
            self.made.append(ns)
            sh("ip", "link", "add", f"{self.tag}v{i}", "type", "veth", "peer", "name", self.port(host))
            sh("ip", "link", "set", f"{self.tag}v{i}", "netns", ns)
            sh("ip", "link", "set", self.port(host), "netns", br)
            sh("ip", "-n", ns, "link", "set", f"{self.tag}v{i}", "name", "eth0")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip[host]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", br, "link", "set", self.port(host), "master", "br0")
            sh("ip", "-n", br, "link", "set", self.port(host), "up")
        return self

    def run(self, host: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.ns(host), *argv, check=check)

    # -- faults --------------------------------------------------------------------------
    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s interface down or up (its addresses and routes come back with it)."""
        self.run(host, "ip", "link", "set", "eth0", "up" if up else "down")

    def cut(self, host: str) -> None:
        """Partition ``host``: an nft table dropping every packet in and out but loopback.
        Established TCP connections stay open on both ends and simply stop carrying data,
        as a real partition does (an interface going down would reset nothing either,
        but would also remove the route)."""
        rules = (
            "table inet fault_partition {\n"
            " chain in { type filter hook input priority -100; policy accept; iif lo accept; drop; }\n"
            " chain out { type filter hook output priority -100; policy accept; oif lo accept; drop; }\n"
            "}\n"
        )
        self._nft(host, rules)

    def heal(self, host: str) -> None:
        self.run(host, "nft", "delete", "table", "inet", "fault_partition", check=False)

    def _nft(self, host: str, rules: str) -> None:
        out = subprocess.run(
            ["ip", "netns", "exec", self.ns(host), "nft", "-f", "-"],
            input=rules,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode != 0:
            raise FedagentError(f"nft in {host} failed: {out.stderr.strip()}")

    def loss(self, host: str, probability: float) -> None:
        """Drop each packet ``host`` receives or sends with this probability."""
        for chain in ("INPUT", "OUTPUT"):
            self.run(
                host,
                "iptables",
                "-A",
                chain,
                "-i" if chain == "INPUT" else "-o",
                "eth0",
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                f"{probability}",
                "-j",
                "DROP",
            )

    def rate(self, host: str, rate: str = "1mbit", burst: str = "32kbit", latency: str = "400ms") -> None:
        """Shape what ``host`` sends with a token bucket (tbf; netem is not in this kernel)."""
        self.run(
            host,
            "tc",
            "qdisc",
            "replace",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            burst,
            "latency",
            latency,
        )

    def delay(self, host: str, ms: float, queue_num: int) -> subprocess.Popen:
        """Hold every packet ``host`` sends for ``ms`` milliseconds (NFQUEUE + holder)."""
        holder = Path(__file__).with_name("delay_queue.py")
        p = self.spawn(f"delay-{host}", host, [sys.executable, str(holder), str(queue_num), str(ms)])
        deadline = time.monotonic() + 15
        while "holding" not in self.log(f"delay-{host}"):
            if p.poll() is not None or time.monotonic() > deadline:
                raise FedagentError(f"delay holder in {host} did not start:\n{self.log(f'delay-{host}')}")
            time.sleep(0.05)
        # The rule goes in only once the holder listens: a queue nobody reads drops everything.
        self.run(host, "iptables", "-A", "OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", str(queue_num))
        return p

    def clear(self, host: str) -> None:
        """Remove every loss/delay/rate/partition fault from ``host``."""
        self.heal(host)
        self.run(host, "iptables", "-F", check=False)
        self.run(host, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        for name, p in list(self.procs):
            if name == f"delay-{host}":
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(10)
                self.forget(name)

    # -- processes -----------------------------------------------------------------------
    def spawn(self, name: str, host: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.logs / f"{name}.log"
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *argv],
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.procs.append((name, p))
        return p

    def proc(self, name: str) -> subprocess.Popen:
        return next(p for n, p in reversed(self.procs) if n == name)

    def forget(self, name: str) -> None:
        self.procs = [(n, p) for n, p in self.procs if n != name]

    def log(self, name: str) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def check_alive(self) -> None:
        for name, p in self.procs:
            if p.poll() is not None:
                raise FedagentError(f"{name} exited with {p.returncode}:\n{self.log(name)[-2000:]}")

    def wait_for(self, predicate, timeout: float, what: str, *, alive: bool = True):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if alive:
                self.check_alive()
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def close(self) -> None:
        for _, p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for _, p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()


def leftover_namespaces(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(tag)]
