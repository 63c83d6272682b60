"""Client-id takeover over a running federation: a member's certificate cannot take over the
coordinator's or another agent's MQTT connection, whatever client id it asks for.

The attacker holds a member certificate that no running daemon uses (agent-3): every
login is one as agent-3, so the only connection it could replace is its own, and the
rounds measured are those of the coordinator, agent-1 and agent-2."""

from __future__ import annotations

import json
import time

import pytest
from attacker import takeovers
from netfed import running, wait_for

from fedagent.node import transport as tr
from fedagent.security import pki

pytestmark = pytest.mark.procs

TIMES = 50


def completed(fed) -> int:
    return (fed.status("coordinator") or {}).get("completed_rounds", 0)


def test_member_certificate_cannot_take_over_coordinator_or_agent(tmp_path, record_property):
    with running(tmp_path, agents=2, rounds=100_000, alpha=0.5, agent_broker_by_mdns=False) as fed:
        # A member certificate that no running daemon uses: what a compromised member holds.
        ca_dir = fed.work / "pki"
        cert, key = pki.issue(ca_dir, ca_dir, "agent-3", "agent")
        ctx = tr.make_ssl_context(tr.TlsFiles(ca_dir / pki.CA_CERT, cert, key))
        assert fed.broker is not None
        host, port = fed.broker.host, fed.broker.port
        wait_for(lambda: completed(fed) >= 3, 120, "three rounds before the attack", fed)

        # Round rate without an attack, then during one of the same kind of length.
        r0, t0 = completed(fed), time.monotonic()
        wait_for(lambda: completed(fed) >= r0 + 5, 120, "five more rounds", fed)
        base_rate = (completed(fed) - r0) / (time.monotonic() - t0)

        r1, t1 = completed(fed), time.monotonic()
        accepted = takeovers(host, port, ctx, ["coordinator", "agent-2"], TIMES, 120)
        took = time.monotonic() - t1
        attack_rate = (completed(fed) - r1) / took
        record_property("takeover_attempts", 2 * TIMES)
        record_property("takeover_seconds", round(took, 2))
        record_property("rounds_per_s_before", round(base_rate, 2))
        record_property("rounds_per_s_during", round(attack_rate, 2))
        print(
            f"logins as coordinator/agent-2 with agent-3's certificate: {2 * TIMES} in {took:.1f}s, "
            f"all accepted as agent-3: {accepted}; rounds/s before {base_rate:.2f}, during {attack_rate:.2f}"
        )

        assert accepted == 2 * TIMES  # each one logged in, as agent-3
        wait_for(lambda: completed(fed) >= r1 + 3, 120, "rounds after the attack", fed)
        broker_log = fed.broker.log_path.read_text(errors="replace")
        assert broker_log.count("as agent-3 (p5, c1") == 2 * TIMES
        for victim in ("coordinator", "agent-1", "agent-2"):
            assert f"Client {victim} already connected" not in broker_log
            log = fed.proc(victim).log.read_text(errors="replace")
            assert " lost: " not in log and "connection to" not in log.replace("connected to", ""), victim
        # No update lost: every round during and after the attack has both agents in it.
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"
        rounds = [json.loads(line) for line in hist.read_text().splitlines()]
        rounds = [r for r in rounds if r["event"] == "round"]
        assert len(rounds) >= r1 + 3
        assert all(r["participants"] == ["agent-1", "agent-2"] for r in rounds)
        assert attack_rate > 0
