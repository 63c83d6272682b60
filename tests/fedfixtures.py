"""Shared fixtures: a throw-away PKI and a real Mosquitto with mutual TLS.

``pki`` (session)
    A CA for federation ``testfed`` in a temporary directory, with certificates for
    ``agent-a``, ``agent-b`` (role agent) and ``coord`` (role coordinator); a foreign
    CA (federation ``foreign``) with its own ``agent-a``; and ``agent-old``, issued by
    the testfed CA but expired yesterday.

    * ``pki.tls("agent-a") -> TlsFiles`` — credentials for that identity, trusting
      the testfed CA. ``pki.tls("agent-a", foreign=True)`` is the foreign CA's agent-a
      certificate (still trusting the testfed CA, i.e. what an intruder would hold).
    * ``pki.issue("agent-7", role="agent") -> TlsFiles`` — issue another identity
      (cached; pass not_before/not_after like ``fedagent.security.pki.issue``).
    * ``pki.ca`` (testfed ``ca.crt``), ``pki.ca_dir``, ``pki.foreign_ca``,
      ``pki.federation == "testfed"``.

``broker`` (session)
    An :class:`~fedagent.mosquitto.EmbeddedBroker` for federations ``["testfed"]`` with
    coordinator ``coord``, started once. ``broker.uri``, ``broker.ca_dir``,
    ``broker.tls(name)`` (same as ``pki.tls``), ``broker.pki``, and everything of
    EmbeddedBroker (``log_path``, ``reload_acl()``, ...). Tests that restart or kill
    a broker should use ``broker_factory`` so they don't disturb the shared one.
    The broker takes the client id from the certificate's CN, so a session belongs to
    an identity: ``peer`` connects with Session Expiry 0 by default (nothing a test
    leaves behind reaches the next one); a test about session resumption connects as a
    fresh identity of its own (``peer(..., client_id=unique_id("agent-b"))``).

``broker_factory`` (function)
    ``broker_factory(federations=("testfed",), coordinators=("coord",), **kw)`` starts a
    private EmbeddedBroker on the same PKI; all of them are stopped after the test.

``arun`` (function)
    ``arun(coro, timeout=30)`` runs a coroutine in a fresh event loop with a deadline
    (no pytest-asyncio here).

``peer`` (function)
    ``async with peer(broker, "agent-a", subscriptions=[...]) as p:`` runs a
    :class:`~fedagent.node.transport.Transport` for that identity in the background
    until the block ends (then closes it cleanly) and collects what it receives:
    ``await p.get(timeout)`` → ``(topic, payload)``, ``await p.until(pred)`` returns
    the messages received until one matches, ``p.transport.publish(...)``. Keyword
    arguments go to Transport (``will``, ``on_connect``, ``keepalive``,
    ``session_expiry``, default 0); ``client_id`` (default: NAME; another id is a fresh
    identity with NAME's role, issued on first use, whose session the test owns), ``tls``
    (default: the identity's), ``handler`` (instead of
    collecting), ``final`` (published by the clean close at the end), ``wait=False``
    (don't wait for the first connection).

``unique_id(prefix)`` (plain function: ``from fedfixtures import unique_id``)
    A node id (and so a client id) no other test uses.

Every process a fixture starts is stopped in its finalizer, also when a test fails.

``_fork_server`` (session, automatic)
    The daemons the federations start (``fedagent.local.launch``) are forks of one
    process that imported torch and fedagent once (tests/forkserver.py), started on the
    first daemon of the session; ``FEDAGENT_TEST_FORK_SERVER=0`` gives every daemon a
    fresh interpreter instead.

A whole federation (a broker, a coordinator and N agent processes) and the one
``wait_for`` the network tests use are in ``netfed.py`` (``from netfed import running,
wait_for``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import forkserver
import pytest

from fedagent.local import launch
from fedagent.mosquitto import EmbeddedBroker
from fedagent.node.transport import TlsFiles, Transport
from fedagent.security import pki as pki_mod
from fedagent.security.signing import Identity

FEDERATION = "testfed"
COORDINATOR = "coord"
_ids = itertools.count(1)


def ident(pki: TestPki, name: str) -> Identity:
    t = pki.tls(name)
    return Identity.load(t.cert, t.key, t.ca)


def unique_id(prefix: str) -> str:
    """An MQTT client id nobody else in this test run uses (fresh persistent session)."""
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


@dataclass
class TestPki:
    root: Path
    federation: str = FEDERATION
    ca_dir: Path = field(init=False)
    certs: Path = field(init=False)
    foreign_ca_dir: Path = field(init=False)
    foreign_certs: Path = field(init=False)

    __test__ = False  # not a test class, whatever pytest thinks of the name

    def __post_init__(self) -> None:
        self.ca_dir = self.root / "ca"
        self.certs = self.root / "certs"
        self.foreign_ca_dir = self.root / "foreign-ca"
        self.foreign_certs = self.root / "foreign-certs"

    @property
    def ca(self) -> Path:
        return self.ca_dir / pki_mod.CA_CERT

    @property
    def foreign_ca(self) -> Path:
        return self.foreign_ca_dir / pki_mod.CA_CERT

    def tls(self, name: str, *, foreign: bool = False) -> TlsFiles:
        d = self.foreign_certs if foreign else self.certs
        return TlsFiles(ca=self.ca, cert=d / f"{name}.crt", key=d / f"{name}.key")

    def issue(self, name: str, role: str = "agent", **kw) -> TlsFiles:
        if kw or not (self.certs / f"{name}.crt").exists():
            pki_mod.issue(self.ca_dir, self.certs, name, role, **kw)
        return self.tls(name)

    def create(self) -> None:
        pki_mod.create_ca(self.ca_dir, self.federation)
        for name in ("agent-a", "agent-b"):
            pki_mod.issue(self.ca_dir, self.certs, name, "agent")
        pki_mod.issue(self.ca_dir, self.certs, COORDINATOR, "coordinator")
        now = dt.datetime.now(dt.UTC)
        pki_mod.issue(
            self.ca_dir,
            self.certs,
            "agent-old",
            "agent",
            not_before=now - dt.timedelta(days=30),
            not_after=now - dt.timedelta(days=1),
        )
        pki_mod.create_ca(self.foreign_ca_dir, "foreign")
        pki_mod.issue(self.foreign_ca_dir, self.foreign_certs, "agent-a", "agent")


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> TestPki:
    p = TestPki(tmp_path_factory.mktemp("pki"))
    p.create()
    return p


class TestBroker:
    """The shared broker: an EmbeddedBroker plus the PKI it trusts."""

    __test__ = False

    def __init__(self, embedded: EmbeddedBroker, pki: TestPki) -> None:
        self.embedded = embedded
        self.pki = pki

    def tls(self, name: str, *, foreign: bool = False) -> TlsFiles:
        return self.pki.tls(name, foreign=foreign)

    def __getattr__(self, attr: str):
        return getattr(self.embedded, attr)

    def __repr__(self) -> str:
        return f"<TestBroker {self.embedded!r}>"


def _make_broker(
    workdir: Path, pki: TestPki, federations=(FEDERATION,), coordinators=(COORDINATOR,), **kw
) -> TestBroker:
    b = EmbeddedBroker(workdir, federations=federations, coordinators=coordinators, ca_dir=pki.ca_dir, **kw)
    try:
        b.start()
    except BaseException:
        b.stop()
        raise
    return TestBroker(b, pki)


@pytest.fixture(scope="session")
def broker(pki, tmp_path_factory):
    b = _make_broker(tmp_path_factory.mktemp("broker"), pki)
    try:
        yield b
    finally:
        b.embedded.stop()


@pytest.fixture
def broker_factory(pki, tmp_path_factory):
    made: list[TestBroker] = []

    def make(federations=(FEDERATION,), coordinators=(COORDINATOR,), **kw) -> TestBroker:
        b = _make_broker(tmp_path_factory.mktemp("broker"), pki, federations, coordinators, **kw)
        made.append(b)
        return b

    try:
        yield make
    finally:
        for b in made:
            b.embedded.stop()


@pytest.fixture(scope="session", autouse=True)
def _fork_server(tmp_path_factory):
    if os.environ.get(forkserver.ENV_SWITCH, "1") == "0":
        yield None
        return
    server = forkserver.ForkServer(tmp_path_factory.getbasetemp() / "forkserver.log")
    previous = launch.use(server.launch)
    try:
        yield server
    finally:
        launch.use(previous)
        server.close()
        if server.forked or server.fallbacks:
            _session_notes.append(server.summary())


_session_notes: list[str] = []


def pytest_terminal_summary(terminalreporter) -> None:
    for note in _session_notes:
        terminalreporter.write_line(note)


@pytest.fixture
def arun() -> Callable:
    def run(coro, timeout: float = 30):
        return asyncio.run(asyncio.wait_for(coro, timeout))

    return run


class Peer:
    """A Transport running in the background, collecting what it receives."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.messages: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self.ready = asyncio.Event()
        self.task: asyncio.Task | None = None

    async def _handle(self, topic: str, payload: bytes) -> None:
        self.messages.put_nowait((topic, payload))

    async def get(self, timeout: float = 5.0) -> tuple[str, bytes]:
        try:
            return await asyncio.wait_for(self.messages.get(), timeout)
        except TimeoutError:
            raise AssertionError(f"{self.transport.client_id} received nothing within {timeout}s") from None

    async def until(self, predicate: Callable[[str, bytes], bool], timeout: float = 5.0) -> list[tuple[str, bytes]]:
        """Messages received up to and including the first one matching ``predicate``."""
        seen = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise AssertionError(
                    f"{self.transport.client_id}: no matching message within {timeout}s; got {[t for t, _ in seen]}"
                )
            topic, payload = await self.get(remaining)
            seen.append((topic, payload))
            if predicate(topic, payload):
                return seen

    async def wait_ready(self, timeout: float = 10.0) -> None:
        ready = asyncio.create_task(self.ready.wait())
        done, _ = await asyncio.wait({ready, self.task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self.task in done:
            ready.cancel()
            self.task.result()  # raises what run() raised
            raise AssertionError("Transport.run() returned before connecting")
        if ready not in done:
            ready.cancel()
            raise AssertionError(
                f"{self.transport.client_id} not connected within {timeout}s "
                f"(state {self.transport.state}, {self.transport.last_error})"
            )


@pytest.fixture
def peer():
    @contextlib.asynccontextmanager
    async def run_peer(
        broker,
        name: str,
        *,
        tls: TlsFiles | None = None,
        client_id: str | None = None,
        subscriptions=(),
        final: tuple[str, bytes] | None = None,
        handler=None,
        wait: bool = True,
        **kw,
    ) -> AsyncIterator[Peer]:
        if tls is None:
            if client_id is not None and client_id != name:
                tls = broker.pki.issue(client_id, pki_mod.role_of(broker.pki.tls(name).cert))
            else:
                tls = broker.pki.tls(name)
        if client_id is None:
            kw.setdefault("session_expiry", 0)
        t = Transport(uri=broker.uri, tls=tls, subscriptions=subscriptions, **kw)
        p = Peer(t)
        p.task = asyncio.create_task(t.run(handler or p._handle, p.ready))
        try:
            if wait:
                await p.wait_ready()
            yield p
        finally:
            if not p.task.done():
                await t.close(final)
            p.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await p.task

    return run_peer


@pytest.fixture
def text_cache_one_thread(tmp_path_factory, monkeypatch):
    """A session-wide private text cache, and one torch thread: the text tasks' tensor ops
    are small, so intra-op threads only add contention (the daemons use 1 too)."""
    import torch

    monkeypatch.setenv("FEDAGENT_CACHE", str(tmp_path_factory.getbasetemp() / "text-cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- markers ------------------------------------------------------------------------------
#: Folders whose tests all talk to real processes (a broker, daemons, namespaces).
PROCESS_FOLDERS = frozenset({"node", "daemons", "net", "faults"})
#: Fixtures that start a broker process for the test.
PROCESS_FIXTURES = frozenset({"broker", "broker_factory", "peer"})


def pytest_collection_modifyitems(config, items) -> None:
    """``procs`` on every test that starts or talks to a process: by folder, by the broker
    fixtures it uses, or marked by its module. The guard below holds the rest to it."""
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in PROCESS_FOLDERS or PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.procs)


#: Programs libraries run to look something up, allowed in in-process tests.
PROBES = frozenset({"ldconfig"})


class StartedAProcess(AssertionError):
    pass


@pytest.fixture(autouse=True)
def _processes_need_the_procs_marker(request, monkeypatch):
    """A test without the ``procs`` marker may not start a process, so that
    ``-m 'not procs'`` really is the set that runs in-process only."""
    if request.node.get_closest_marker("procs") is not None:
        yield
        return
    import subprocess

    def refuse(*args, **kwargs):
        raise StartedAProcess(f"{request.node.nodeid} starts a process: mark it procs (pytest.mark.procs)")

    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def refuse_but_library_probes(popen, argv, *args, **kwargs):
        # ctypes.util.find_library runs `ldconfig -p` the first time a library is looked
        # up in a process (zeroconf's interface lookup does): a probe of the library, not a
        # process the test starts, and only in whichever test happens to come first.
        if isinstance(argv, list | tuple) and argv and os.path.basename(str(argv[0])) in PROBES:
            return execute_child(popen, argv, *args, **kwargs)
        refuse()

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse_but_library_probes)
    monkeypatch.setattr(os, "fork", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    yield
