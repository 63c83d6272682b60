"""A loopback link that can be cut: a TCP relay in front of the broker for one agent.

The demo and the benchmarks of ``mode = "async"`` put one in front of each agent that
drives out of coverage: the agent connects to the relay's port, the relay forwards to
the broker. :meth:`Link.cut` closes the agent's connections and stops listening (a
reconnection is refused, as by a host that is not there); :meth:`Link.heal` listens
again on the same port. The agent's process runs on: it sees its broker connection
drop and come back, nothing else (network namespaces do the same with a real
interface, but need root). TLS passes through untouched.
"""

from __future__ import annotations

import socket
import threading

CHUNK = 1 << 16


class Link:
    """Listens on 127.0.0.1 (:attr:`port`, chosen free) and forwards to 127.0.0.1:``target``."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._server: socket.socket | None = None
        self.port = 0
        self.cuts = 0
        self._closed = False
        self._listen()

    @property
    def up(self) -> bool:
        return self._server is not None

    def _listen(self) -> None:
        server = socket.create_server(("127.0.0.1", self.port))
        self.port = server.getsockname()[1]
        self._server = server
        threading.Thread(target=self._accept, args=(server,), name=f"link-{self.port}", daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._server is not server:  # cut meanwhile
                    client.close()
                    upstream.close()
                    continue
                self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                try:
                    s.shutdown(how)
                except OSError:
                    pass

    def cut(self) -> None:
        """The agent is out of coverage: its connections drop, new ones are refused."""
        with self._lock:
            server, self._server = self._server, None
            socks, self._socks = self._socks, []
        if server is None:
            return
        self.cuts += 1
        _close(server)
        for s in socks:
            _close(s)

    def heal(self) -> None:
        """Back in coverage: the same port listens again."""
        with self._lock:
            if self._server is not None or self._closed:
                return
        self._listen()

    def close(self) -> None:
        self._closed = True
        self.cut()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
