"""A loopback TCP relay that counts the bytes it carries, both ways.

Every benchmark of bytes on the wire puts one in front of the server side (Mosquitto for
fedagent, the gRPC server or the SuperLink for Flower), so all of them are counted the
same way: TCP payload bytes, TLS records included, headers not. It moves data with
``splice(2)`` through a pipe (the bytes never enter Python), so it costs the relayed
processes little CPU; a thread per direction per connection.
"""

from __future__ import annotations

import bisect
import fcntl
import os
import socket
import threading
import time

F_SETPIPE_SZ = 1031
CHUNK = 1 << 20


class Relay:
    """Listens on 127.0.0.1 (a free port: :attr:`port`) and forwards each connection to
    127.0.0.1:``target``. :attr:`up` counts client-to-server bytes, :attr:`down` the rest."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._lock = threading.Lock()
        self.up = 0
        self.down = 0
        self.connections = 0
        # (wall-clock time, bytes carried so far, both ways) after every chunk moved
        self._times: list[float] = []
        self._totals: list[int] = []
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name=f"relay-{self.port}", daemon=True)
        self._acceptor.start()

    @property
    def total(self) -> int:
        with self._lock:
            return self.up + self.down

    def bytes_at(self, when: float) -> int:
        """Bytes carried (both ways) up to wall-clock time ``when``."""
        with self._lock:
            i = bisect.bisect_right(self._times, when)
            return self._totals[i - 1] if i else 0

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self.connections += 1
                self._socks += [client, server]
                for src, dst, up in ((client, server, True), (server, client, False)):
                    t = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                    self._threads.append(t)
                    t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        r, w = os.pipe()
        try:
            try:
                fcntl.fcntl(w, F_SETPIPE_SZ, CHUNK)
            except OSError:
                pass  # the default pipe size works too, in smaller steps
            while True:
                n = os.splice(src.fileno(), w, CHUNK)
                if n == 0:
                    break
                with self._lock:
                    if up:
                        self.up += n
                    else:
                        self.down += n
                    self._times.append(time.time())
                    self._totals.append(self.up + self.down)
                while n:
                    n -= os.splice(r, dst.fileno(), n)
        except OSError:
            pass
        finally:
            os.close(r)
            os.close(w)
            for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                try:
                    s.shutdown(how)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks = list(self._socks)
        try:
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        except OSError:
            pass
        self._server.close()
        self._acceptor.join(timeout=5)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        for s in socks:
            s.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
