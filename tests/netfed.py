"""A broker, a coordinator and N agents for the network tests: ``from netfed import ...``.

``running(work, configure=None, start=True, **kw)``
    A :class:`~fedagent.local.federation.Federation` (keyword arguments as its constructor: agents,
    rounds, alpha, mode, task, task_options, agent_broker_by_mdns, ...) in ``work``: a CA
    and certificates, a private Mosquitto with mutual TLS, every config written
    (``configure(fed)`` may rewrite them before anything starts), the coordinator and
    agent processes started unless ``start=False``. Everything is stopped when the block
    ends, also when a test fails::

        @pytest.fixture(scope="module")
        def federation(tmp_path_factory):
            with running(tmp_path_factory.mktemp("fed"), agents=3, rounds=6, alpha=0.3) as fed:
                yield fed

``wait_for(predicate, timeout, what, fed=None)``
    The one way these tests wait: poll ``predicate()`` until it returns something true
    (returned) or ``timeout`` seconds pass (AssertionError naming ``what``). With ``fed``
    (a Federation, or any set-up with ``check_alive()``, e.g. the multi-site lab), a
    daemon that exits meanwhile fails the wait at once, with its last log lines. Async
    tests wait with ``await asyncio.to_thread(wait_for, ...)``.

``observer(fed, name)``
    TlsFiles for a second coordinator-level identity ``name`` (a certificate of its own,
    added to the broker's ACL): a test's tap that reads every topic of the federation.
    The broker takes the client id from the certificate, so a tap holding the
    coordinator's own certificate would log in as the coordinator and disconnect it.

``coordinator_in(fed, *phases)`` / ``agents_in(fed, key, *values)``
    The coordinator's status if its ``phase`` is one of ``phases``; every agent's status
    if each one's ``key`` (``"phase"``, ``"round_state"``) is one of ``values``; None
    otherwise (for ``wait_for``).

``Tap(uri, tls, federation)``
    Every message of one federation as the broker delivered it, recorded in a thread of
    its own (``start()``, ``stop()``, ``messages()`` checked as a coordinator would).

``secure_running(work, tap=False, **kw)``
    ``running`` with secure aggregation on (``rounds_options`` merged over
    ``SECURE_OPTIONS``), agents given the broker's address; yields ``(fed, tap)``, the
    tap (or None) started before any daemon so it holds every message of the run.

``history(fed, node="coordinator", role="coordinator")``
    A daemon's history as a list of records, its rotated files first ([] before it exists).

``assert_only_masked_vectors(lines, bits)``
    The coordinator's journal holds only secure-aggregation messages, and every masked
    input looks uniform over the field, not like a quantised update.

``scrape(url)`` / ``value(samples, metric, **labels)``
    A Prometheus endpoint's samples, and the sum of those of one metric and labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from fedagent.local.federation import Federation
from fedagent.node.messaging import Incoming, Messenger
from fedagent.node.transport import TlsFiles, Transport
from fedagent.protocols import topics
from fedagent.security import pki
from fedagent.security.signing import Identity
from fedagent.storage.history import read_records

T = TypeVar("T")


class Watched(Protocol):
    def check_alive(self) -> None: ...


def wait_for(predicate: Callable[[], T], timeout: float, what: str, fed: Watched | None = None) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fed is not None:
            fed.check_alive()
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{_log_tails(fed)}")


def _log_tails(fed: object, chars: int = 1500) -> str:
    """The end of each coordinator's or aggregator's log: what a timed-out wait most often
    needs to be understood after the test's directory is gone."""
    out = []
    for p in getattr(fed, "procs", ()):
        log = getattr(p, "log", None)
        if ("coordinator" in p.name or "site" in p.name) and log is not None and log.exists():
            out.append(f"\n--- {p.name} (last lines) ---\n{log.read_text(errors='replace')[-chars:]}")
    return "".join(out)


@contextlib.contextmanager
def running(
    work: Path, *, configure: Callable[[Federation], None] | None = None, start: bool = True, **kw: Any
) -> Iterator[Federation]:
    fed = Federation(work, **kw)
    try:
        fed.prepare()
        if configure is not None:
            configure(fed)
        if start:
            fed.start_all()
        yield fed
    finally:
        fed.close()


