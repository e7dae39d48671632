"""The workers' address and interface, chosen once by the agent; loopback masters refused."""

from __future__ import annotations

import pytest

from meshgate.agent.config import AgentConfig, AgentConfigError
from meshgate.agent.netif import InterfaceError, Route, choose, coordinator_host, interface_addresses
from meshgate.client import ClientConfigError, advertise_host
from meshgate.coordinator.reachability import check_endpoint_reachable, peer_host
from meshgate.coordinator.rendezvous import Code, RendezvousError

TABLE = {"lo": ("127.0.0.1", "::1"), "eth0": ("192.168.1.5",), "ib0": ("10.77.0.2", "fd00::2")}


def _table():
    return TABLE


def _route_via(address):
    calls = []

    def route(host):
        calls.append(host)
        return address

    return route, calls


@pytest.mark.parametrize(
    "spec, host",
    [
        ("10.0.0.1:7443", "10.0.0.1"),
        ("[fd00::1]:7443", "fd00::1"),
        ("head-a:7443,head-b:7443", "head-a"),
        ("coord.example", "coord.example"),
    ],
)
def test_coordinator_host(spec, host):
    assert coordinator_host(spec) == host


def test_route_to_the_coordinator_picks_the_interface_holding_the_source_address():
    route, calls = _route_via("10.77.0.2")
    chosen = choose("10.77.0.1:7443", addresses=_table, route=route)
    assert chosen == Route("10.77.0.2", "ib0", "route to 10.77.0.1")
    assert calls == ["10.77.0.1"]


def test_config_wins_over_the_route():
    route, calls = _route_via("192.168.1.5")
    assert choose("10.77.0.1:7443", interface="ib0", addresses=_table, route=route) == Route(
        "10.77.0.2", "ib0", "config"
    )
    assert choose("10.77.0.1:7443", advertise_address="fd00::2", addresses=_table, route=route) == Route(
        "fd00::2", "ib0", "config"
    )
    assert calls == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(interface="eth9"), "interface 'eth9' does not exist"),
        (dict(advertise_address="10.9.9.9"), "no interface holds address '10.9.9.9'"),
    ],
)
def test_config_that_names_nothing_here_is_refused(kwargs, message):
    with pytest.raises(InterfaceError, match=message):
        choose("10.77.0.1:7443", addresses=_table, **kwargs)


def test_worker_env_leaves_operator_settings_alone():
    route = Route("10.77.0.2", "ib0", "config")
    assert route.worker_env() == {
        "MESHGATE_ADVERTISE_ADDR": "10.77.0.2",
        "GLOO_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_IFNAME": "ib0",
    }
    assert route.worker_env(already_set={"NCCL_SOCKET_IFNAME": "=mlx5_0"}) == {
        "MESHGATE_ADVERTISE_ADDR": "10.77.0.2",
        "GLOO_SOCKET_IFNAME": "ib0",
    }


def test_this_machine_routes_loopback_over_lo():
    """The real kernel seams: 127.0.0.1 is held by the loopback interface."""
    table = interface_addresses()
    loopback = [name for name, held in table.items() if "127.0.0.1" in held]
    assert loopback, table
    assert choose("127.0.0.1:7443") == Route("127.0.0.1", loopback[0], "route to 127.0.0.1")


def test_agent_config_network_keys(tmp_path):
    base = {"coordinator": "10.77.0.1:7443", "job": "j", "insecure": True}
    config = AgentConfig.from_mapping({**base, "advertise_address": "10.77.0.2", "interface": "ib0"}, tmp_path)
    assert (config.advertise_address, config.interface) == ("10.77.0.2", "ib0")
    assert AgentConfig.from_mapping(base, tmp_path).advertise_address == ""
    for bad, message in [
        ({"advertise_address": "host-a"}, "advertise_address must be an IP address"),
        ({"advertise_address": "0.0.0.0"}, "not an address peers can reach"),
        ({"interface": "a/b"}, "interface must be an interface name"),
        ({"interface": 3}, "interface must be an interface name"),
    ]:
        with pytest.raises(AgentConfigError, match=message):
            AgentConfig.from_mapping({**base, **bad}, tmp_path)


