"""``kvroute bench index --cluster`` (or a ``redis+cluster://`` URL): the index on Redis Cluster.

Loads a fleet whose conversations start with one of ``--roots`` system prompts of
``--shared-blocks`` blocks (each segment of a chain lives in the bucket of its first block:
docs/index-schema.md), then reports per master: memory, keys, (block, worker) entries and the
write scripts' CPU; match latency by prompt length; and
matches/s of ``--concurrency`` concurrent clients for ``--seconds``, for prompts spread over every
root and for a hot root (every prompt starts with the same system prompt: its first pages' buckets).
With ``--read-from-replicas`` every match figure is measured twice on the same data: reads on the
masters, then reads on the replicas. Redis CPU per match is the EVALSHA_RO time (page_match.lua
and alive_since.lua) summed over every node from INFO commandstats, divided by the matches.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from redis.asyncio.cluster import RedisCluster

from kvindex import calls as lua
from kvindex.keys import KeySchema, bucket_of
from kvindex.pages import pages_of
from kvindex.redis_index import RedisIndex
from kvindex.settings import RedisSettings
from kvindex.types import StoredRun, WorkerInfo
from kvroute.bench.cluster_nodes import Nodes, per, read_script_usage, replicas_caught_up, traffic
from kvroute.bench.common import percentile, write_json
from kvroute.devstack.embedded_cluster import LocalCluster
from kvroute.devstack.embedded_redis import usable_redis_url
from kvservice.lifecycle import StartupError

MAX_CHAIN = 2048
THROUGHPUT_BLOCKS = 512
LOADERS = 16  # conversations stored concurrently (each worker's handle serialises its own)


@dataclass
class SpreadFleet:
    model: str
    workers: int
    roots: list[list[int]]
    conversations: int
    seed: int
    entries_per_bucket: Counter[int] = field(default_factory=Counter)
    write_usec_per_master: dict[str, int] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)  # the load's rate, and per entry: bytes, apply CPU

    def chain(self, conversation: int) -> list[int]:
        """The conversation's chain, regenerated (10M entries' chains would not fit the process)."""
        rng = random.Random(self.seed * 1_000_003 + conversation)
        root = self.roots[conversation % len(self.roots)]
        return root + [rng.getrandbits(64) for _ in range(MAX_CHAIN - len(root))]


async def cluster_client(url: str, replicas: bool) -> RedisCluster:
    """A cluster client that knows the nodes already (get_nodes() is empty until it does)."""
    client = RedisSettings.from_env(url=url, read_from_replicas=replicas).client(max_connections=256)
    assert isinstance(client, RedisCluster)
    await client.initialize()
    return client


async def load_spread_fleet(
    client: RedisCluster, nodes: Nodes, model: str, workers: int, entries: int, roots: int, shared: int
) -> SpreadFleet:
    """Conversations of up to MAX_CHAIN blocks, each under one of ``roots`` system prompts of
    ``shared`` blocks, held by a primary worker to a random depth and half the time by a second
    worker to a shorter one, stored from the root (a worker that already holds the system prompt
    adds only the tail)."""
    rng = random.Random(7)
    index = RedisIndex(client)
    for w in range(workers):
        await index.register(WorkerInfo(f"w{w}", model, f"http://10.0.{w // 250}.{w % 250}:8000", 32), 3_600_000)
    fleet = SpreadFleet(model, workers, [[rng.getrandbits(64) for _ in range(shared)] for _ in range(roots)], 0, 7)
    loaded = 0

    async def loader() -> None:
        nonlocal loaded
        while loaded < entries:
            conversation = fleet.conversations
            fleet.conversations += 1
            chain = fleet.chain(conversation)
            pick = random.Random(conversation)
            holders = [(pick.randrange(workers), pick.randint(MAX_CHAIN // 8, MAX_CHAIN))]
            if pick.random() < 0.5:
                holders.append((pick.randrange(workers), pick.randint(shared + 1, holders[0][1])))
            for worker, depth in holders:
                result = await index.handle(model, f"w{worker}").store([StoredRun(None, tuple(chain[:depth]))])
                loaded += result.applied
                start = depth - result.applied  # the newly indexed blocks: the chain's last ones
                for page in pages_of(chain[:depth]):
                    if page.start + page.length > start:
                        fleet.entries_per_bucket[bucket_of(page.segment)] += (
                            page.start + page.length - max(start, page.start)
                        )

    before = await traffic(nodes)
    await nodes.resetstat()
    started = time.perf_counter()
    await asyncio.gather(*(loader() for _ in range(LOADERS)))
    elapsed = time.perf_counter() - started
    fleet.write_usec_per_master = {
        name: int(info.get("cmdstat_evalsha", {}).get("usec", 0))
        for name, info in (await nodes.info("commandstats", replicas=False)).items()
    }
    fleet.load = {"entries_per_s": loaded / elapsed, **per(await traffic(nodes) - before, loaded)}
    print(f"  stored {loaded:,} entries in {elapsed:.0f} s: {fleet.load}")
    return fleet


async def shard_table(
    client: RedisCluster, nodes: Nodes, fleet: SpreadFleet, memory_before: dict[str, int]
) -> list[dict]:
    """Per master: used memory (and its growth), keys, entries of the fleet and bytes per entry."""
    memory = {name: int(info["used_memory"]) for name, info in (await nodes.info("memory", False)).items()}
    sizes = {name: await nodes.clients[name].dbsize() for name in nodes.masters}
    keys = KeySchema().for_model(fleet.model)
    entries: Counter[str] = Counter()
    for bucket, count in fleet.entries_per_bucket.items():
        node = client.nodes_manager.get_node_from_slot(client.keyslot(keys.bucket(bucket).segment(0)))
        entries[node.name] += count
    rows = []
    for name in sorted(memory):
        grown = memory[name] - memory_before.get(name, 0)
        rows.append(
            {
                "master": name,
                "used_memory": memory[name],
                "grown_bytes": grown,
                "keys": int(sizes[name]),
                "entries": entries[name],
                "write_usec": fleet.write_usec_per_master.get(name, 0),
                "bytes_per_entry": grown / entries[name] if entries[name] else float("nan"),
            }
        )
    return rows


async def alive_us_per_call(client: RedisCluster, nodes: Nodes, model: str, calls: int) -> dict[str, float]:
    """Redis CPU of the liveness read every match makes on the model's control shard: alive.lua
    (the whole set, as before alive versions) and alive_since.lua confirming a reader's copy."""
    index = RedisIndex(client)
    whole = lua.alive(index.keys(model).alive)
    await index.match_result(model, [], [await index.scripts.call(index.alive_call(model))])  # a copy to confirm
    await nodes.resetstat()
    for _ in range(calls):
        await index.scripts.call(whole)
    whole_us = sum(u for _, u in (await read_script_usage(nodes)).values()) / calls
    await nodes.resetstat()
    for _ in range(calls):
        await index.match_result(model, [], [await index.scripts.call(index.alive_call(model))])
    confirmed_us = sum(u for _, u in (await read_script_usage(nodes)).values()) / calls
    return {"whole_us_per_call": whole_us, "confirmed_us_per_call": confirmed_us}


