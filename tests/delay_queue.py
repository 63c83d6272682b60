"""Hold every packet of an NFQUEUE for a fixed time, then let it go (the degraded-gossip fault test).

netem is not built into this kernel, so added delay is made in user space: iptables
sends the packets to queue N, this process keeps each one for D milliseconds and
then accepts it. One thread does everything (verdicts are issued from the thread
that reads the queue), ordered by a heap of release times, so order is kept.

Usage (inside the namespace): python delay_queue.py QUEUE_NUM DELAY_MS
"""

from __future__ import annotations

import heapq
import itertools
import select
import signal
import sys
import time

from netfilterqueue import NetfilterQueue


def main() -> None:
    queue_num, delay = int(sys.argv[1]), float(sys.argv[2]) / 1000.0
    held: list = []
    tie = itertools.count()

    def hold(pkt) -> None:
        pkt.retain()
        heapq.heappush(held, (time.monotonic() + delay, next(tie), pkt))

    nfq = NetfilterQueue()
    nfq.bind(queue_num, hold, max_len=20000)
    fd = nfq.get_fd()
    stop = False

    def on_term(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    print(f"holding queue {queue_num} for {delay * 1000:g} ms", flush=True)
    released = 0
    try:
        while not stop:
            wait = max(0.0, held[0][0] - time.monotonic()) if held else 0.5
            readable, _, _ = select.select([fd], [], [], wait)
            if readable:
                nfq.run(block=False)
            now = time.monotonic()
            while held and held[0][0] <= now:
                heapq.heappop(held)[2].accept()
                released += 1
    finally:
        for _, _, pkt in held:
            pkt.accept()
        nfq.unbind()
        print(f"released {released + len(held)} packets", flush=True)


if __name__ == "__main__":
    main()
