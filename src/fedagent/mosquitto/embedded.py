"""A private Mosquitto that fedagent starts and owns: its certificates, configuration
and ACL (from :mod:`fedagent.mosquitto.conf`), a free loopback port, readiness, reloads
and a clean stop."""

from __future__ import annotations

import os
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

from fedagent.errors import ClockBehind, ConfigError, TransportError
from fedagent.mosquitto.conf import (
    DEFAULT_MAX_PACKET_SIZE,
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_MAX_QUEUED_MESSAGES,
    acl_members,
    check_queue_limits,
    render_acl,
    render_config,
    unique_names,
)
from fedagent.protocols.topics import check_name
from fedagent.security import pki
from fedagent.stopsignals import child_starting

#: glibc settings for a Mosquitto fedagent starts (the environment's own win): messages
#: up to 32 MiB come from the broker's heap and freed ones stay there for the next,
#: instead of fresh pages from the system, zeroed by the kernel, for every message it
#: relays. Measured with Sync-Opt (5 agents, 3.1 MB messages, 16 relayed per step): the
#: broker's CPU per step fell from 54-56 ms to 38-39 ms. Mosquitto run as a service can
#: be given the same two variables (docs/deployment.md).
BROKER_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(128 * 2**20)}


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
        self.federations = unique_names(federations, "federation")
        self.coordinators = unique_names(coordinators, "coordinator id")
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
        except (ConfigError, ClockBehind):
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
            self.federations = unique_names(federations, "federation")
        if coordinators is not None:
            self.coordinators = unique_names(coordinators, "coordinator id")
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