async def time_matches(
    client: RedisCluster, nodes: Nodes, model: str, chains: list[list[int]]
) -> tuple[float, float, float, dict[str, float]]:
    """p50 and p99 client latency (ms), Redis CPU per match (us, all nodes), bytes per match and
    this process's CPU per match (``client_cpu_us``: ``time.process_time()`` around the matches, one
    at a time: what a router's ``RedisIndex.match`` costs its own process, keys, calls, the event
    loop and the sockets included)."""
    index = RedisIndex(client)
    for chain in chains[:8]:  # load the scripts on every node involved, warm the gid name cache
        await index.match(model, chain)
    await nodes.resetstat()
    before = await traffic(nodes)
    samples = []
    cpu_started = time.process_time()
    for chain in chains:
        start = time.perf_counter()
        await index.match(model, chain)
        samples.append((time.perf_counter() - start) * 1000)
    client_cpu_us = (time.process_time() - cpu_started) * 1e6 / len(chains)
    network = {**per(await traffic(nodes) - before, len(chains)), "client_cpu_us": client_cpu_us}
    usec = sum(u for _, u in (await read_script_usage(nodes)).values())
    return statistics.median(samples), percentile(samples, 0.99), usec / len(chains), network


async def measure_throughput(
    client: RedisCluster, nodes: Nodes, model: str, chains: list[list[int]], args: argparse.Namespace
) -> dict:
    """Matches/s of ``args.concurrency`` clients for ``args.seconds``; Redis CPU per match and each
    node's share of the read-script calls. Each prompt's keys are built once beforehand (building
    512 keys costs the Python client more than Redis spends on the match): the figure is what the
    servers and redis-py's cluster client sustain, not a router's whole decision."""
    index = RedisIndex(client)
    # The page calls are built once; the alive call is built per match.
    prepared = [(chain, index.match_calls(model, chain)[1:]) for chain in chains]
    for chain, calls in prepared[:8]:
        await index.match_result(model, chain, await index.scripts.call_many([index.alive_call(model), *calls]))
    await nodes.resetstat()
    done = 0
    deadline = time.perf_counter() + args.seconds

    async def reader(offset: int) -> None:
        nonlocal done
        position = offset
        while time.perf_counter() < deadline:
            chain, calls = prepared[position % len(prepared)]
            await index.match_result(model, chain, await index.scripts.call_many([index.alive_call(model), *calls]))
            position += args.concurrency
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(reader(i) for i in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    usage = await read_script_usage(nodes)
    total_calls = sum(c for c, _ in usage.values()) or 1
    return {
        "matches_per_s": done / elapsed,
        "redis_us_per_match": sum(u for _, u in usage.values()) / max(done, 1),
        "node_call_share": {name: round(c / total_calls, 3) for name, (c, _) in sorted(usage.items()) if c},
        "node_cpu_share": {
            name: round(u / (sum(u for _, u in usage.values()) or 1), 3) for name, (_, u) in sorted(usage.items()) if u
        },
        "busiest_node_us_per_s": max(u for _, u in usage.values()) / elapsed,
    }


async def replica_reader(url: str, timeout_s: float = 30.0) -> RedisCluster:
    """A client reading from replicas, once the cluster lists them: CLUSTER SLOTS leaves out a
    replica until its master has seen it replicate, and a client that started without them would
    read from the masters until the topology changes."""
    deadline = time.monotonic() + timeout_s
    while True:
        client = await cluster_client(url, replicas=True)
        if all(len(nodes) > 1 for nodes in client.nodes_manager.slots_cache.values()):
            return client
        await client.aclose()
        if time.monotonic() > deadline:
            raise StartupError("--read-from-replicas: some master has no replica listed in CLUSTER SLOTS")
        await asyncio.sleep(0.2)


async def run_cluster_benchmark(url: str, args: argparse.Namespace) -> dict[str, list]:
    primary = await cluster_client(url, replicas=False)
    nodes = await Nodes.discover(primary, url)
    reads = {"primary": primary}
    rng = random.Random(11)
    results: dict[str, list] = {"shards": [], "match": [], "throughput": [], "alive": [], "load": []}
    for workers in args.workers:
        model = f"bench-cluster-w{workers}"
        before = {n: int(i["used_memory"]) for n, i in (await nodes.info("memory", False)).items()}
        fleet = await load_spread_fleet(primary, nodes, model, workers, args.entries, args.roots, args.shared_blocks)
        shards = await shard_table(primary, nodes, fleet, before)
        results["shards"] += [{"workers": workers, **row} for row in shards]
        results["load"].append({"workers": workers, **fleet.load})
        total = sum(r["entries"] for r in shards)
        print(f"loaded {total:,} entries for {workers} workers under {args.roots} roots ({fleet.conversations} chains)")
        if args.read_from_replicas and "replicas" not in reads:
            reads["replicas"] = await replica_reader(url)
        await replicas_caught_up(nodes)
        alive_cost = await alive_us_per_call(primary, nodes, model, args.queries)
        results["alive"].append({"workers": workers, **alive_cost})
        print(
            f"  liveness alone: whole set {alive_cost['whole_us_per_call']:.1f} us/call,"
            f" a copy confirmed {alive_cost['confirmed_us_per_call']:.1f} us/call"
        )
        for blocks in args.prompt_blocks:
            chains = [fleet.chain(rng.randrange(fleet.conversations))[:blocks] for _ in range(args.queries)]
            for mode, client in reads.items():
                p50, p99, cpu, network = await time_matches(client, nodes, model, chains)
                process_cpu = network.get("master_cpu_us", 0) + network.get("replica_cpu_us", 0)
                client_cpu = network["client_cpu_us"]
                row = MatchRow(
                    blocks, workers, mode, p50, p99, cpu, network["net_in"], network["net_out"], process_cpu, client_cpu
                )
                results["match"].append(asdict(row))
                print(
                    f"  {blocks:5d} blocks, {mode:8s}: p50 {p50:.3f} ms  p99 {p99:.3f} ms  redis {cpu:.1f} us/match"
                    f"  client CPU {client_cpu:.0f} us/match"
                )
        hot = [c for c in range(fleet.conversations) if c % args.roots == 0]
        layouts = {
            "spread roots": [fleet.chain(rng.randrange(fleet.conversations)) for _ in range(256)],
            "hot root": [fleet.chain(rng.choice(hot)) for _ in range(256)],
        }
        for layout, chains in layouts.items():
            chains = [c[:THROUGHPUT_BLOCKS] for c in chains]
            for mode, client in reads.items():
                figures = await measure_throughput(client, nodes, model, chains, args)
                results["throughput"].append({"workers": workers, "layout": layout, "reads": mode, **figures})
                print(
                    f"  {layout}, {mode}: {figures['matches_per_s']:,.0f} matches/s, script CPU by node"
                    f" {figures['node_cpu_share']}"
                )
    for client in reads.values():
        await client.aclose()
    await nodes.aclose()
    results["settings"] = [vars_of(args)]
    return results


@dataclass
class MatchRow:
    prompt_blocks: int
    workers: int
    reads: str
    p50_ms: float
    p99_ms: float
    redis_us_per_match: float
    bytes_in_per_match: float
    bytes_out_per_match: float
    process_cpu_us_per_match: float  # INFO cpu of every node: the scripts plus network and parsing
    client_cpu_us_per_match: float  # this process's CPU per match (a router's share of a lookup)


def vars_of(args: argparse.Namespace) -> dict[str, object]:
    names = (
        "entries", "roots", "shared_blocks", "workers", "prompt_blocks", "queries", "concurrency", "seconds",
        "read_from_replicas",
    )  # fmt: skip
    return {name: getattr(args, name) for name in names}


def render(results: dict[str, list]) -> str:
    lines = [
        "| workers | master | used memory MiB | grown MiB | keys | entries | bytes per entry | write script ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in results["shards"]:
        lines.append(
            f"| {s['workers']} | {s['master']} | {s['used_memory'] / 2**20:.1f} | {s['grown_bytes'] / 2**20:.1f} "
            f"| {s['keys']:,} | {s['entries']:,} | {s['bytes_per_entry']:.1f} | {s.get('write_usec', 0) / 1000:,.0f} |"
        )
    for f in results["load"]:
        lines.append(
            f"\nLoad ({f['workers']} workers): {f['entries_per_s']:,.0f} entries/s; per entry: page_apply.lua "
            f"{f.get('write_usec', 0):.2f} us; CPU of masters {f.get('master_cpu_us', 0):.2f} us and replicas "
            f"{f.get('replica_cpu_us', 0):.2f} us; {f.get('net_in', 0):.0f} B in, "
            f"{f.get('repl_out', 0):.0f} B to replicas"
        )
    lines += [
        "",
        "| prompt blocks | workers | reads | p50 ms | p99 ms | script us/match | CPU us/match | client CPU us/match "
        "| B in | B out |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["match"]:
        lines.append(
            f"| {r['prompt_blocks']} | {r['workers']} | {r['reads']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
            f"| {r['redis_us_per_match']:.1f} | {r['process_cpu_us_per_match']:.1f} "
            f"| {r['client_cpu_us_per_match']:.0f} | {r['bytes_in_per_match']:,.0f} "
            f"| {r['bytes_out_per_match']:,.0f} |"
        )
    lines += ["", "Liveness alone (every match reads it on the model's control shard): "]
    lines[-1] += ", ".join(
        f"at {a['workers']} workers {a['confirmed_us_per_call']:.1f} us/call confirming a copy"
        f" (the whole set {a['whole_us_per_call']:.1f})"
        for a in results["alive"]
    )
    lines += ["", "| workers | layout | reads | matches/s | Redis CPU us/match | busiest node CPU | calls per node |"]
    lines.append("|---|---|---|---|---|---|---|")
    for t in results["throughput"]:
        share = ", ".join(f"{n.rpartition(':')[2]} {s:.0%}" for n, s in t["node_call_share"].items())
        lines.append(
            f"| {t['workers']} | {t['layout']} | {t['reads']} | {t['matches_per_s']:,.0f} "
            f"| {t['redis_us_per_match']:.1f} | {t['busiest_node_us_per_s'] / 1e4:.0f}% | {share} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def cluster_url(args: argparse.Namespace) -> Iterator[str]:
    """The ``--redis-url`` cluster, or a private LocalCluster (3 masters, a replica each)."""
    if args.redis_url:
        yield usable_redis_url(args.redis_url)
        return
    with LocalCluster(masters=3, replicas_per_master=1) as cluster:
        print(f"started a local cluster: masters {cluster.master_ports()}, replicas {cluster.replica_ports()}")
        yield cluster.url


def run_cluster_from_args(args: argparse.Namespace) -> int:
    with cluster_url(args) as url:
        results = asyncio.run(run_cluster_benchmark(url, args))
    print()
    print(render(results))
    if args.json:
        write_json(args.json, results)
    return 0
