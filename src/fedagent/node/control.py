"""The local control socket that ``fedagent status`` and ``join`` talk to.

Newline-delimited JSON over a Unix stream socket: a request
``{"cmd": ..., "args": {...}}`` gets ``{"ok": true, "result": {...}}`` or
``{"ok": false, "error": "..."}``. The socket is mode 0660 in the runtime
directory: local administration only, never the network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from fedagent.errors import ConfigError, FedagentError, TransportError

log = logging.getLogger(__name__)
MAX_LINE = 1 << 20  # one request line (a search may carry a whole document as its query)
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def _alive(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


class ControlServer:
    def __init__(self, path: Path, handlers: Mapping[str, Handler]) -> None:
        self.path = Path(path)
        self.handlers = dict(handlers)
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        if self.path.exists() or self.path.is_socket():
            if _alive(self.path):
                raise ConfigError(f"another daemon already answers on {self.path}")
            self.path.unlink()
        if len(str(self.path).encode()) > 107:
            raise ConfigError(f"control socket path {self.path} is too long for a Unix socket (max 107 bytes)")
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=MAX_LINE)
        os.chmod(self.path, 0o660)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    await self._reply(writer, {"ok": False, "error": f"request longer than {MAX_LINE} bytes"})
                    return
                if not line:
                    return
                await self._reply(writer, await self._handle(line))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _handle(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            cmd, args = req["cmd"], req.get("args") or {}
            if not isinstance(cmd, str) or not isinstance(args, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return {"ok": False, "error": 'malformed request; expected {"cmd": str, "args": {...}}'}
        handler = self.handlers.get(cmd)
        if handler is None:
            return {"ok": False, "error": f"unknown command {cmd!r}; known: {sorted(self.handlers)}"}
        try:
            return {"ok": True, "result": await handler(args)}
        except FedagentError as exc:
            return {"ok": False, "error": str(exc)}
        except Exception as exc:
            log.exception("control command %s failed", cmd)
            return {"ok": False, "error": f"internal error: {type(exc).__name__}: {exc}"}

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
        writer.write(json.dumps(obj, default=str).encode() + b"\n")
        await writer.drain()


def _no_daemon(path: Path, exc: OSError) -> TransportError:
    return TransportError(
        f"no daemon is running at {path} ({exc.strerror or exc}); start one with "
        "`fedagent agent --config FILE` (or `systemctl start fedagent-agent`)"
    )


def _parse(path: Path, raw: bytes) -> dict[str, Any]:
    if not raw:
        raise TransportError(f"the daemon at {path} closed the connection without answering")
    resp = json.loads(raw)
    if not resp.get("ok"):
        raise FedagentError(resp.get("error", "unknown error"))
    return resp.get("result") or {}


def request(path: Path, cmd: str, args: dict | None = None, timeout: float = 5.0) -> dict[str, Any]:
    path = Path(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        try:
            s.connect(str(path))
        except OSError as exc:
            raise _no_daemon(path, exc) from None
        try:
            s.sendall(json.dumps({"cmd": cmd, "args": args or {}}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError:
            raise TransportError(f"the daemon at {path} did not answer within {timeout}s") from None
        except OSError as exc:
            raise TransportError(f"lost the daemon at {path}: {exc}") from None
    return _parse(path, buf)


async def arequest(path: Path, cmd: str, args: dict | None = None, timeout: float = 5.0) -> dict[str, Any]:
    path = Path(path)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path), limit=2**24), timeout)
    except OSError as exc:
        raise _no_daemon(path, exc) from None
    try:
        writer.write(json.dumps({"cmd": cmd, "args": args or {}}).encode() + b"\n")
        await writer.drain()
        raw = await asyncio.wait_for(reader.readline(), timeout)
    finally:
        writer.close()
    return _parse(path, raw)
