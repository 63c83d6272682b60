"""Wall-clock jumps must not fire or delay any timer.

Two checks. The code: protocol machines never read a clock (time is passed in), and
every daemon passes ``time.monotonic()``. The running system: a coordinator whose wall
clock jumps hours forward and back (libfaketime, monotonic clock left alone) while it
drives rounds with a short round timeout."""

from __future__ import annotations

import ast
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from netfed import wait_for

import fedagent
from fedagent.local.federation import Federation

SRC = Path(fedagent.__file__).parent
FAKETIME_LIB = next(
    (
        p
        for p in (
            Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1"),
            Path("/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"),
        )
        if p.exists()
    ),
    None,
)


def _imports(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_protocol_machines_read_no_clock():
    """Pass: no module in protocols/ imports time, datetime or asyncio: every timer
    decision there uses the ``now`` it is handed."""
    offenders = {
        p.name: sorted(_imports(ast.parse(p.read_text())) & {"time", "datetime", "asyncio"})
        for p in sorted((SRC / "protocols").glob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def _handle_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("handle", "feed", "expire")
            and len(node.args) >= 2
        ):
            yield node, node.args[-1]


def test_daemons_feed_machines_the_monotonic_clock():
    """Pass: every ``machine.handle(event, now)`` (and reassembly ``feed/expire``) call in
    the daemons passes ``time.monotonic()``, and no deadline there is computed from
    ``time.time()`` (wall-clock values only label records and messages). A daemon may
    read the clock once per event and hand it on as ``now`` (the Sync-Opt coordinator
    does), provided every assignment to ``now`` in that module is ``time.monotonic()``; a
    module that does not import ``time`` at all may pass the fixed instant ``0.0``."""
    seen = 0
    bad: list[str] = []
    for path in sorted([*(SRC / "agent").glob("*.py"), *(SRC / "coordinator").glob("*.py")]):
        tree = ast.parse(path.read_text())
        now_values = {
            ast.unparse(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "now" for t in node.targets)
        }
        ok = {"time.monotonic()"} | ({"now"} if now_values <= {"time.monotonic()"} else set())
        if not any(isinstance(n, ast.Import) and any(a.name == "time" for a in n.names) for n in ast.walk(tree)):
            # A module with no clock (the journal compaction's replay of frames already
            # received) reassembles at one fixed instant: nothing in it can expire.
            ok |= {"0.0"}
        for call, now in _handle_calls(tree):
            seen += 1
            if ast.unparse(now) not in ok:
                bad.append(f"{path.name}:{call.lineno}: {ast.unparse(call)}")
        for node in ast.walk(tree):
            # `deadline = time.time() + x` or `time.time() - started` would be a wall-clock timer.
            if isinstance(node, ast.BinOp) and any(
                ast.unparse(side) == "time.time()" for side in (node.left, node.right)
            ):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert seen >= 5 and bad == []


@pytest.mark.slow
@pytest.mark.skipif(
    FAKETIME_LIB is None or shutil.which("faketime") is None,
    reason="libfaketime is not installed (apt-get install faketime)",
)
def test_coordinator_survives_wall_clock_jumps(tmp_path):
    """Wall-clock jumps on a real federation: the coordinator's wall clock (CLOCK_REALTIME only) jumps
    +6 h, then -1 day, then +30 days while rounds with a 30 s timeout run. Pass: no
    spurious aborts (no round abandoned), every round aggregated once, versions
    contiguous, round durations measured on the monotonic clock stay sane, and no signed
    frame is refused (the coordinator's jumps move neither the timestamps it stamps nor
    the clock it checks the agents' against: see fedagent.security.signing)."""
    # Enough rounds that the three jumps land before the last: libfaketime rereads its
    # offset at most once a second, and on an idle machine a round of this federation
    # takes 60-70 ms (twelve rounds once ended 0.3 s after the first jump was written).
    rounds = 150
    fed = Federation(tmp_path, agents=2, rounds=rounds, alpha=0.5, round_timeout=30)
    offset = tmp_path / "faketime-offset"
    offset.write_text("+0\n")
    env_before = dict(os.environ)
    try:
        fed.prepare()
        # Only the coordinator runs with the faked wall clock.
        os.environ.update(
            LD_PRELOAD=str(FAKETIME_LIB),
            FAKETIME_TIMESTAMP_FILE=str(offset),
            FAKETIME_CACHE_DURATION="1",
            FAKETIME_DONT_FAKE_MONOTONIC="1",
        )
        coord = fed.spawn("coordinator")
        os.environ.clear()
        os.environ.update(env_before)
        for aid in fed.agent_ids:
            fed.spawn(aid)
        status = lambda: fed.status("coordinator") or {}  # noqa: E731
        hist = fed.work / "state" / "coordinator" / "coordinator" / fed.fed / "history.jsonl"

        def last_record_offset() -> float | None:
            lines = hist.read_text().splitlines() if hist.exists() else []
            return json.loads(lines[-1])["time"] - time.time() if lines else None

        at = wait_for(
            lambda: (lambda s: s if s.get("completed_rounds", 0) >= 1 else None)(status()), 90, "round 1", fed
        )
        first_jump_round = at["round"]
        # libfaketime rereads the offset file at most once a second while rounds take
        # well under one: each jump is awaited in the coordinator's own records (the
        # wall-clock time it writes) before the next, so all three land mid-federation.
        for jump, seconds in (("+6h", 6 * 3600), ("-1d", -86400), ("+30d", 30 * 86400)):
            assert status().get("phase") != "done", f"the federation ended before the {jump} jump"
            offset.write_text(jump + "\n")
            wait_for(
                lambda x=seconds: (lambda o: o is not None and abs(o - x) < 600)(last_record_offset()),
                60,
                f"the {jump} jump in the coordinator's records",
                fed,
            )
        done = wait_for(
            lambda: (lambda s: s if s.get("phase") == "done" else None)(status()), 150, "the federation to finish", fed
        )
        assert done["completed_rounds"] == rounds
        records = [json.loads(line) for line in hist.read_text().splitlines()]
        # (A round abandoned before the first jump would be start-up on a loaded machine,
        # not the clock; none may come after it.)
        assert [r for r in records if r["event"] == "abandoned" and r["round"] >= first_jump_round] == []
        rounds_rec = [r for r in records if r["event"] == "round"]
        assert [r["model_version"] for r in rounds_rec] == list(range(1, rounds + 1))
        assert all(0 < r["seconds"] < 30 for r in rounds_rec)
        # The jumps really reached the process: its wall-clock record times moved by days.
        times = [r["time"] for r in records]
        assert max(times) - min(times) > 20 * 86400
        assert coord.popen.poll() is None
        logs = "".join(p.log.read_text(errors="replace") for p in fed.procs)
        assert "rejected message" not in logs
    finally:
        os.environ.clear()
        os.environ.update(env_before)
        fed.close()


def test_early_wakeup_re_requests_the_round_deadline():
    """Found by the partition test (test_faults_net.py): the daemon's Timer keeps the earliest pending
    wake-up, so a wake-up requested by a round that ended early fires before the next
    round's deadline. Pass: that early wake-up makes the machine ask for its deadline
    again, and the deadline then closes the round on the updates that came."""
    import numpy as np

    from fedagent.protocols.rounds import (
        AgentOnline,
        RequestWakeup,
        RoundAggregated,
        RoundConfig,
        RoundMachine,
        StartRound,
        UpdateReceived,
        Wakeup,
    )

    w0 = {"w": np.zeros(3, np.float32)}
    m = RoundMachine(RoundConfig(rounds=3, min_agents=3, expected_agents=3, min_updates=1, round_timeout=10), w0)
    cmds = [c for a in "abc" for c in m.handle(AgentOnline(a, 10), 0.0)]
    assert [c.at for c in cmds if isinstance(c, RequestWakeup)] == [10.0]  # round 1's deadline
    for a in "abc":
        cmds = m.handle(UpdateReceived(a, 1, 0, 10, {"w": np.ones(3, np.float32)}, {}), 1.0)
    assert any(isinstance(c, RoundAggregated) for c in cmds) and any(isinstance(c, StartRound) for c in cmds)
    # Round 2 started at t=1 (deadline 11). One agent answers, two stay silent.
    m.handle(UpdateReceived("a", 2, 1, 10, {"w": np.ones(3, np.float32)}, {}), 2.0)
    early = m.handle(Wakeup(), 10.0)  # round 1's stale timer
    assert early == [RequestWakeup(11.0)]
    (agg,) = [c for c in m.handle(Wakeup(), 11.0) if isinstance(c, RoundAggregated)]
    assert agg.round == 2 and agg.participants == ("a",)
