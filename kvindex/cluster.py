"""Redis Cluster: the client kvroute uses for ``redis+cluster://`` URLs.

redis-py's cluster client follows MOVED and ASK redirections, refreshes its slot map after a
failover and retries on a dropped connection. It routes EVAL and EVALSHA by their declared keys
without asking the server, but asks the server (COMMAND GETKEYS: one more round trip per call)
for the read-only variants EVALSHA_RO and EVAL_RO; :class:`ClusterClient` routes those by their
keys too. Read-only commands go to replicas when the client reads from replicas.
"""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import LoadBalancingStrategy

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
DEFAULT_PORT = 6379

RedisClient: TypeAlias = Redis | RedisCluster


SCRIPT_COMMANDS = frozenset({"EVALSHA", "EVALSHA_RO", "EVAL", "EVAL_RO"})


class ClusterClient(RedisCluster):
    """RedisCluster that routes kvroute's script calls by their first key.

    Every kvroute script declares keys of one slot (kvindex.keys), so the first key names it:
    redis-py would hash every key (a match declares one per block: ~1 ms of Python for 512) and
    asks the server where EVALSHA_RO / EVAL_RO go. A script whose keys did span slots is refused
    by the server (CROSSSLOT), not sent anywhere wrong."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        if command.upper() in SCRIPT_COMMANDS:
            if len(args) > 2 and int(args[1]) > 0:
                return int(self.keyslot(args[2]))
            command = "EVALSHA"  # no keys: any node (redis-py picks a slot at random)
        return await super()._determine_slot(command, *args)


def is_cluster(client: object) -> bool:
    return isinstance(client, RedisCluster)


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in CLUSTER_SCHEMES


def startup_nodes(url: str) -> list[tuple[str, int]]:
    """The HOST:PORT list of a ``redis+cluster://[user[:password]@]HOST:PORT[,HOST:PORT...]`` URL."""
    netloc = urlsplit(url).netloc.rpartition("@")[2]
    nodes = []
    for part in netloc.split(","):
        host, _, port = part.strip().rpartition(":")
        if not host:
            host, port = port, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"a cluster URL lists HOST:PORT nodes separated by commas, got {part.strip()!r}")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ValueError("a cluster URL needs at least one HOST:PORT")
    return nodes


def cluster_options(url: str, options: dict[str, Any]) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The startup nodes of a cluster URL, and ``options`` with the URL's credentials (unless
    ``options`` give them) and TLS: what the asyncio and the blocking cluster clients both take."""
    parts = urlsplit(url)
    options = dict(options)
    if parts.username and "username" not in options:
        options["username"] = parts.username
    if parts.password and "password" not in options:
        options["password"] = parts.password
    if parts.scheme.lower().startswith("rediss"):
        options["ssl"] = True
    return startup_nodes(url), options


def cluster_client(url: str, read_from_replicas: bool = False, **options: Any) -> ClusterClient:
    """A cluster client for ``url`` (credentials from the URL unless ``options`` give them).
    ``read_from_replicas``: read-only commands (the index's match, liveness and load reads) go
    to the replicas of the shard, round robin, and to its master only when it has none."""
    nodes, options = cluster_options(url, options)
    strategy = LoadBalancingStrategy.ROUND_ROBIN_REPLICAS if read_from_replicas else None
    return ClusterClient(
        startup_nodes=[ClusterNode(host, port) for host, port in nodes], load_balancing_strategy=strategy, **options
    )
