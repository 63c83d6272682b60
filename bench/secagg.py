"""Secure aggregation against plain FedAvg: per-round time and bytes, same run.

The ``round`` section's set-up (a private Mosquitto with mutual TLS, this process as
the coordinator, ten ``bench/fed_agent.py`` processes, training off), and rounds that
alternate between plain FedAvg (the ``round`` section's round) and a secure round:
the coordinator runs :class:`~fedagent.protocols.secagg.SecAggServer` and relays the
stages over the agents' inboxes; each agent (``fed_agent.py``) advertises signed keys,
seals its shares, masks an update of 0.001 per coordinate and reveals shares. The
round ends when the unmasked mean is known; it is checked against 0.001 within the
stated quantisation bound. Bytes are the coordinator's (in + out) for the round: every
byte of a round passes through it.

    .venv/bin/python bench/run.py --only secagg [--quick] [--params 1.1e6] [--repeats N]
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from bench.env import COORDINATOR, FEDERATION, bench_broker, mb, model_sizes
from bench.fed_agent import BENCH_DELTA
from bench.registry import Context, Row, section, summary
from bench.round import ROUND_TIMEOUT, FedRounds, proc_cpu
from fedagent.node.messaging import Incoming
from fedagent.protocols import secagg as SA
from fedagent.protocols import topics
from fedagent.protocols.messages import RoundStart, TrainConfig

AGENTS = 10


class SecureRounds(FedRounds):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.secagg_in: asyncio.Queue[tuple[str, SA.SecAggMessage]] = asyncio.Queue()
        # Keys the last secure round's agents advertised for the next one (as the
        # coordinator's round machine keeps them), and the round they are for.
        self.next_keys: dict[str, SA.SecAggKeys] = {}
        self.next_round = 0
        self.ahead_rounds = 0  # secure rounds that had no key stage

    async def _send_all(self, sends: list[SA.Send]) -> None:
        # As the coordinator daemon does: a stage's messages published together.
        await asyncio.gather(
            *(
                self.messenger.send(
                    topics.direct(FEDERATION, COORDINATOR, c.to, c.message.kind), c.message, round_=c.message.round
                )
                for c in sends
            )
        )

    async def _deliver(self, inc: Incoming) -> None:
        if isinstance(inc.message, SA.MESSAGES):
            self.secagg_in.put_nowait((inc.sender, inc.message))
        else:
            await super()._deliver(inc)

    def _bytes(self) -> int:
        return self.messenger.bytes_in + self.messenger.bytes_out

    def _cpu(self) -> tuple[float, float]:
        """CPU seconds so far of (this process, the coordinator; the agent processes)."""
        return time.process_time(), proc_cpu([p.pid for p in self.procs])

    async def plain_round(self, r: int) -> tuple[float, int, float, float]:
        """(seconds, coordinator bytes, CPU seconds of coordinator + agents, of the coordinator)."""
        b0 = self._bytes()
        c0 = self._cpu()
        t, cpu, _ = await self.round(r)
        return t, self._bytes() - b0, cpu, time.process_time() - c0[0]

    async def secure_round(self, r: int, params: SA.SecAggParams) -> tuple[float, int, float, float, dict[str, float]]:
        """(seconds, coordinator bytes, CPU seconds of coordinator + agents, of the
        coordinator, seconds per stage) of one secure round."""
        b0 = self._bytes()
        c0 = self._cpu()
        t0 = time.perf_counter()
        # Rounds alternate plain and secure: the next secure round is r + 2. Its keys
        # come with this round's masked inputs, so it has no key stage.
        ahead = self.next_round == r and set(self.agents) <= set(self.next_keys)
        setup = SA.SecAggSetup(params, os.urandom(16), 1, next_round=r + 2, ahead=ahead)
        server = SA.SecAggServer(
            r,
            self.agents,
            setup,
            SA.layout_size(self.weights),
            now=time.monotonic(),
            stage_timeout=ROUND_TIMEOUT / 3,
            input_deadline=time.monotonic() + ROUND_TIMEOUT,
            ahead=self.next_keys if ahead else None,
        )
        self.ahead_rounds += ahead
        start = RoundStart(
            round=r,
            model_version=r - 1,
            selected=tuple(self.agents),
            deadline_s=600,
            train=TrainConfig(stream=False),
            weights=self.weights,
            secagg=setup,
        )
        # As the coordinator daemon does: the small setup first, so the key and share
        # stages run while the model is on its way.
        await self.messenger.send(
            topics.broadcast(FEDERATION, "secagg_start"), SA.SecAggStart(r, tuple(self.agents), setup), round_=r
        )
        since = time.perf_counter()
        cmds: list[SA.ServerCommand] = server.start()
        stage = server.stage  # (keys ahead: the share stage, from the start)
        # (keys ahead: the rosters, before the model)
        await self._send_all([c for c in cmds if isinstance(c, SA.Send)])
        cmds = [c for c in cmds if not isinstance(c, SA.Send)]
        sending = asyncio.create_task(self.messenger.send(topics.broadcast(FEDERATION, "round_start"), start, round_=r))
        stages: dict[str, float] = {}
        result: SA.Unmasked | None = None
        while result is None:
            await self._send_all([c for c in cmds if isinstance(c, SA.Send)])
            for c in cmds:
                if isinstance(c, SA.Unmasked):
                    result = c
                elif isinstance(c, SA.Failed):
                    raise RuntimeError(f"secure round {r} failed: {c.reason}")
                elif isinstance(c, SA.Refused) and c.reason != "stale":
                    # (stale: shares of an earlier round, sent after its masks were off)
                    self.log(f"secure round {r}: {c.sender} {c.reason}: {c.detail}")
            if server.stage != stage:
                stages[stage] = time.perf_counter() - since
                stage, since = server.stage, time.perf_counter()
            if result is not None:
                break
            try:
                sender, msg = await asyncio.wait_for(self.secagg_in.get(), ROUND_TIMEOUT)
            except TimeoutError:
                cmds = server.handle(SA.Tick(), time.monotonic())
                continue
            if isinstance(msg, (SA.SecAggMasked, SA.SecAggReveal)):
                # (a model-sized sum, or masks coming off: off the event loop)
                cmds = await asyncio.to_thread(server.handle, SA.Received(sender, msg), time.monotonic())
            else:
                cmds = server.handle(SA.Received(sender, msg), time.monotonic())
        await sending
        elapsed = time.perf_counter() - t0
        self.next_keys, self.next_round = dict(server.next_keys), setup.next_round
        err = float(np.abs(result.mean - BENCH_DELTA).max())
        if err > result.error_bound + 1e-12:
            raise RuntimeError(f"unmasked mean off by {err:.3g}, bound {result.error_bound:.3g}")
        c1 = self._cpu()
        return elapsed, self._bytes() - b0, sum(c1) - sum(c0), c1[0] - c0[0], stages


async def _measure(bb, params: int, repeats: int, log) -> dict:
    fed = SecureRounds(bb, params, log)
    sp = SA.SecAggParams()
    try:
        await fed.start()
        await fed.plain_round(1)  # warm-up
        await fed.secure_round(2, sp)
        keys = (
            "plain",
            "secure",
            "plain_bytes",
            "secure_bytes",
            "plain_cpu",
            "secure_cpu",
            "plain_coord_cpu",
            "secure_coord_cpu",
            "stages",
        )
        res: dict[str, list] = {k: [] for k in keys}
        r = 3
        for i in range(repeats):
            t, b, c, cc = await fed.plain_round(r)
            ts, bs, cs, ccs, stages = await fed.secure_round(r + 1, sp)
            r += 2
            for k, v in zip(keys, (t, ts, b, bs, c, cs, cc, ccs, stages), strict=True):
                res[k].append(v)
            log(
                f"{mb(params)} round {i + 1}/{repeats}: plain {t:.2f} s {b / 1e6:.1f} MB CPU {c:.2f} s "
                f"(coordinator {cc:.2f} s), secure {ts:.2f} s {bs / 1e6:.1f} MB CPU {cs:.2f} s (coordinator "
                f"{ccs:.2f} s; {', '.join(f'{k} {v:.2f} s' for k, v in stages.items())})"
            )
        # Two rounds as after a change of cohort: nobody's keys came ahead, a key stage.
        res["explicit"] = []
        for _ in range(2):
            await fed.plain_round(r)
            fed.next_keys = {}
            ts, *_ = await fed.secure_round(r + 1, sp)
            res["explicit"].append(ts)
            r += 2
        log(f"{mb(params)} secure rounds with a key stage: {', '.join(f'{t:.2f} s' for t in res['explicit'])}")
        res["ahead_rounds"] = fed.ahead_rounds
        return res
    finally:
        await fed.stop()


def _rows(ctx: Context) -> int:
    from bench.flower import SECAGGPLUS_ROWS  # (imported here: bench.flower registers a section)

    return (4 + (0 if ctx.quick else SECAGGPLUS_ROWS)) * len(model_sizes(ctx))


@section("secagg", rows=_rows)
def secure_aggregation(ctx: Context, agents: int = AGENTS) -> list[Row]:
    rows = []
    with bench_broker(ctx, ctx.work / "secagg", agents) as bb:
        for params in model_sizes(ctx):
            res = asyncio.run(_measure(bb, params, ctx.repeats, ctx.log))
            sec_med, sec_max = summary(res["secure"])
            pl_med, pl_max = summary(res["plain"])
            stage_med = {k: summary([s.get(k, 0.0) for s in res["stages"]])[0] for k in res["stages"][0]}
            if res["ahead_rounds"] < len(res["secure"]):
                raise RuntimeError(f"only {res['ahead_rounds']} secure rounds had their keys ahead")
            n = len(res["secure"])
            rows.append(
                Row(
                    "secagg",
                    f"secure FedAvg round (SecAgg+), TLS, {agents} agents, {mb(params)} (median)",
                    sec_med,
                    "plain fedagent FedAvg round (median)",
                    pl_med,
                    note=f"goal <= 1.5x; n={n}, keys advertised a round ahead (no key stage); stages (median) "
                    + ", ".join(f"{k} {v:.2f} s" for k, v in stage_med.items())
                    + f"; with a key stage (new cohort) {summary(res['explicit'])[0]:.2f} s (n=2)",
                )
            )
            rows.append(
                Row(
                    "secagg",
                    f"secure FedAvg round (SecAgg+), TLS, {agents} agents, {mb(params)} (max)",
                    sec_max,
                    "plain fedagent FedAvg round (max)",
                    pl_max,
                    note=f"goal <= 1.5x; n={n}",
                )
            )
            coord, plain_coord = summary(res["secure_coord_cpu"])[0], summary(res["plain_coord_cpu"])[0]
            rows.append(
                Row(
                    "secagg",
                    f"CPU of coordinator + {agents} agents per secure round, {mb(params)} (median)",
                    summary(res["secure_cpu"])[0],
                    "per plain round (median)",
                    summary(res["plain_cpu"])[0],
                    note=f"client side only (excludes the broker); coordinator {coord:.2f} s vs {plain_coord:.2f} s; "
                    f"max {max(res['secure_cpu']):.2f} s vs {max(res['plain_cpu']):.2f} s",
                )
            )
            rows.append(
                Row(
                    "secagg",
                    f"coordinator bytes per secure round, {mb(params)} (median)",
                    summary(res["secure_bytes"])[0],
                    "per plain round (median)",
                    summary(res["plain_bytes"])[0],
                    unit="B",
                )
            )
            if not ctx.quick:  # Flower 1.41's SecAgg+ on the same shape, unless --quick
                from bench.flower import secaggplus_rows

                rows += secaggplus_rows(ctx, params, agents, SA.SecAggParams(), res)
    return rows
