"""Heartbeat liveness (protocols/liveness.py) and the heartbeat message, in memory."""

from __future__ import annotations

import math

import pytest

from fedagent.errors import CodecError
from fedagent.protocols.codec import Limits
from fedagent.protocols.liveness import BEATS, PROBE_ANSWER_S, PROBE_POLL_S, Liveness, OwnLink, heartbeat_interval
from fedagent.protocols.messages import Heartbeat, body_of


def test_a_node_silent_for_its_timeout_is_reported_once_and_comes_back_when_heard():
    lv = Liveness()
    assert lv.heartbeat("a", 1.0, now=0.0) is False
    assert lv.heartbeat("b", 1.0, now=0.0) is False
    assert lv.next_check() == BEATS * 1.0
    for t in (1.0, 2.0, 3.0, 3.9):
        lv.heartbeat("a", 1.0, now=t)
        assert lv.expire(t) == []
    assert lv.expire(4.0) == ["b"]  # b: silent since 0.0
    assert lv.is_silent("b") and not lv.is_silent("a")
    assert lv.expire(5.0) == []  # reported once
    assert lv.next_check() == pytest.approx(3.9 + 4.0)
    assert lv.heard("b", 6.0) is True  # any message brings it back
    assert not lv.is_silent("b")
    assert lv.heard("b", 6.5) is False


def test_detection_takes_at_most_the_timeout_after_the_last_beat_whatever_the_phase():
    """Stopped at any moment between two beats, a node is silent between 3/4 and 4/4 of
    the timeout later: the bound the coordinator needs for 1.5 x keep-alive."""
    interval = heartbeat_interval(4.0)
    for phase in (0.0, 0.3, 0.99):
        lv = Liveness()
        t = 0.0
        lv.heartbeat("a", interval, t)
        while t + interval <= 10.0:
            t += interval
            lv.heartbeat("a", interval, t)
        stopped = t + phase * interval
        at = lv.next_check()
        assert lv.expire(at) == ["a"]
        assert 3.0 <= at - stopped <= 4.0


def test_untracked_nodes_are_never_declared_silent_and_forget_stops_tracking():
    lv = Liveness()
    assert lv.heard("old-agent", 0.0) is False  # never sent a heartbeat: not tracked
    assert lv.expire(1e6) == [] and not lv.tracked("old-agent")
    lv.heartbeat("a", 0.5, 0.0)
    lv.forget("a")  # its presence said offline
    assert lv.expire(100.0) == [] and lv.next_check() == math.inf


def test_a_late_wakeup_postpones_evictions_by_one_interval():
    """The coordinator's own loop stalled: heartbeats may be waiting unread, so nobody is
    evicted on that wake-up; a node still silent one interval later is."""
    lv = Liveness()
    lv.heartbeat("a", 1.0, 0.0)
    lv.heartbeat("b", 1.0, 0.0)
    assert lv.expire(10.0, late=6.0) == []
    assert lv.next_check() == pytest.approx(11.0)
    lv.heartbeat("a", 1.0, 10.2)  # read after the stall
    assert lv.expire(10.5) == []  # still inside the grace
    assert lv.expire(11.0) == ["b"]


def test_excuse_gives_everyone_a_fresh_timeout_but_keeps_the_silent_silent():
    """The coordinator's own broker connection was down from 1 to 30: hearing nobody then
    says nothing about the agents."""
    lv = Liveness()
    lv.heartbeat("a", 1.0, 0.0)
    lv.heartbeat("b", 1.0, 0.0)
    assert lv.expire(4.0) == ["a", "b"]
    lv.heartbeat("a", 1.0, 5.0)
    lv.excuse(30.0)
    assert lv.is_silent("b") and lv.expire(33.9) == []
    assert lv.expire(34.0) == ["a"]


def test_timeouts_are_clamped_and_status_reports_age():
    lv = Liveness(min_timeout=0.5, max_timeout=60.0)
    lv.heartbeat("fast", 0.05, 0.0)
    lv.heartbeat("slow", 3600.0, 0.0)
    st = lv.status(2.0)
    assert st["fast"] == {"age": 2.0, "timeout": 0.5, "silent": False}
    assert st["slow"]["timeout"] == 60.0


def test_every_configurable_keepalive_gives_a_valid_heartbeat():
    for keepalive in (2, 10, 3600, 65535):
        assert Heartbeat(heartbeat_interval(keepalive)).interval <= keepalive / BEATS


