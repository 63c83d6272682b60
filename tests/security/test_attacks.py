"""An outsider and a curious member against a demo-like broker, with the real
``mosquitto_pub``/``mosquitto_sub`` (no fedagent code on the attacking side).

The broker is the one fedagent generates (EmbeddedBroker: mutual TLS, identity as
username and client id, the ACL from the CA's register), serving federation ``lab``
and, from the same CA, federation ``other``. Every attack is tried a few times; each
one's attempts and acceptances are printed, and all acceptances must be 0. What counts
as accepted: a publish the broker acknowledged without an error, a subscriber that
received something it must not see, a connection that got in (no certificate, a
foreign one, plain TCP), a login that disconnected another node (takeover), an
oversized message delivered.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from fedagent.mosquitto import EmbeddedBroker
from fedagent.protocols import topics
from fedagent.security import pki

pytestmark = [
    pytest.mark.procs,
    pytest.mark.skipif(
        shutil.which("mosquitto_pub") is None or shutil.which("mosquitto_sub") is None,
        reason="needs mosquitto-clients (scripts/bootstrap.sh installs it)",
    ),
]

LAB, OTHER = "lab", "other"
# ops publishes the legitimate traffic, audit watches for the oversized message: both
# coordinator-level, each with a certificate of its own (one identity, one connection).
LAB_IDS = {
    "coordinator": "coordinator",
    "ops": "coordinator",
    "audit": "coordinator",
    "agent-1": "agent",
    "agent-2": "agent",
    "agent-3": "agent",
}
# other-agent publishes, other-spy subscribes: one identity is one connection, so a
# publisher with the subscriber's certificate would disconnect it.
OTHER_IDS = {"other-coord": "coordinator", "other-agent": "agent", "other-spy": "agent"}
TRIES = 3


class Attacks:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.ca = work / "ca"
        pki.create_ca(self.ca, LAB)
        for name, role in LAB_IDS.items():
            pki.issue(self.ca, self.ca, name, role)
        for name, role in OTHER_IDS.items():
            pki.issue(self.ca, self.ca, name, role, federation=OTHER)
        self.foreign = work / "foreign"
        pki.create_ca(self.foreign, LAB)  # same federation name, another CA
        pki.issue(self.foreign, self.foreign, "agent-1", "agent")
        self.broker = EmbeddedBroker(
            work / "broker",
            federations=[LAB, OTHER],
            coordinators=["coordinator", "ops", "audit", "other-coord"],
            ca_dir=self.ca,
        )
        self.procs: list[subprocess.Popen] = []
        self.results: dict[str, list[int]] = {}

    def count(self, attack: str, accepted: bool) -> None:
        row = self.results.setdefault(attack, [0, 0])
        row[0] += 1
        row[1] += int(accepted)

    def argv(self, tool: str, name: str | None, *args: str, creds: str = "ours", version: str = "mqttv5") -> list[str]:
        out = [tool, "-h", self.broker.host, "-p", str(self.broker.port), "-V", version]
        if creds == "plain":
            return [*out, *args]
        out += ["--cafile", str(self.ca / pki.CA_CERT)]
        if creds == "ours" and name:
            out += ["--cert", str(self.ca / f"{name}.crt"), "--key", str(self.ca / f"{name}.key")]
        elif creds == "foreign":
            out += ["--cert", str(self.foreign / "agent-1.crt"), "--key", str(self.foreign / "agent-1.key")]
        return [*out, *args]

    def pub(self, name: str | None, topic: str, payload: str = "attack", **kw) -> bool:
        """True if the broker took the publish (QoS 1, no error reported)."""
        extra = ("-f", payload) if payload.startswith("/") else ("-m", payload)
        r = subprocess.run(
            self.argv("mosquitto_pub", name, "-t", topic, *extra, "-q", "1", **kw),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return r.returncode == 0 and not r.stderr.strip()

    def sub(self, name: str | None, *filters: str, seconds: int = 30, **kw) -> tuple[subprocess.Popen, Path]:
        out = self.work / f"sub-{len(self.procs)}.out"
        args = [a for f in filters for a in ("-t", f)]
        p = subprocess.Popen(
            self.argv("mosquitto_sub", name, *args, "-v", "-W", str(seconds), **kw),
            stdout=out.open("wb"),
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        return p, out

    def log(self) -> str:
        return self.broker.log_path.read_text(errors="replace")

    def wait_log(self, text: str, count: int, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while self.log().count(text) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"broker log never said {text!r} {count} times:\n{self.broker.log_tail()}")
            time.sleep(0.05)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                p.wait(5)
        self.broker.stop()


@pytest.fixture
def lab(tmp_path):
    a = Attacks(tmp_path)
    try:
        a.broker.start()
        yield a
    finally:
        a.close()


def wait_output(path: Path, text: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while text not in (out := path.read_text(errors="replace")):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never showed {text!r}:\n{out[-2000:]}")
        time.sleep(0.05)
    return out


def test_outside_attacks_are_all_refused(lab, tmp_path):
    b = lab
    root = topics.federation_root(LAB)

    # -- an outsider: no certificate, a foreign CA's, plain TCP on the TLS port ---------
    for creds, attack in (("none", "no certificate"), ("foreign", "foreign CA"), ("plain", "plain TCP")):
        for _ in range(TRIES):
            b.count(attack, b.pub("agent-1", topics.presence(LAB, "agent-1"), creds=creds))
            p, out = b.sub("agent-1", "#", seconds=3, creds=creds)
            p.wait(20)
            b.count(attack, "Timed out" in out.read_text(errors="replace") or p.returncode == 0)

    # -- a member's certificate under other nodes' client ids ---------------------------
    joined = b.log().count("as coordinator (")
    victims = [b.sub(name, topics.inbox(LAB, name), seconds=120)[0] for name in ("coordinator", "agent-2")]
    b.wait_log("as coordinator (", joined + 1)
    b.wait_log("as agent-2 (", 1)
    for _ in range(TRIES):
        for victim in ("coordinator", "agent-2"):
            r = subprocess.run(
                b.argv("mosquitto_pub", "agent-1", "-i", victim, "-t", topics.presence(LAB, "agent-1"), "-m", "x"),
                capture_output=True,
                timeout=30,
            )
            assert r.returncode == 0  # it gets in, as agent-1
            taken = f"Client {victim} already connected" in b.log() or any(v.poll() is not None for v in victims)
            b.count("client-id takeover", taken)

    # -- a member of another federation on the same broker ------------------------------
    spy, spy_out = b.sub("other-spy", "#", f"{root}/#", topics.all_broadcasts(LAB), topics.inbox(LAB, "other-spy"))
    for topic in (
        topics.presence(LAB, "other-agent"),
        topics.direct(LAB, "other-agent", "coordinator", "update"),
        topics.broadcast(LAB, "model"),
        topics.presence(LAB, "agent-1"),
    ):
        b.count("cross-federation", b.pub("other-agent", topic))

    # -- a member reading another agent's inbox and writing its subtree -----------------
    nosy, nosy_out = b.sub("agent-3", topics.inbox(LAB, "agent-2"), f"{root}/node/agent-2/#", "#")
    b.wait_log("as agent-3 (", 1)
    for topic in (
        topics.presence(LAB, "agent-2"),
        topics.direct(LAB, "agent-2", "coordinator", "update"),
        topics.direct(LAB, "coordinator", "agent-2", "model"),
        topics.broadcast(LAB, "round_start"),
    ):
        b.count("cross-agent write", b.pub("agent-1", topic))

    # -- an oversized packet (MQTT 3.1.1: no maximum announced to the client) -----------
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (b.broker.max_packet_size + 1024))
    watcher, watcher_out = b.sub("audit", f"{root}/node/agent-1/#", seconds=120)
    b.wait_log("as audit (", 1)
    assert b.pub("agent-1", topics.direct(LAB, "agent-1", "coordinator", "small"), "small-ok")
    wait_output(watcher_out, "small-ok")  # the watcher is subscribed
    for _ in range(TRIES):
        b.pub("agent-1", topics.direct(LAB, "agent-1", "coordinator", "big"), str(big), version="mqttv311")

    # Legitimate traffic of both federations, then markers: everything above has been
    # routed by the time a marker arrives (one broker thread, one connection each).
    # The attackers' subscriptions are in place once their federation's broadcast
    # reaches them.
    assert b.pub("ops", topics.broadcast(LAB, "model"), "lab-model")
    assert b.pub("other-coord", topics.broadcast(OTHER, "model"), "other-model")
    wait_output(nosy_out, "lab-model")
    wait_output(spy_out, "other-model")
    assert b.pub("ops", topics.direct(LAB, "ops", "agent-2", "model"), "secret-for-agent-2")
    assert b.pub("ops", topics.broadcast(LAB, "round_result"), "lab-result")
    b.pub("ops", topics.direct(LAB, "ops", "other-spy", "marker"), "marker")
    b.pub("ops", topics.direct(LAB, "ops", "agent-3", "marker"), "marker")
    b.pub("ops", topics.direct(LAB, "ops", "coordinator", "marker"), "marker")
    b.pub("agent-1", topics.direct(LAB, "agent-1", "coordinator", "marker"), "marker")

    seen = wait_output(nosy_out, "marker")
    leaked = [line for line in seen.splitlines() if "/to/agent-2/" in line or "secret-for-agent-2" in line]
    for i in range(3):  # the three filters agent-3 subscribed with
        b.count("cross-agent read", i < len(leaked))
    seen = wait_output(watcher_out, "marker")
    for _ in range(TRIES):
        b.count("oversized packet", "/big " in seen)
    # The other federation's member cannot read lab at all (not even the marker to its
    # own id there); its own federation's next broadcast comes after all of the above.
    assert b.pub("other-coord", topics.broadcast(OTHER, "round_result"), "other-result")
    seen = wait_output(spy_out, "other-result")
    b.count("cross-federation", any(line.startswith(f"{root}/") for line in seen.splitlines()))
    for v in victims:
        assert v.poll() is None  # the victims' connections were never taken

    width = max(map(len, b.results))
    print("\nattack".ljust(width + 2), "attempts", "accepted")
    for attack, (tried, took) in b.results.items():
        print(attack.ljust(width + 1), f"{tried:8d}", f"{took:8d}")
    assert set(b.results) == {
        "no certificate",
        "foreign CA",
        "plain TCP",
        "client-id takeover",
        "cross-federation",
        "cross-agent write",
        "cross-agent read",
        "oversized packet",
    }
    assert {a: took for a, (_, took) in b.results.items()} == dict.fromkeys(b.results, 0)
