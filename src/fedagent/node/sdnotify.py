"""The systemd notification protocol (sd_notify(3)), without a dependency.

One datagram to ``$NOTIFY_SOCKET`` per notification; a leading ``@`` names an
abstract socket. The watchdog pings come from the event loop itself, so a loop that
is stuck stops pinging and systemd restarts the daemon.
"""

from __future__ import annotations

import asyncio
import os
import socket


def notify(*lines: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError:
        return False


def ready(status_text: str = "") -> bool:
    return notify("READY=1", *([f"STATUS={status_text}"] if status_text else []))


def status(text: str) -> bool:
    return notify(f"STATUS={text}")


def stopping() -> bool:
    return notify("STOPPING=1")


def watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1e6 / 2 if value > 0 else None


async def watchdog_loop() -> None:
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval)
