"""Mosquitto for a federation: its configuration, its ACL, and a private instance
fedagent starts and owns.

The security model lives in two places that must agree:

* TLS: the listener requires a client certificate signed by the federation CA and
  takes the certificate's CN as the MQTT username (``use_identity_as_username``) and
  as the client id (``use_username_as_clientid``), so no certificate can log in
  under another node's id and take over its connection or session. There are no
  passwords and no anonymous clients.
* The ACL (:func:`render_acl`) implements the topic layout of
  :mod:`fedagent.protocols.topics`: a node writes only under its own ``node/<id>/``
  subtree and reads presence, what is addressed to it, and the coordinators'
  ``global/`` broadcasts, in its own federation. With one federation whose CA issued
  for no other, ``pattern`` rules (``%u`` = the CN) say that for every certificate;
  otherwise every identity in the CA's register gets rules of its own
  (:func:`acl_members`). Only coordinator identities may write ``global/``; bridges
  relay nodes' traffic up and carry only the coordinators' messages down.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import ssl
import subprocess
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from fedagent import pki
from fedagent.errors import ConfigError, TransportError
from fedagent.protocols.topics import PREFIX, check_name
from fedagent.stopsignals import child_starting

#: glibc settings for a Mosquitto fedagent starts (the environment's own win): messages
#: up to 32 MiB come from the broker's heap and freed ones stay there for the next,
#: instead of fresh pages from the system, zeroed by the kernel, for every message it
#: relays. Measured with Sync-Opt (5 agents, 3.1 MB messages, 16 relayed per step): the
#: broker's CPU per step fell from 54-56 ms to 38-39 ms. Mosquitto run as a service can
#: be given the same two variables (docs/deployment.md).
BROKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(128 * 2**20)}

DEFAULT_MAX_PACKET_SIZE = 16 * 2**20
DEFAULT_PORT = 8883
# Per client, beyond the QoS 1 messages in flight to it (Mosquitto applies both limits to
# every client; past either one it drops what would be queued, and says so in its log).
# Agents do not have the global model queued for them while they are away (they fetch
# the current one when they come back), so what these bound is the coordinator's
# backlog of one round: the updates of the agents it selected, waiting at the broker
# while it folds them a few chunks at a time. The operators' guide gives the sizing.
DEFAULT_MAX_QUEUED_BYTES = 1024 * 2**20
DEFAULT_MAX_QUEUED_MESSAGES = 100_000
# MQTT 5 CONNECT: clean start, keep-alive 10 s, no properties, empty client id. The
# broker replaces the id with the certificate's CN (use_username_as_clientid), so the
# readiness probe logs in as the broker's own identity, which no node uses.
MQTT5_PROBE_CONNECT = bytes.fromhex("100d00044d5154540502000a000000")
MQTT5_DISCONNECT = bytes.fromhex("e000")
_INSTALL_HINT = (
    "install it with `apt-get install mosquitto` (Debian/Ubuntu), "
    "`dnf install mosquitto` (Fedora) or `brew install mosquitto` (macOS)"
)


def find_mosquitto() -> str:
    """Path of the ``mosquitto`` binary, or ConfigError saying how to install it."""
    for candidate in (shutil.which("mosquitto"), "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise ConfigError(
        f"the Mosquitto broker is not installed (no `mosquitto` on PATH or in /usr/sbin); {_INSTALL_HINT}"
    )


def _unique(names: Sequence[str], what: str) -> list[str]:
    if isinstance(names, str):
        raise TypeError(f"{what}: expected a sequence of names, not one string")
    out: list[str] = []
    for n in names:
        check_name(n, what)
        if n not in out:
            out.append(n)
    return out


def acl_members(ca_dir: Path, federations: Sequence[str]) -> dict[str, tuple[str, str]] | None:
    """What :func:`render_acl` needs to know about the CA's members: None when a
    ``pattern`` ACL is exact (one federation, and every certificate the CA issued is
    of it), else the CA's register (``{name: (role, federation)}``)."""
    feds = _unique(federations, "federation")
    register = pki.members(ca_dir)
    if len(feds) == 1 and all(fed == feds[0] for _, fed in register.values()):
        return None
    return register