def observer(fed: Federation, name: str) -> TlsFiles:
    ca_dir = fed.work / "pki"
    cert, key = pki.issue(ca_dir, ca_dir, name, "coordinator")
    assert fed.broker is not None
    fed.broker.reload_acl(coordinators=[*fed.broker.coordinators, name])
    return TlsFiles(ca_dir / pki.CA_CERT, cert, key)


def coordinator_in(fed: Federation, *phases: str) -> dict[str, Any] | None:
    s = fed.status("coordinator")
    return s if s and s["phase"] in phases else None


def agents_in(fed: Federation, key: str, *values: str) -> list[dict[str, Any]] | None:
    statuses = [fed.status(a) for a in fed.agent_ids]
    done = [s for s in statuses if s and s.get(key) in values]
    return done if len(done) == len(statuses) else None


class Tap:
    """Every message of one federation, as the broker delivered it, in a thread of its own."""

    def __init__(self, uri: str, tls: TlsFiles, federation: str) -> None:
        self.payloads: list[tuple[str, bytes]] = []
        self.fed = federation
        self.tls = tls
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.transport = Transport(uri=uri, tls=tls, subscriptions=[f"{topics.federation_root(federation)}/#"])
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _handle(self, topic: str, payload: bytes) -> None:
        self.payloads.append((topic, payload))

    def _run(self) -> None:
        async def main():
            self._stop = asyncio.Event()
            ready = asyncio.Event()
            task = asyncio.create_task(self.transport.run(self._handle, ready))
            await ready.wait()
            self._ready.set()
            await self._stop.wait()
            await self.transport.close(None)
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

        self._loop.run_until_complete(main())

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(15):
            raise AssertionError("the tap did not connect")

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def messages(self) -> list[Incoming]:
        """The recorded payloads through the daemons' own validation and reassembly."""
        out: list[Incoming] = []

        async def collect(inc: Incoming) -> None:
            out.append(inc)

        async def main():
            # Checked as a coordinator would check them: signatures, certificates, freshness.
            ident = Identity.load(self.tls.cert, self.tls.key, self.tls.ca)
            m = Messenger(federation=self.fed, node_id=ident.name, transport=None, identity=ident)
            for topic, payload in self.payloads:
                await m.receive(topic, payload, collect)
            assert not m.rejected, m.rejected

        asyncio.run(main())
        return out


#: What a secure round's coordinator may journal: never an update in the clear.
SECAGG_KINDS = {"secagg_keys", "secagg_shares", "secagg_masked", "secagg_signature", "secagg_reveal"}
#: Secure aggregation as the network tests run it: every stage bounded to 20 s.
SECURE_OPTIONS = {"secure_aggregation": True, "secure_stage_timeout": 20.0, "local_epochs": 1}


@contextlib.contextmanager
def secure_running(
    work: Path, *, tap: bool = False, rounds_options: dict[str, Any] | None = None, **kw: Any
) -> Iterator[tuple[Federation, Tap | None]]:
    kw.setdefault("agent_broker_by_mdns", False)
    kw.setdefault("round_timeout", 120.0)
    options = {**SECURE_OPTIONS, **(rounds_options or {})}
    with running(work, start=False, rounds_options=options, **kw) as fed:
        recorder = Tap(fed.broker_uri, observer(fed, "tap"), fed.fed) if tap else None
        if recorder is not None:
            recorder.start()
        try:
            fed.start_all()
            yield fed, recorder
        finally:
            if recorder is not None:
                recorder.stop()


def history(fed: Federation, node: str = "coordinator", role: str = "coordinator") -> list[dict]:
    return read_records(fed.work / "state" / node / role / fed.fed / "history.jsonl")  # rotated files too


def assert_only_masked_vectors(lines: list[dict], bits: int) -> None:
    received = [ln for ln in lines if ln.get("event") == "received"]
    assert received, "the coordinator journalled nothing"
    assert {ln["kind"] for ln in received} <= SECAGG_KINDS, {ln["kind"] for ln in received}
    masked = [ln for ln in received if ln["kind"] == "secagg_masked"]
    assert masked
    # Quantised values lie below 2^bits; a masked vector is uniform over 2^32, so only
    # ~2^(bits-32) of its values land there (0.0002 at 20 bits).
    assert all(ln["in_quantised_range"] < 0.01 for ln in masked), masked


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, metric, **labels):
    hits = [v for (n, ls), v in samples.items() if n == metric and all((k, v2) in ls for k, v2 in labels.items())]
    assert hits, f"no sample {metric} {labels}"
    return sum(hits)