# ---- the worker's side and the coordinator's check ------------------------------------------


def test_client_takes_the_agents_address(monkeypatch):
    monkeypatch.setenv("MESHGATE_ADVERTISE_ADDR", "10.77.0.2")
    assert advertise_host("10.77.0.1:7443") == "10.77.0.2"
    assert advertise_host("unix:/run/meshgate/rendezvous.sock") == "10.77.0.2"


def test_client_refuses_a_loopback_master_for_a_remote_coordinator(monkeypatch):
    monkeypatch.setenv("MESHGATE_ADVERTISE_ADDR", "127.0.0.1")
    assert advertise_host("127.0.0.1:7443") == "127.0.0.1"
    with pytest.raises(ClientConfigError, match="loopback address, but the coordinator 10.77.0.1:7443 is remote"):
        advertise_host("10.77.0.1:7443")


@pytest.mark.parametrize(
    "peer, host",
    [("ipv4:10.0.0.2:5123", "10.0.0.2"), ("ipv6:[::1]:5123", "::1"), ("unix:/tmp/s", None), ("", None)],
)
def test_peer_host(peer, host):
    assert peer_host(peer) == host


@pytest.mark.parametrize(
    "endpoint, peer",
    [
        ("127.0.0.1", "ipv4:127.0.0.1:4000"),
        ("127.0.0.1", "ipv6:[::ffff:127.0.0.1]:4000"),
        ("10.77.0.2", "ipv4:10.77.0.2:4000"),
        ("", "ipv4:10.77.0.2:4000"),
        ("localhost", "unix:/s"),
    ],
)
def test_reachable_masters_pass(endpoint, peer):
    check_endpoint_reachable(endpoint, peer)


@pytest.mark.parametrize("endpoint", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_loopback_master_from_another_host_is_refused(endpoint):
    with pytest.raises(RendezvousError) as refused:
        check_endpoint_reachable(endpoint, "ipv4:10.77.0.2:40000")
    assert refused.value.code is Code.INVALID_ARGUMENT
    assert f"endpoint_host {endpoint!r} is a loopback address" in refused.value.message
    assert "from 10.77.0.2" in refused.value.message


def _loopback_by_parsing(host: str) -> bool:
    """The definition is_loopback_host's fast path must agree with: parse every literal."""
    import ipaddress

    host = host.strip("[]").split("%")[0]
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


_HOST_PARTS = [
    "127",
    "0127",
    "10",
    "0",
    "1",
    "255",
    "256",
    "::",
    "::1",
    "ffff",
    "fe80",
    "%eth0",
    "[",
    "]",
    "localhost",
    "LocalHost",
    "a",
    ".",
    ":",
    "127.",
    "1.2",
]


def test_is_loopback_host_agrees_with_parsing_every_literal():
    import itertools
    import random

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from meshgate.endpoints import is_loopback_host

    rng = random.Random(15)
    hosts = [
        "127.0.0.1",
        "127.1.2.3",
        "127.0.0.01",
        "0127.0.0.1",
        "127.1",
        "::1",
        "[::1]",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
        "0:0:0:0:0:0:0:1",
        "fe80::1%eth0",
        "localhost",
        "127.0.0.1%x",
        "",
        "10.0.0.1",
    ]
    hosts += ["".join(rng.choice(_HOST_PARTS + ["."]) for _ in range(rng.randint(1, 7))) for _ in range(3000)]
    hosts += [".".join(map(str, quad)) for quad in itertools.product((0, 1, 10, 127, 255, 256), repeat=4)]
    for host in hosts:
        assert is_loopback_host(host) is _loopback_by_parsing(host), host
        assert is_loopback_host(host) is _loopback_by_parsing(host), host  # the cached answer too

    @settings(max_examples=300, deadline=None)
    @given(st.text(alphabet="0123456789abcdef.:[]%lochst", max_size=24))
    def agree(host):
        assert is_loopback_host(host) is _loopback_by_parsing(host)

    agree()