def render_acl(
    federations: Sequence[str],
    coordinators: Sequence[str],
    *,
    members: dict[str, tuple[str, str]] | None = None,
    bridges: Sequence[str] = (),
) -> str:
    """The Mosquitto ACL file for these federations, coordinator and bridge identities.

    ``members`` None: ``pattern`` rules for every certificate (``%u`` its CN), which is
    exact only if every certificate the broker's CA issued belongs to the one
    federation served (:func:`acl_members` decides). Otherwise ``members`` maps each
    identity to ``(role, federation)`` and every identity gets its own rules, in its own
    federation only; a certificate missing from it can do nothing. Coordinators may
    write ``global/`` of their federation. A bridge (a site broker's identity at the
    hub) may write nodes' subtrees and read ``global/`` and what coordinators address
    to nodes, in every federation served, and nothing else: it relays agents' traffic
    up and the coordinators' messages down (:func:`render_bridge`), and cannot
    broadcast.
    """
    feds = _unique(federations, "federation")
    coords = _unique(coordinators, "coordinator id")
    relays = _unique(bridges, "bridge name")
    lines = [
        "# fedagent broker ACL, generated by fedagent.broker.render_acl; do not edit.",
        "# %u is the client certificate's CN (use_identity_as_username), also its client id.",
        "# `pattern` rules apply to every client; `topic` rules apply to the `user` above",
        "# them (a `topic` line before any `user` line would apply to anonymous clients",
        "# only, so there is none).",
        "",
    ]
    if members is None:
        if len(feds) > 1:
            raise ConfigError(
                "several federations on one broker need per-identity rules: pass the CA's members "
                "(fedagent.pki.members), so that a certificate acts only in its own federation"
            )
        for fed in feds:
            root = f"{PREFIX}/{fed}"
            lines += [
                f"# federation {fed}",
                f"pattern write {root}/node/%u/#",
                f"pattern read {root}/node/+/presence",
                f"pattern read {root}/node/+/to/%u/#",
                f"pattern read {root}/global/#",
                "",
            ]
        for coord in coords:
            lines.append(f"user {coord}")
            lines += [f"topic readwrite {PREFIX}/{fed}/#" for fed in feds]
            lines.append("")
    else:
        for coord in coords:
            if coord not in members:
                raise ConfigError(
                    f"coordinator {coord} is not in the CA's register ({pki.REGISTER}): issue its certificate "
                    f"with `fedagent ca issue {coord} --role coordinator` (certificates issued before the "
                    "register existed need issuing again for a broker of several federations)"
                )
            if members[coord][1] not in feds:
                raise ConfigError(
                    f"coordinator {coord} belongs to federation {members[coord][1]}, "
                    f"which this broker does not serve ({', '.join(feds)})"
                )
        for name in sorted(members):
            _role, fed = members[name]
            if fed not in feds or name in relays:
                continue
            root = f"{PREFIX}/{fed}"
            lines.append(f"user {name}")
            if name in coords:
                lines.append(f"topic readwrite {root}/#")
            else:
                lines += [
                    f"topic write {root}/node/{name}/#",
                    f"topic read {root}/node/+/presence",
                    f"topic read {root}/node/+/to/{name}/#",
                    f"topic read {root}/global/#",
                ]
            lines.append("")
    for bridge in relays:
        lines.append(f"user {bridge}")
        for fed in feds:
            lines += [f"topic write {PREFIX}/{fed}/node/#", f"topic read {PREFIX}/{fed}/global/#"]
            lines += [f"topic read {PREFIX}/{fed}/node/{c}/to/#" for c in coords]
        lines.append("")
    return "\n".join(lines)


def _conf_path(p: Path | str, what: str) -> str:
    s = str(Path(p).absolute())
    # One setting per line: a newline in a path would inject configuration.
    if "\n" in s or "\r" in s:
        raise ConfigError(f"{what} path contains a line break: {s!r}")
    return s