def test_heartbeat_message_is_validated():
    limits = Limits()
    assert body_of("heartbeat", Heartbeat(1.0).to_body(), limits) == Heartbeat(1.0)
    for bad in ({}, {"interval": True}, {"interval": "1"}, {"interval": 0.0}, {"interval": float("nan")}):
        with pytest.raises(CodecError):
            body_of("heartbeat", bad, limits)


def test_status_table_names_the_agents_a_round_waits_for_and_the_silent_ones():
    from rich.console import Console

    from fedagent.cli.render import render_status

    console = Console(record=True, width=120)
    render_status(
        {
            "role": "coordinator",
            "id": "coordinator",
            "mode": "fedavg",
            "phase": "training",
            "round": 4,
            "selected": ["a1", "a2", "a3"],
            "received": ["a1"],
            "heartbeats": {
                "a1": {"age": 0.4, "timeout": 10.0, "silent": False},
                "a3": {"age": 12.3, "timeout": 10.0, "silent": True},
            },
            "journal": {"round": 4, "frames": 1, "bytes": 2345},
        },
        console,
    )
    text = console.export_text()
    assert "1 of 3; waiting for a2, a3" in text
    assert "a3 (12s)" in text and "a1 (" not in text
    assert "round 4: 1 frames, 2,345 bytes" in text


# -- OwnLink: the listener's own link vouches for others' silence ---------------------


def test_a_link_with_recent_traffic_lets_the_check_run_at_once():
    link = OwnLink()
    assert link.verdict(0.2, 100.0) == ("check", 100.0)


def test_a_quiet_link_is_probed_first_and_checked_once_the_broker_answers():
    link = OwnLink()
    verdict, again = link.verdict(5.0, 100.0)
    assert verdict == "probe" and again == 100.0 + PROBE_POLL_S
    # The answer came 0.01 s after the probe: the link is fine, the quiet was nobody's traffic.
    assert link.verdict(again - 100.01, again) == ("check", again)
    assert not link.stalled


def test_a_probe_unanswered_marks_the_link_stalled_and_its_return_excuses_everyone():
    link = OwnLink()
    assert link.verdict(5.0, 100.0)[0] == "probe"
    t = 100.0
    while t < 100.0 + PROBE_ANSWER_S:
        t += PROBE_POLL_S
        verdict, _ = link.verdict(5.0 + (t - 100.0), t)
        assert verdict == "wait"
    assert link.stalled
    # Traffic again (the partition healed): excused once, then ordinary checks.
    assert link.verdict(0.01, t + 1.0) == ("excuse", t + 1.0)
    assert link.verdict(0.01, t + 2.0) == ("check", t + 2.0)


def test_a_probe_answered_within_its_time_never_excuses():
    link = OwnLink()
    link.verdict(5.0, 100.0)
    assert link.verdict(5.0 + PROBE_POLL_S, 100.0 + PROBE_POLL_S)[0] == "wait"
    # answered at 100.3: the next look sees recent traffic
    assert link.verdict(0.2, 100.5) == ("check", 100.5)


def test_a_link_quiet_again_long_after_an_answer_is_probed_again():
    link = OwnLink()
    link.verdict(5.0, 100.0)
    assert link.verdict(0.1, 100.25)[0] == "check"
    # Nothing for seconds after the answer (the last live agent died): probe again,
    # not "wait" on the old, answered probe.
    assert link.verdict(3.0, 103.25) == ("probe", 103.25 + PROBE_POLL_S)


def test_no_connection_says_down_and_forgets_a_stall():
    link = OwnLink()
    link.verdict(5.0, 100.0)
    link.verdict(7.5, 102.5)
    assert link.stalled
    assert link.verdict(None, 103.0) == ("down", 104.0)
    assert not link.stalled  # reconnecting excuses everyone anyway
    assert link.verdict(0.1, 104.0) == ("check", 104.0)


def test_a_stalled_link_keeps_a_dead_agent_from_being_declared_silent_until_the_link_is_back():
    """Wired as the coordinator does: every node gets a full timeout from the link's return."""
    live = Liveness()
    live.heartbeat("a", 1.0, 0.0)  # timeout 4 s
    link = OwnLink()
    t, quiet_from = 0.0, 0.5  # the link stalled at 0.5 s
    declared = []
    while t < 12.0:
        t += PROBE_POLL_S
        healed = t >= 10.0
        quiet = 0.05 if healed else max(0.0, t - quiet_from)
        verdict, _ = link.verdict(quiet, t)
        if verdict == "excuse":
            live.excuse(t)
        if verdict in ("check", "excuse"):
            declared += live.expire(t)
    assert declared == []  # silent from 0.5 s but never heard from since: 2 s after the heal is too soon
    assert live.expire(10.0 + 4.0) == ["a"]
