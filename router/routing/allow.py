"""Which worker URLs the router sends prompts to (``--worker-allow``).

A worker's URL comes from its record in Redis, so whoever can write Redis could register a URL of
their own and receive every prompt. With an allow-list, a worker whose URL host is outside it is
ignored (one warning per worker and URL). Entries: a network or address (``10.0.0.0/8``,
``192.168.1.7``, ``::1``), a host name (``engine-1``) or a domain with a leading dot
(``.vllm.svc.cluster.local``: that name's hosts). Host names are compared as written, never
resolved: a name check that depended on DNS answers would be only as safe as the DNS.
Whatever the list, a URL must be http or https with a host.
"""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

log = logging.getLogger("router.allow")  # the name it always had: log filters rely on it
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class WorkerAllowList:
    def __init__(self, entries: tuple[str, ...] | list[str] = ()) -> None:
        self.networks: list[Network] = []
        self.names: set[str] = set()
        self.domains: list[str] = []
        for entry in (e.strip().lower() for e in entries):
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
                continue
            except ValueError:
                pass
            if entry.startswith("."):
                self.domains.append(entry)
            elif "/" in entry or ":" in entry:
                raise ValueError(f"--worker-allow {entry!r}: not a network, an address or a host name")
            else:
                self.names.add(entry)
        self._warned: set[tuple[str, str]] = set()

    @property
    def open(self) -> bool:
        """No list given: any http(s) URL is routed to."""
        return not (self.networks or self.names or self.domains)

    def permits(self, url: str) -> bool:
        try:
            parts = urlsplit(url)
            host = (parts.hostname or "").lower()
            parts.port  # noqa: B018 - raises on a malformed port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not host or parts.username or parts.password:
            return False
        if self.open:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host in self.names or any(host.endswith(domain) for domain in self.domains)
        return any(address in network for network in self.networks)

    def admits(self, worker_id: str, url: str) -> bool:
        """:meth:`permits`, warning once per worker and URL refused."""
        if self.permits(url):
            return True
        if (worker_id, url) not in self._warned:
            self._warned.add((worker_id, url))
            log.warning(
                "ignoring worker %r: its URL %s is outside --worker-allow (or not a plain http(s) URL)", worker_id, url
            )
        return False