def render_config(
    *,
    port: int,
    bind: str,
    ca: Path,
    cert: Path,
    key: Path,
    acl: Path,
    persistence_dir: Path | None,
    max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
    log_path: Path | None = None,
    log_dest: str | None = None,
    user: str | None = None,
    persistent_client_expiration: str = "14d",
    autosave_interval: int = 60,
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
    max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
) -> str:
    """The ``mosquitto.conf`` for one mutual-TLS listener.

    ``log_path`` logs to that file; otherwise ``log_dest`` (default ``stderr``).
    ``user`` is the account Mosquitto switches to when started as root (default: the
    current user, so it can read the key it was given). ``persistence_dir`` None
    turns persistence off (sessions and QoS1 queues then die with the broker).
    ``max_queued_bytes``/``max_queued_messages`` bound what Mosquitto queues for one
    client (see :func:`check_queue_limits`).
    """
    if not 0 < port < 65536:
        raise ConfigError(f"invalid broker port {port}")
    if max_packet_size < 1024:
        raise ConfigError(f"max_packet_size {max_packet_size} is too small")
    check_queue_limits(max_queued_bytes, max_queued_messages, max_packet_size)
    if user is None:
        user = pwd.getpwuid(os.getuid()).pw_name
    lines = [
        "# fedagent broker configuration, generated by fedagent.broker.render_config.",
        "per_listener_settings false",
        # Certificates are the only credential: a client without one fails the TLS
        # handshake, and nothing may connect without a username (= certificate CN).
        "allow_anonymous false",
        f"acl_file {_conf_path(acl, 'ACL')}",
        # Large models are chunked below this by the agents; a bigger packet is refused
        # (the limit is announced in CONNACK so clients can refuse it first).
        f"max_packet_size {int(max_packet_size)}",
        f"persistent_client_expiration {persistent_client_expiration}",
        "set_tcp_nodelay true",
        # What waits for one client beyond its in-flight window: the coordinator's backlog
        # of a round's updates (the sizing rule is in docs/operators.md), small control
        # messages for an absent agent. Past either limit Mosquitto drops what would be
        # queued. Mosquitto's default of 1000 messages would be overflowed by a
        # coordinator of more than ~1000 agents in one round (updates, presence).
        f"max_queued_messages {int(max_queued_messages)}",
        f"max_queued_bytes {int(max_queued_bytes)}",
        f"user {user}",
    ]
    if persistence_dir is not None:
        loc = _conf_path(persistence_dir, "persistence")
        lines += [
            # QoS1 messages queued for offline persistent sessions survive a restart.
            "persistence true",
            f"persistence_location {loc.rstrip('/')}/",
            "persistence_file mosquitto.db",
            f"autosave_interval {int(autosave_interval)}",
        ]
    else:
        lines.append("persistence false")
    if log_path is not None:
        lines.append(f"log_dest file {_conf_path(log_path, 'log')}")
    else:
        lines.append(f"log_dest {log_dest or 'stderr'}")
    lines += [
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
        "connection_messages true",
        "log_timestamp true",
        "log_timestamp_format %Y-%m-%dT%H:%M:%S",
        "",
        f"listener {int(port)} {bind}",
        "protocol mqtt",
        f"cafile {_conf_path(ca, 'CA')}",
        f"certfile {_conf_path(cert, 'certificate')}",
        f"keyfile {_conf_path(key, 'key')}",
        "require_certificate true",
        "use_identity_as_username true",
        # The client id is the certificate's CN too: no certificate can connect under
        # another node's id and take over (disconnect) its connection or session.
        "use_username_as_clientid true",
        # Minimum version: TLS 1.2 and 1.3 are accepted.
        "tls_version tlsv1.2",
        "",
    ]
    return "\n".join(lines)


def check_queue_limits(max_queued_bytes: int, max_queued_messages: int, max_packet_size: int) -> None:
    """Refuse queue limits Mosquitto would read as "no limit" (0) or that could not hold
    one message of the largest size the broker accepts."""
    if int(max_queued_messages) < 1:
        raise ConfigError(f"max_queued_messages must be at least 1, not {max_queued_messages}")
    if int(max_queued_bytes) < int(max_packet_size):
        raise ConfigError(
            f"max_queued_bytes {max_queued_bytes} is below max_packet_size {max_packet_size}: "
            "not even one chunk of a model could wait for a client"
        )


def free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def _terminate(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class EmbeddedBroker:
    """A private Mosquitto that fedagent starts, owns and stops.

    Everything lives in ``workdir``: ``mosquitto.conf``, ``acl``, the broker's
    certificate (issued from the CA in ``ca_dir`` when absent or unusable),
    ``data/`` (persistence) and ``mosquitto.log``. ``port=None`` picks a free port
    once; :meth:`restart` keeps it.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        federations: Sequence[str],
        coordinators: Sequence[str],
        ca_dir: Path,
        port: int | None = None,
        bind: str = "127.0.0.1",
        max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
        name: str = "broker",
        sans: Sequence[str] = (),
        binary: str | None = None,
        start_timeout: float = 10.0,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
    ) -> None:
        self.workdir = Path(workdir).absolute()
        self.federations = _unique(federations, "federation")
        self.coordinators = _unique(coordinators, "coordinator id")
        self.ca_dir = Path(ca_dir).absolute()
        self.bind = bind
        self.max_packet_size = int(max_packet_size)
        check_queue_limits(max_queued_bytes, max_queued_messages, self.max_packet_size)
        self.max_queued_bytes = int(max_queued_bytes)
        self.max_queued_messages = int(max_queued_messages)
        self.name = check_name(name, "broker name")
        self.sans = list(sans) or [
            *pki.DEFAULT_BROKER_SANS,
            *([bind] if bind not in ("0.0.0.0", "::", "127.0.0.1") else []),
        ]
        self.binary = binary or find_mosquitto()
        self.start_timeout = start_timeout
        self._port = port
        self._port_fixed = port is not None
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: BinaryIO | None = None
        self._finalizer: weakref.finalize | None = None

    # --- paths and addresses ---------------------------------------------------------
    @property
    def ca(self) -> Path:
        return self.ca_dir / pki.CA_CERT

    @property
    def cert(self) -> Path:
        return self.workdir / "tls" / f"{self.name}.crt"

    @property
    def key(self) -> Path:
        return self.workdir / "tls" / f"{self.name}.key"

    @property
    def conf_path(self) -> Path:
        return self.workdir / "mosquitto.conf"

    @property
    def acl_path(self) -> Path:
        return self.workdir / "acl"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    @property
    def persistence_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def host(self) -> str:
        return "127.0.0.1" if self.bind in ("0.0.0.0", "::", "") else self.bind

    @property
    def port(self) -> int:
        if self._port is None:
            self._port = free_port(self.host)
        return self._port

    @property
    def uri(self) -> str:
        return f"mqtts://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        proc = self._live()
        return proc.pid if proc is not None else None

    @property
    def running(self) -> bool:
        return self._live() is not None

    def _live(self) -> subprocess.Popen[bytes] | None:
        """The Mosquitto process if it is still running."""
        return self._proc if self._proc is not None and self._proc.poll() is None else None

    # --- files -----------------------------------------------------------------------
    def _ensure_certificate(self) -> None:
        try:
            pki.check_certificate(self.cert, self.key, self.ca)
        except ConfigError:
            pki.issue(self.ca_dir, self.cert.parent, self.name, "broker", sans=self.sans, default_sans=False)

    def write_files(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.persistence_dir.mkdir(exist_ok=True)
        self._ensure_certificate()
        self.acl_path.write_text(self._acl())
        self.conf_path.write_text(
            render_config(
                port=self.port,
                bind=self.bind,
                ca=self.ca,
                cert=self.cert,
                key=self.key,
                acl=self.acl_path,
                persistence_dir=self.persistence_dir,
                max_packet_size=self.max_packet_size,
                log_path=self.log_path,
                max_queued_bytes=self.max_queued_bytes,
                max_queued_messages=self.max_queued_messages,
            )
        )

    def _acl(self) -> str:
        members = acl_members(self.ca_dir, self.federations)
        return render_acl(self.federations, self.coordinators, members=members)

    def log_tail(self, lines: int = 20) -> str:
        chunks = []
        for p in (self.workdir / "mosquitto.out", self.log_path):
            try:
                text = p.read_text(errors="replace").splitlines()[-lines:]
            except FileNotFoundError:
                continue
            if text:
                chunks.append("\n".join(text))
        return "\n".join(chunks) or "(mosquitto wrote no log)"

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Start Mosquitto and return once it completes TLS handshakes on its port."""
        if self.running:
            return
        for attempt in range(3):
            self.write_files()
            try:
                self._spawn_and_wait()
                return
            except TransportError:
                # Another process may have taken the port we picked between our probe
                # and Mosquitto's bind; with a port we chose ourselves, pick again.
                if self._port_fixed or attempt == 2 or "in use" not in self.log_tail(5):
                    raise
                self._port = None

    def _spawn_and_wait(self) -> None:
        self._out = open(self.workdir / "mosquitto.out", "ab")
        # A stop signal waits until the process is recorded, where stop() finds it.
        with child_starting():
            self._proc = subprocess.Popen(
                [self.binary, "-c", str(self.conf_path)],
                stdin=subprocess.DEVNULL,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                close_fds=True,
                env={**BROKER_MALLOC_ENV, **os.environ},
            )
            # Never leave a broker behind, even if the owner forgets stop().
            self._finalizer = weakref.finalize(self, _terminate, self._proc, 2.0)
        deadline = time.monotonic() + self.start_timeout
        last: Exception | None = None
        while True:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._cleanup()
                raise TransportError(
                    f"mosquitto exited with code {code} on start-up (config {self.conf_path}):\n{self.log_tail()}"
                )
            try:
                self._probe()
                return
            except OSError as exc:  # ssl.SSLError is an OSError
                last = exc
            if time.monotonic() > deadline:
                self.stop()
                raise TransportError(
                    f"mosquitto did not accept TLS connections on {self.host}:{self.port} "
                    f"within {self.start_timeout:.0f}s ({last}):\n{self.log_tail()}"
                )
            try:
                self._proc.wait(0.02)  # poll interval that also notices a crash
            except subprocess.TimeoutExpired:
                pass

    def _probe(self) -> None:
        """One TLS handshake and MQTT CONNECT/CONNACK with the broker, as the broker's
        own identity: proves the listener, the certificates and the MQTT layer work."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        ctx.check_hostname = False  # readiness only; clients check the SANs
        with socket.create_connection((self.host, self.port), timeout=1.0) as raw:
            with ctx.wrap_socket(raw, server_hostname=self.host) as tls:
                tls.sendall(MQTT5_PROBE_CONNECT)
                connack = tls.recv(64)
                if len(connack) < 4 or connack[0] != 0x20:
                    raise ConnectionError(f"unexpected answer to CONNECT: {connack[:8].hex()}")
                tls.sendall(MQTT5_DISCONNECT)

    def _cleanup(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self._out is not None:
            self._out.close()
            self._out = None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (Mosquitto saves its persistence file), SIGKILL after ``timeout``."""
        if self._proc is not None:
            _terminate(self._proc, timeout)
        self._cleanup()

    def kill(self) -> None:
        """SIGKILL, for crash tests: nothing is saved."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
        self._cleanup()

    def restart(self, timeout: float = 5.0) -> None:
        """Stop and start again on the same port with the same persistence."""
        self._port_fixed = True
        self.stop(timeout)
        self.start()

    def reload_acl(
        self, federations: Sequence[str] | None = None, coordinators: Sequence[str] | None = None, timeout: float = 5.0
    ) -> None:
        """Rewrite the ACL (with new lists if given, and the CA register as it is now) and
        make Mosquitto reload it (SIGHUP): how a certificate issued later gets its rules
        on a broker of several federations."""
        if federations is not None:
            self.federations = _unique(federations, "federation")
        if coordinators is not None:
            self.coordinators = _unique(coordinators, "coordinator id")
        self.acl_path.write_text(self._acl())
        proc = self._live()
        if proc is None:
            return
        marker = "Reloading config"
        before = self._log_text().count(marker)
        os.kill(proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while self._log_text().count(marker) <= before:
            if time.monotonic() > deadline or not self.running:
                raise TransportError(f"mosquitto did not reload its ACL:\n{self.log_tail()}")
            try:
                proc.wait(0.02)
            except subprocess.TimeoutExpired:
                pass

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<EmbeddedBroker {self.uri} {state}>"


def write_site_config(
    out: Path,
    *,
    ca_dir: Path,
    broker_name: str,
    federations: Sequence[str],
    coordinators: Sequence[str],
    port: int = DEFAULT_PORT,
    bind: str = "127.0.0.1",
    max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
    trusted_bridges: Sequence[str] = (),
    bridge_to: str | None = None,
    bridge_name: str | None = None,
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
    max_queued_messages: int = DEFAULT_MAX_QUEUED_MESSAGES,
) -> Path:
    """Write ``mosquitto.conf`` and ``acl`` for a site broker into ``out``.

    The broker certificate ``<broker_name>.crt``/``.key`` must already be issued in
    ``ca_dir`` (``fedagent ca issue NAME --role broker --san HOST``). Returns the
    config path; run it with ``mosquitto -c PATH``.

    A central broker lists the bridge identities of its sites in ``trusted_bridges``
    (they may relay nodes' traffic up and read the coordinators' messages, not
    broadcast);
    a site broker names the central one in ``bridge_to`` (``HOST:PORT``) and its own
    bridge identity in ``bridge_name`` (certificate ``<bridge_name>.crt`` in ca_dir).
    """
    ca_dir, out = Path(ca_dir), Path(out)
    cert, key, ca = ca_dir / f"{broker_name}.crt", ca_dir / f"{broker_name}.key", ca_dir / "ca.crt"
    if not cert.exists() or not key.exists():
        raise ConfigError(
            f"no broker certificate {cert}; issue one with "
            f"`fedagent ca issue {broker_name} --role broker --san HOSTNAME --dir {ca_dir}`"
        )
    pki.check_certificate(cert, key, ca)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(exist_ok=True)
    acl = out / "acl"
    acl.write_text(
        render_acl(federations, coordinators, members=acl_members(ca_dir, federations), bridges=trusted_bridges)
    )
    conf = out / "mosquitto.conf"
    conf.write_text(
        render_config(
            port=port,
            bind=bind,
            ca=ca.resolve(),
            cert=cert.resolve(),
            key=key.resolve(),
            acl=acl.resolve(),
            persistence_dir=(out / "data").resolve(),
            max_packet_size=max_packet_size,
            max_queued_bytes=max_queued_bytes,
            max_queued_messages=max_queued_messages,
        )
    )
    if bridge_to:
        if not bridge_name:
            raise ConfigError("a bridge needs a name: the CN of its certificate (--bridge-name)")
        host, _, port_s = bridge_to.rpartition(":")
        if not host or not port_s.isdigit():
            raise ConfigError(f"--bridge-to must be HOST:PORT, not {bridge_to!r}")
        bcert, bkey = ca_dir / f"{bridge_name}.crt", ca_dir / f"{bridge_name}.key"
        pki.check_certificate(bcert, bkey, ca)
        with conf.open("a") as f:
            f.write(
                render_bridge(
                    name=bridge_name,
                    remote_host=host,
                    remote_port=int(port_s),
                    federations=federations,
                    ca=ca.resolve(),
                    cert=bcert.resolve(),
                    key=bkey.resolve(),
                    coordinators=coordinators,
                )
            )
    return conf


def render_bridge(
    *,
    name: str,
    remote_host: str,
    remote_port: int,
    federations: Sequence[str],
    ca: Path,
    cert: Path,
    key: Path,
    coordinators: Sequence[str] = (),
) -> str:
    """Config lines that bridge a site broker to a central one, QoS 1.

    Each direction carries only what it should: up (``out``) the nodes' subtrees of
    each federation (the site's agents' updates, presence and Last Wills), down
    (``in``) only ``global/`` (the coordinators' round starts, models and results) and
    what the ``coordinators`` address to a node (``node/<coordinator>/to/…``: the
    current model for an agent that asks for it). Whatever else the hub has (another
    site's traffic, anything a compromised hub publishes under another node's
    subtree) never reaches the site, where messages arriving over a bridge bypass the
    site's ACL. The bridge logs in to the central broker with its own certificate
    (``name`` = its CN), which the central ACL lists as a bridge (``render_acl(...,
    bridges=[name])``): it may write nodes' subtrees and read what it carries down,
    and may not broadcast. The session is persistent (``cleansession false``) so QoS 1
    messages queued while the site link is down are delivered when it comes back;
    ``try_private`` lets two Mosquittos recognise each other's bridge and avoid loops.
    """
    check_name(name, "bridge name")
    lines = [
        "",
        "# bridge to the central broker, generated by fedagent.broker.render_bridge",
        f"connection {name}",
        f"address {remote_host}:{int(remote_port)}",
        "bridge_protocol_version mqttv311",
        "try_private true",
        "cleansession false",
        "notifications false",
        f"remote_clientid {name}",
        f"local_clientid {name}-local",
        "restart_timeout 1 10",
        "keepalive_interval 10",
        f"bridge_cafile {_conf_path(ca, 'CA')}",
        f"bridge_certfile {_conf_path(cert, 'certificate')}",
        f"bridge_keyfile {_conf_path(key, 'key')}",
        "bridge_insecure false",
    ]
    coords = _unique(coordinators, "coordinator id")
    for fed in _unique(federations, "federation"):
        lines += [f"topic {PREFIX}/{fed}/node/# out 1", f"topic {PREFIX}/{fed}/global/# in 1"]
        lines += [f"topic {PREFIX}/{fed}/node/{c}/to/# in 1" for c in coords]
    return "\n".join(lines) + "\n"
