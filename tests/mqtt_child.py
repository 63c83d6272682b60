"""A real agent-side process for tests that kill or stop one.

Usage: ``python tests/mqtt_child.py '<json>'`` with keys uri, ca, cert, key,
presence (topic), online, will, final (payloads as text), keepalive.
Connects with a Last Will (``will``, retained) and publishes ``online`` retained on
every connect, then prints ``READY`` on stdout. A line ``close`` on stdin makes it
stop cleanly (publishing ``final`` itself) and exit 0; otherwise it runs until killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from fedagent.node.transport import TlsFiles, Transport


async def main(cfg: dict) -> int:
    topic = cfg["presence"]
    transport: Transport

    async def on_connect() -> None:
        await transport.publish(topic, cfg["online"].encode(), retain=True)

    async def ignore(_topic: str, _payload: bytes) -> None:
        return None

    transport = Transport(
        uri=cfg["uri"],
        tls=TlsFiles(Path(cfg["ca"]), Path(cfg["cert"]), Path(cfg["key"])),
        will=(topic, cfg["will"].encode()),
        on_connect=on_connect,
        keepalive=int(cfg.get("keepalive", 10)),
    )
    ready = asyncio.Event()
    runner = asyncio.create_task(transport.run(ignore, ready))
    waiter = asyncio.create_task(ready.wait())
    done, _ = await asyncio.wait({runner, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if runner in done:
        runner.result()
        return 1
    print("READY", flush=True)
    line = await asyncio.to_thread(sys.stdin.readline)
    if line.strip() == "close":
        await transport.close(final=(topic, cfg["final"].encode()))
    runner.cancel()
    try:
        await runner
    except asyncio.CancelledError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(json.loads(sys.argv[1]))))
