"""A broker, a coordinator and N agents for the network tests: ``from netfed import ...``.

``running(work, configure=None, start=True, **kw)``
    A :class:`~fedagent.localfed.Federation` (keyword arguments as its constructor: agents,
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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from fedagent import pki
from fedagent.localfed import Federation
from fedagent.node.transport import TlsFiles

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
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


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
