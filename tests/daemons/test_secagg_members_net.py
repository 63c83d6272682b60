"""A member inside secure rounds, over Mosquitto with mTLS and real processes: three
honest digits agents and "mallory", an agent whose secure-aggregation client is altered
(the test-only task tests/secagg_mallory_task.py), switching attacks while the
federation trains. For each attack: the coordinator never exits, the agent named is
mallory (never an honest one), and the global model's accuracy stays within 2 points of
the model's without the attack.

* altered shares at unmasking: mallory is named (``bad_share``) and benched; the rounds
  complete with its input (its shares were not needed);
* shares of a wrong secret: the round fails naming mallory, which then sits out;
* junk share boxes: each honest agent withdraws at once naming the sealer; two of them
  saying so name mallory, which sits out;
* a masked input far outside the quantisation range (+50·N(0,1) per coordinate): the
  unmasked sum proves it and the round is abandoned instead of applied (who sent it is
  hidden by the masks: no one is named or benched).

``-s`` prints the accuracy before and during each attack.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from netfed import history, secure_running, wait_for
from secagg_mallory_task import steps_file

from fedagent.local.federation import SEED, Federation
from fedagent.tasks.base import load_task, set_weights

HONEST = 3
ACCURACY_SLACK = 0.02


def accuracy(fed: Federation) -> float:
    weights, _ = fed.final_weights()
    task = load_task("digits", {"seed": SEED})
    model = task.build_model()
    set_weights(model, weights)
    return float(task.evaluate(model)["accuracy"])


def status(fed: Federation) -> dict[str, Any]:
    return wait_for(lambda: fed.status("coordinator"), 30, "the coordinator's status", fed)


def events_since(fed: Federation, start: int) -> list[dict[str, Any]]:
    return [ln for ln in history(fed)[start:] if ln.get("event") in ("round", "abandoned")]


def made_under_others(attack_file: Path, name: str) -> set[int]:
    """The rounds in which mallory made a step under another attack than ``name``."""
    try:
        text = steps_file(attack_file).read_text()
    except FileNotFoundError:
        return set()
    steps = (line.split() for line in text[: text.rfind("\n") + 1].splitlines())
    return {int(r) for r, a in steps if a != name}


def run_attack(
    fed: Federation,
    attack_file: Path,
    name: str,
    rounds: int,
    timeout: float = 90.0,
    until: Callable[[list[dict[str, Any]]], bool] = lambda lines: True,
):
    """Switches mallory to ``name`` and waits for ``rounds`` secure rounds (aggregated
    or abandoned) in which mallory was selected, and for ``until(lines)``; returns
    their history lines. A round under way at the switch can end after it with
    mallory's part made under the attack before (boxes sealed while it was still
    ``bad_dealing``): rounds in which mallory made a step under another attack are left
    out (its steps are logged before they are sent, so before the round's line)."""
    start = len(history(fed))
    attack_file.write_text(name)
    seen: list[dict[str, Any]] = []

    def enough():
        fed.check_alive()
        nonlocal seen
        lines = events_since(fed, start)
        others = made_under_others(attack_file, name)
        seen = [ln for ln in lines if ln["round"] not in others]
        hit = [ln for ln in seen if ln["event"] == "abandoned" or "mallory" in ln.get("participants", ())]
        return len(hit) >= rounds and len(seen) >= rounds + 1 and until(seen)

    wait_for(enough, timeout, f"{rounds} rounds of {name}", fed)
    attack_file.write_text("none")
    return seen


def test_a_member_spoiling_secure_rounds_is_named_and_cannot_move_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1]))
    attack_file = tmp_path / "attack"
    attack_file.write_text("none")
    opts = {
        "min_agents": HONEST,
        "expected_agents": HONEST + 1,
        "start_grace": 1.0,
        "local_steps": 5,
        "secure_stage_timeout": 5.0,
    }
    with secure_running(
        tmp_path / "fed", agents=HONEST, rounds=10**6, alpha=0.5, round_timeout=20.0, rounds_options=opts
    ) as (fed, _):
        fed.add_agent(
            "mallory",
            "secagg_mallory_task:make",
            {"shard": 0, "shards": HONEST, "alpha": 0.5, "seed": SEED, "attack_file": str(attack_file)},
        )
        wait_for(lambda: (s := fed.status("coordinator")) and s["completed_rounds"] >= 15, 150, "15 rounds", fed)
        acc0 = accuracy(fed)
        figures = {"no attack": acc0}

        # altered shares: named, benched; the rounds it is in still complete
        # (its shares are looked at only when they come before enough honest ones)
        def named(lines: list[dict[str, Any]]) -> bool:
            return any(ln["event"] == "round" and ln["secure"]["offenders"] for ln in lines)

        lines = run_attack(fed, attack_file, "bad_shares", 2, until=named)
        fed.check_alive()
        rejected = [r for r in status(fed)["recent_rejections"] if r["reason"] == "bad_share"]
        assert rejected and {r["sender"] for r in rejected} == {"mallory"}
        rounds = [ln for ln in lines if ln["event"] == "round"]
        assert {a for ln in rounds for a in ln["secure"]["offenders"]} == {"mallory"}
        assert all(w.startswith("revealed") for ln in rounds for w in ln["secure"]["offenders"].values())
        figures["bad_shares"] = accuracy(fed)

        # shares of a wrong secret: the owner is named, the round fails, it sits out
        lines = run_attack(fed, attack_file, "bad_dealing", 1)
        fed.check_alive()
        failed = [ln for ln in lines if ln["event"] == "abandoned"]
        assert failed and all("mallory" in ln["reason"] and "sitting out" in ln["reason"] for ln in failed)
        assert not any(h in ln["reason"] for ln in failed for h in fed.agent_ids if h != "mallory")
        figures["bad_dealing"] = accuracy(fed)

        # junk share boxes: the honest agents withdraw at once, naming the sealer; two of
        # them saying so name mallory, which sits out. The withdrawals are refused (and
        # kept among the recent rejections) before their round is abandoned, but that
        # ring holds only the last RECENT_REJECTIONS and mallory's later refusals can
        # push them out: it is read while waiting, until it holds a withdrawal from an
        # abandoned round of the window, not once after the window has closed.
        ring: list[dict[str, Any]] = []

        def withdrawals_kept(lines: list[dict[str, Any]]) -> bool:
            nonlocal ring
            failed = {ln["round"] for ln in lines if ln["event"] == "abandoned"}
            if not failed:
                return False
            ring = status(fed)["recent_rejections"]
            return any(r["reason"] == "withdrawn" and r.get("round") in failed for r in ring)

        lines = run_attack(fed, attack_file, "bad_boxes", 1, until=withdrawals_kept)
        fed.check_alive()
        failed = [ln for ln in lines if ln["event"] == "abandoned"]
        assert failed and all("mallory" in ln["reason"] and "sitting out" in ln["reason"] for ln in failed)
        assert not any(f"{h} " in ln["reason"] for ln in failed for h in fed.agent_ids if h != "mallory")
        withdrawn = [r for r in ring if r["reason"] == "withdrawn"]
        assert withdrawn and all("mallory" in r["detail"] for r in withdrawn), (ring, lines)
        assert not any(h in r["detail"] for r in withdrawn for h in fed.agent_ids if h != "mallory"), ring
        figures["bad_boxes"] = accuracy(fed)

        # out of range: the round is abandoned, never applied
        lines = run_attack(fed, attack_file, "out_of_range", 2)
        fed.check_alive()
        failed = [ln for ln in lines if ln["event"] == "abandoned"]
        assert len(failed) >= 2 and all("out of range" in ln["reason"] for ln in failed)
        applied = [ln for ln in lines if ln["event"] == "round" and "mallory" in ln["participants"]]
        assert not applied
        figures["out_of_range"] = accuracy(fed)

        # and training goes on once mallory stops
        n = status(fed)["completed_rounds"]
        wait_for(lambda: status(fed)["completed_rounds"] >= n + 3, 60, "rounds after the attacks", fed)
        fed.check_alive()
    print("\naccuracy of the global model (digits, 3 honest agents + mallory, secure rounds):")
    for name, acc in figures.items():
        print(f"  {name:14s} {acc:.4f}")
    for name, acc in figures.items():
        assert acc >= acc0 - ACCURACY_SLACK, (name, figures)
