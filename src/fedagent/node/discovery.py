"""DNS-SD discovery of federation members with python-zeroconf's async API.

Every node advertises ``_fedagent._tcp.local.`` with a TXT record naming its
federation, id, role, broker URI, certificate fingerprint and protocol version.
Interfaces are always explicit addresses: letting zeroconf pick would join multicast
on every interface of the machine. Records from the network are validated field by
field; a malformed advert is ignored, never an exception.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from fedagent.errors import FedagentError
from fedagent.protocols.topics import is_valid_name

log = logging.getLogger(__name__)

SERVICE_TYPE = "_fedagent._tcp.local."
ROLES = ("agent", "coordinator", "broker")
MAX_FIELD = 255


@dataclass(frozen=True, slots=True)
class Advert:
    federation: str
    node_id: str
    role: str
    broker_uri: str
    fingerprint: str = ""
    protocol: int = 1
    port: int = 0
    addresses: tuple[str, ...] = ()

    @property
    def instance_name(self) -> str:
        return f"{self.node_id}--{self.federation}.{SERVICE_TYPE}"

    def txt(self) -> dict[str, str]:
        return {
            "fed": self.federation,
            "id": self.node_id,
            "role": self.role,
            "broker": self.broker_uri,
            "fp": self.fingerprint,
            "proto": str(self.protocol),
        }


def parse_txt(props: dict[bytes, bytes | None], port: int = 0, addresses: Sequence[str] = ()) -> Advert | None:
    """An Advert from a TXT record, or None when any field is malformed."""
    try:
        d = {k.decode("ascii"): (v or b"").decode("utf-8") for k, v in props.items()}
    except (UnicodeDecodeError, AttributeError):
        return None
    if any(len(v) > MAX_FIELD for v in d.values()):
        return None
    fed, node, role, broker, fp = (d.get(k, "") for k in ("fed", "id", "role", "broker", "fp"))
    if not (is_valid_name(fed) and is_valid_name(node) and role in ROLES):
        return None
    if broker:
        parts = urlsplit(broker)
        if parts.scheme != "mqtts" or not parts.hostname:
            return None
    if fp and not all(c in "0123456789abcdef" for c in fp):
        return None
    try:
        proto = int(d.get("proto", "1"))
    except ValueError:
        return None
    return Advert(
        federation=fed,
        node_id=node,
        role=role,
        broker_uri=broker,
        fingerprint=fp,
        protocol=proto,
        port=port,
        addresses=tuple(addresses),
    )


ChangeCallback = Callable[[str, Advert], None]


def not_found_message(federation: str, roles: Sequence[str], timeout: float, interfaces: Sequence[str]) -> str:
    """What to tell an operator when nothing answered: where mDNS looked and how to look
    elsewhere (mDNS runs only on the addresses it is given and never crosses a router)."""
    where = ", ".join(interfaces)
    hint = "; 127.0.0.1 reaches only this machine" if all(a.startswith("127.") for a in interfaces) else ""
    return (
        f"no {' or '.join(roles)} for federation {federation} answered on mDNS within {timeout:g} s "
        f"(searched on {where}{hint}). Search on this machine's LAN address instead: "
        f"`fedagent join {federation} --interface ADDRESS` (recorded in the config) or "
        '`[discovery] interfaces = ["ADDRESS"]` in the config; across routers, where mDNS '
        f"does not reach, pass `--broker mqtts://HOST:PORT`"
    )


class Discovery:
    def __init__(self, interfaces: Sequence[str] = ("127.0.0.1",), *, on_change: ChangeCallback | None = None) -> None:
        if not interfaces:
            raise FedagentError("mDNS needs at least one interface address")
        self.interfaces = list(interfaces)
        self.on_change = on_change
        self._aiozc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._registered: dict[str, AsyncServiceInfo] = {}
        self._by_name: dict[str, Advert] = {}
        self._federation: str | None = None
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.last_seen: dict[str, float] = {}

    async def __aenter__(self) -> Discovery:
        self._loop = asyncio.get_running_loop()
        self._aiozc = AsyncZeroconf(interfaces=self.interfaces, ip_version=IPVersion.V4Only)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._aiozc is None:
            return
        for info in list(self._registered.values()):
            try:
                await (await self._aiozc.async_unregister_service(info))
            except Exception as e:  # noqa: BLE001 - goodbyes are best effort on exit
                log.debug("goodbye for %s failed: %s", info.name, e)
        self._registered.clear()
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        await self._aiozc.async_close()
        self._aiozc = None

    # -- advertising -------------------------------------------------------------------
    def _info(self, advert: Advert) -> AsyncServiceInfo:
        port = advert.port or (urlsplit(advert.broker_uri).port if advert.broker_uri else 0) or 9
        host = f"{advert.node_id}-{advert.federation}.local."
        return AsyncServiceInfo(
            SERVICE_TYPE,
            advert.instance_name,
            port=port,
            properties=advert.txt(),
            addresses=[socket.inet_aton(a) for a in self.interfaces],
            server=host,
        )

    async def register(self, advert: Advert) -> None:
        assert self._aiozc is not None, "use Discovery as an async context manager"
        if advert.instance_name in self._registered:
            return await self.update(advert)
        info = self._info(advert)
        await (await self._aiozc.async_register_service(info, allow_name_change=True))
        self._registered[advert.instance_name] = info

    async def update(self, advert: Advert) -> None:
        assert self._aiozc is not None
        info = self._info(advert)
        await (await self._aiozc.async_update_service(info))
        self._registered[advert.instance_name] = info

    async def unregister(self, advert: Advert) -> None:
        assert self._aiozc is not None
        info = self._registered.pop(advert.instance_name, None)
        if info is not None:
            await (await self._aiozc.async_unregister_service(info))

    # -- browsing ----------------------------------------------------------------------
    @property
    def peers(self) -> dict[str, Advert]:
        """Adverts of the federation being browsed (all federations if none), by node id."""
        return {
            a.node_id: a for a in self._by_name.values() if self._federation is None or a.federation == self._federation
        }

    def start_browsing(self, federation: str | None = None) -> None:
        self._federation = federation
        if self._browser is None:
            assert self._aiozc is not None
            self._browser = AsyncServiceBrowser(self._aiozc.zeroconf, SERVICE_TYPE, handlers=[self._on_state])

    def _on_state(self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        self._loop.call_soon_threadsafe(self._schedule, name, state_change)

    def _schedule(self, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            advert = self._by_name.pop(name, None)
            if advert is not None:
                self._notify("removed", advert)
            return
        task = asyncio.get_running_loop().create_task(self._resolve(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, name: str) -> None:
        if self._aiozc is None:
            return
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._aiozc.zeroconf, 3000):
            return
        advert = parse_txt(info.properties or {}, info.port or 0, info.parsed_addresses())
        if advert is None:
            log.debug("ignoring malformed advert %s", name)
            return
        old = self._by_name.get(name)
        self._by_name[name] = advert
        self.last_seen[advert.node_id] = time.time()
        if old != advert:
            self._notify("updated" if old else "added", advert)

    def _notify(self, kind: str, advert: Advert) -> None:
        self._changed.set()
        if self.on_change is not None and (self._federation is None or advert.federation == self._federation):
            try:
                self.on_change(kind, advert)
            except Exception:
                log.exception("discovery callback failed")

    async def refresh(self, timeout: float = 2.0) -> dict[str, Advert]:
        """Ask the network again instead of trusting the cache, and return the peers.

        A host whose link went down (or that crashed) never sent a goodbye, so its
        records stay cached for their TTL (75 minutes for TXT); and while our own link
        was down we missed the goodbyes and announcements of others. One refresh makes
        the table match who answers now: every known peer's records are dropped from the
        cache and queried afresh (no answer within ``timeout``: removed), and browsing
        restarts so that services announced meanwhile are found again.
        """
        assert self._aiozc is not None, "use Discovery as an async context manager"
        zc = self._aiozc.zeroconf
        names = list(self._by_name)
        for name in names:
            stale = list(zc.cache.async_entries_with_name(name))
            stale += [
                r
                for r in zc.cache.async_all_by_details(SERVICE_TYPE, 12, 1)  # PTR, IN
                if getattr(r, "alias", None) == name
            ]
            zc.cache.async_remove_records(stale)

        async def still_there(name: str) -> bool:
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            return await info.async_request(zc, int(timeout * 1000))

        answered = await asyncio.gather(*(still_there(n) for n in names))
        for name, ok in zip(names, answered):
            if not ok and name in self._by_name:
                self._notify("removed", self._by_name.pop(name))
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
            self.start_browsing(self._federation)
            # Answers to the new browser's first query arrive within ~120 ms (RFC 6762
            # responders delay 20-120 ms); listen that long, then let resolutions finish.
            await asyncio.sleep(min(1.0, timeout))
        deadline = time.monotonic() + timeout
        while self._tasks and time.monotonic() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - time.monotonic())
        return self.peers

    async def find(self, federation: str, role: str | Sequence[str], timeout: float) -> Advert:
        roles = (role,) if isinstance(role, str) else tuple(role)
        if self._browser is None:
            self.start_browsing(self._federation)
        deadline = time.monotonic() + timeout
        while True:
            for a in self._by_name.values():
                if a.federation == federation and a.role in roles and a.broker_uri:
                    return a
            left = deadline - time.monotonic()
            if left <= 0:
                raise FedagentError(not_found_message(federation, roles, timeout, self.interfaces))
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass
