"""CPU of the transport's read path for large messages over TLS, with and without reading
a large packet in place (``transport.patches.READ_IN_PLACE``, ``STEAL_PAYLOAD``).

A server thread sends 11 MQTT PUBLISH packets of 4 MiB (one 44.8 MB model in the
benchmark's chunks) over TLS on a socket pair; a paho client with the transport's read
path reads them. Reported: the reading thread's CPU seconds (``time.thread_time``, so the
sender's encryption is not counted), alternating the two paths.

    python -m bench.tls_read [--rounds 3]
"""

from __future__ import annotations

import argparse
import select
import socket
import ssl
import tempfile
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from fedagent.node.transport import patches
from fedagent.security import pki

CHUNKS, CHUNK = 11, 4 * 2**20


def publish_packet(topic: bytes, payload: bytes) -> bytes:
    """An MQTT 5 PUBLISH, QoS 0, no properties, as on the wire."""
    body = len(topic).to_bytes(2, "big") + topic + b"\x00" + payload
    n, length = len(body), b""
    while True:
        n, byte = divmod(n, 128)
        length += bytes([byte | (0x80 if n else 0)])
        if not n:
            return b"\x30" + length + body


def read_cpu(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, wire: bytes) -> float:
    ours, theirs = socket.socketpair()
    served: dict[str, ssl.SSLSocket] = {}

    def serve() -> None:
        s = served["s"] = server_ctx.wrap_socket(theirs, server_side=True)
        for _ in range(CHUNKS):
            s.sendall(wire)

    sender = threading.Thread(target=serve)
    sender.start()
    sock = client_ctx.wrap_socket(ours, server_hostname="bench")
    sock.setblocking(False)
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTProtocolVersion.MQTTv5)
    patches._bound_reads(client)
    client._sock = sock
    got: list[int] = []
    client.on_message = lambda _c, _u, m: got.append(len(m.payload))
    c0 = time.thread_time()
    while len(got) < CHUNKS:
        if not select.select([sock], [], [], 30)[0]:
            raise RuntimeError(f"stalled after {len(got)} messages")
        try:
            patches.read_available(client)
        except BlockingIOError:
            pass
    cpu = time.thread_time() - c0
    sender.join()
    sock.close()
    served["s"].close()
    if got != [CHUNK] * CHUNKS:
        raise RuntimeError(f"payload sizes {got}")
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pki.create_ca(work / "ca", "bench")
        pki.issue(work / "ca", work / "certs", "bench", "agent")
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(work / "certs" / "bench.crt", work / "certs" / "bench.key")
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE  # a benchmark of reading, not of verification
    wire = publish_packet(b"t/big", bytes(range(256)) * (CHUNK // 256))
    in_place, steal = patches.READ_IN_PLACE, patches.STEAL_PAYLOAD
    for _ in range(args.rounds):
        for name, limits in (("appended + copied", (2**62, 2**62)), ("read in place", (in_place, steal))):
            patches.READ_IN_PLACE, patches.STEAL_PAYLOAD = limits
            cpu = read_cpu(server_ctx, client_ctx, wire)
            print(f"{name:18s} reading thread CPU {cpu * 1e3:6.1f} ms for {CHUNKS} x 4 MiB over TLS")


if __name__ == "__main__":
    main()
