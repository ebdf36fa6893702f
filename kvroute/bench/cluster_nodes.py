"""The nodes of a Redis Cluster under a benchmark: every master's and replica's counters (INFO
cpu, stats, commandstats, memory, replication), read by plain clients of each node, so a replica
is counted even while the cluster client has not listed it yet."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from kvindex.settings import RedisSettings
from kvservice.lifecycle import StartupError

# The reads of a match: its scripts, and the GET that confirms a router's copy of the alive gids
# between scripts (kvindex.alive_cache).
READ_SCRIPTS = ("cmdstat_evalsha_ro", "cmdstat_eval_ro", "cmdstat_get")


@dataclass
class Nodes:
    """A plain client of every node, masters and replicas, from CLUSTER NODES: the counters of
    a replica are read even while the cluster client does not list it yet (see replica_reader)."""

    clients: dict[str, Redis]
    masters: set[str]

    @classmethod
    async def discover(cls, client: RedisCluster, url: str) -> Nodes:
        options = RedisSettings.from_env(url=url).connection_options()
        clients, masters = {}, set()
        for name, node in (await client.cluster_nodes()).items():
            flags = set(str(node["flags"]).split(","))
            if {"fail", "noaddr", "handshake"} & flags:
                continue
            host, _, port = name.rpartition(":")
            clients[name] = Redis(host=host, port=int(port.split("@")[0]), ssl=url.startswith("rediss"), **options)
            if "master" in flags:
                masters.add(name)
        return cls(clients, masters)

    async def info(self, section: str, replicas: bool = True) -> dict[str, dict]:
        """INFO ``section`` of every master (and replica), by node name ``host:port``."""
        names = [n for n in self.clients if replicas or n in self.masters]
        replies = await asyncio.gather(*(self.clients[n].info(section) for n in names))
        return dict(zip(names, replies, strict=True))

    async def resetstat(self) -> None:
        await asyncio.gather(*(c.config_resetstat() for c in self.clients.values()))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients.values()))


async def read_script_usage(nodes: Nodes) -> dict[str, tuple[int, float]]:
    """Per node: (calls, usec) of the read-only scripts since the last CONFIG RESETSTAT."""
    out = {}
    for name, stats in (await nodes.info("commandstats")).items():
        entries = [stats.get(cmd, {}) for cmd in READ_SCRIPTS]
        out[name] = (sum(int(e.get("calls", 0)) for e in entries), sum(float(e.get("usec", 0)) for e in entries))
    return out


async def traffic(nodes: Nodes) -> Counter[str]:
    """Counters summed over every node: bytes in and out (replication apart), the write scripts'
    (EVALSHA: apply.lua...) time on the masters (replicas apply their effects, not scripts), and
    the CPU the processes used (INFO cpu, us) on masters and on replicas apart."""
    totals: Counter[str] = Counter()
    for name, info in (await nodes.info("cpu")).items():
        used_us = 1e6 * (float(info["used_cpu_user"]) + float(info["used_cpu_sys"]))
        totals["master_cpu_us" if name in nodes.masters else "replica_cpu_us"] += int(used_us)
    for info in (await nodes.info("stats")).values():  # INFO's totals count replication too
        totals["net_in"] += int(info["total_net_input_bytes"]) - int(info.get("total_net_repl_input_bytes", 0))
        totals["net_out"] += int(info["total_net_output_bytes"]) - int(info.get("total_net_repl_output_bytes", 0))
        totals["repl_out"] += int(info.get("total_net_repl_output_bytes", 0))
    for info in (await nodes.info("commandstats", replicas=False)).values():
        totals["write_usec"] += int(info.get("cmdstat_evalsha", {}).get("usec", 0))
    return totals


def per(delta: Counter[str], count: int) -> dict[str, float]:
    return {name: value / count for name, value in sorted(delta.items())} if count else {}


async def replicas_caught_up(nodes: Nodes, timeout_s: float = 300.0) -> None:
    """Wait until every replica has applied everything its master has written (the load's
    replication stream would otherwise take CPU from the timed matches)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = await nodes.info("replication", replicas=False)
        behind = [
            name
            for name, info in infos.items()
            for key, slave in info.items()
            if key.startswith("slave") and isinstance(slave, dict) and slave["offset"] < info["master_repl_offset"]
        ]
        if not behind:
            return
        if time.monotonic() > deadline:
            raise StartupError(
                f"replicas of {', '.join(sorted(set(behind)))} did not catch up within {timeout_s:.0f} s"
            )
        await asyncio.sleep(0.2)
