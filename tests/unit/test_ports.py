"""Ports for the servers we start: below the range the kernel gives outgoing connections (which
could take one before its server listens), free, and never handed out twice."""

from __future__ import annotations

import socket

from kvroute.devstack.embedded_cluster import BUS_PORT_OFFSET, pick_node_port
from kvroute.devstack.ports import HOST, LOWEST, bindable, ephemeral_floor, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_never_repeated():
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(LOWEST <= port < ephemeral_floor() for port in ports), ports


def test_a_port_being_listened_on_is_not_bindable_and_a_free_one_is():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((HOST, 0))
        listener.listen()
        assert not bindable(listener.getsockname()[1])
    assert bindable(free_port())


def test_a_node_port_and_its_bus_port_are_free_and_kept_from_free_port():
    taken: set[int] = set()
    nodes = [pick_node_port(taken) for _ in range(6)]
    buses = {port + BUS_PORT_OFFSET for port in nodes}
    assert all(port + BUS_PORT_OFFSET < ephemeral_floor() for port in nodes)
    assert not buses & set(nodes)
    drawn = {free_port() for _ in range(300)}
    assert not drawn & (set(nodes) | buses)
