"""One spelling of a duration and of HOST:PORT (issue #31): the config and the CLI take the
same durations (meshgate/durations.py), and every setting and peer address is read by one
HOST:PORT parser (meshgate/endpoints.py): IPv6 in brackets, a bare host where a default
port makes sense, ports checked when the config loads, errors naming the setting. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshgate import cli
from meshgate.agent.config import AgentConfig, AgentConfigError
from meshgate.coordinator.config import ConfigError, CoordinatorConfig
from meshgate.coordinator.reachability import check_endpoint_reachable, peer_host
from meshgate.coordinator.rendezvous import RendezvousError
from meshgate.coordinator.store.etcd import etcd_endpoint
from meshgate.durations import DurationError, parse_duration
from meshgate.endpoints import AddressError, split_host_port
from meshgate.metrics import parse_listen

SPELLINGS = [
    (600, 600.0),
    ("600", 600.0),
    ("600s", 600.0),
    ("10m", 600.0),
    ("1.5h", 5400.0),
    ("1d", 86400.0),
    (" 2h ", 7200.0),
    ("0.5m", 30.0),
]
NOT_DURATIONS = ["soon", "-1d", "0", "0s", 0, -5, True, "3w", "1h30m", "", "inf", float("nan"), "1 d d", None]


def cluster_config(tmp_path: Path, cluster=None, store=None, server=None) -> CoordinatorConfig:
    return CoordinatorConfig.from_mapping(
        {
            "server": {"insecure": True, **(server or {})},
            "keys": {"dir": str(tmp_path / "keys")},
            "store": {"dir": str(tmp_path / "state"), **(store or {})},
            "cluster": cluster or {},
        }
    )


# ---- durations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value, seconds", SPELLINGS)
def test_the_config_and_the_cli_take_the_same_durations(tmp_path, value, seconds):
    assert parse_duration(value, "x") == seconds
    assert cluster_config(tmp_path, {"retention": value}).retention_s == seconds
    assert cli.token_ttl(str(value)) == seconds  # --ttl 1d and --ttl 1.5h, refused before


@pytest.mark.parametrize("value", NOT_DURATIONS)
def test_a_bad_duration_is_refused_naming_the_key_or_flag_and_the_value(tmp_path, value):
    with pytest.raises(DurationError, match=r"^flag must be a positive number of seconds or a duration like"):
        parse_duration(value, "flag")
    with pytest.raises(ConfigError, match=r"\[cluster\] retention must be a positive number of seconds") as refused:
        cluster_config(tmp_path, {"retention": value})
    assert repr(value)[:20] in str(refused.value)
    if isinstance(value, str):
        with pytest.raises(cli.StatusError, match=r"^--ttl must be a positive number") as flag:
            cli.token_ttl(value)
        assert repr(value) in str(flag.value)


def test_a_ttl_is_whole_seconds_and_at_least_one():
    assert cli.token_ttl("1.4s") == 1
    with pytest.raises(cli.StatusError, match="under a second"):
        cli.token_ttl("0.4s")  # ttl_s = 0 would mean the server's default


def test_a_long_bad_value_is_shown_bounded():
    with pytest.raises(DurationError) as refused:
        parse_duration("x" * 10_000, "[cluster] retention")
    assert len(str(refused.value)) < 300


# ---- HOST:PORT ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, default, expected",
    [
        ("10.0.0.5:2379", None, ("10.0.0.5", 2379)),
        ("10.0.0.5", 2379, ("10.0.0.5", 2379)),
        ("[::1]:2379", None, ("::1", 2379)),
        ("[::1]", 2379, ("::1", 2379)),
        ("::1", 2379, ("::1", 2379)),
        ("[fe80::1%eth0]:7443", None, ("fe80::1%eth0", 7443)),
        ("head-a.example:7443", None, ("head-a.example", 7443)),
        ("Head_A:1", None, ("Head_A", 1)),
        ("h:65535", None, ("h", 65535)),
    ],
)
def test_host_port_is_read_one_way(text, default, expected):
    assert split_host_port(text, "f", default_port=default) == expected


@pytest.mark.parametrize(
    "text, why",
    [
        ("10.0.0.5", "needs a port"),
        ("h:0", r"not a TCP port \(1..65535\)"),
        ("h:65536", "not a TCP port"),
        ("h:x", "not a TCP port"),
        ("h:", "not a TCP port"),
        ("h:1/x", "not a TCP port"),
        ("[::1]x", r"expected \[IPv6\]:PORT"),
        ("[::1", r"expected \[IPv6\]:PORT"),
        ("[10.0.0.1]:1", r"expected \[IPv6\]:PORT"),
        ("fd00::1::2", "takes brackets"),
        ("user@h:1", "not a host name or address"),
        (":1", "not a host name or address"),
        ("", "must be HOST:PORT"),
        (2379, "must be HOST:PORT"),
    ],
)
def test_a_bad_host_port_is_refused_naming_the_setting(text, why):
    with pytest.raises(AddressError, match=rf"^\[store\] endpoints.*{why}"):
        split_host_port(text, "[store] endpoints")


def test_a_listening_address_may_ask_for_any_port_and_every_interface():
    assert split_host_port("127.0.0.1:0", "f", listen=True) == ("127.0.0.1", 0)
    assert split_host_port(":9464", "f", listen=True) == ("", 9464)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen(":9464") == ("0.0.0.0", 9464)


def test_etcd_endpoints_take_etcds_port_for_a_bare_host(tmp_path):
    assert etcd_endpoint("10.0.0.5") == ("10.0.0.5", 2379)
    assert etcd_endpoint("[::1]:2379") == ("::1", 2379)
    assert etcd_endpoint("::1") == ("::1", 2379)
    config = cluster_config(tmp_path, store={"kind": "etcd", "endpoints": ["10.0.0.5", "[::1]:2379"]})
    assert config.etcd_endpoints == ("10.0.0.5", "[::1]:2379")


@pytest.mark.parametrize(
    "store, server, named",
    [
        ({"kind": "etcd", "endpoints": ["10.0.0.5:99999"]}, {}, r"\[store\] endpoints '10.0.0.5:99999': port"),
        ({"kind": "etcd", "endpoints": ["10.0.0.5:x"]}, {}, r"\[store\] endpoints '10.0.0.5:x': port"),
        ({"kind": "etcd", "endpoints": ["fd00::1::2"]}, {}, r"\[store\] endpoints 'fd00::1::2'"),
        ({"kind": "etcd", "endpoints": [""]}, {}, r"\[store\] endpoints must be HOST:PORT"),
        ({"kind": "etcd", "endpoints": "10.0.0.5"}, {}, r"\[store\] endpoints must be a list"),
        ({"advertise": "head-a"}, {}, r"\[store\] advertise 'head-a' needs a port"),
        ({}, {"listen": "127.0.0.1:70000"}, r"\[server\] listen '127.0.0.1:70000': port"),
        ({}, {"listen": "7443"}, r"\[server\] listen '7443' needs a port"),
        ({}, {"metrics_listen": "[::1]:x"}, r"\[server\] metrics_listen '\[::1\]:x': port"),
    ],
)
def test_a_coordinator_config_refuses_a_bad_address_when_it_loads(tmp_path, store, server, named):
    with pytest.raises(ConfigError, match=named):
        cluster_config(tmp_path, store=store, server=server)


def test_a_coordinator_may_listen_on_ipv6_or_a_unix_socket(tmp_path):
    assert cluster_config(tmp_path, server={"listen": "[::1]:0"}).listen == "[::1]:0"
    assert cluster_config(tmp_path, server={"listen": "unix:/run/x.sock"}).listen == "unix:/run/x.sock"


@pytest.mark.parametrize("coordinator", ["head-a:7443,head-b", "head:99999", "[::1]x", "fd00::1::2:7443"])
def test_an_agent_config_refuses_a_bad_coordinator_address_naming_it(tmp_path, coordinator):
    with pytest.raises(AgentConfigError, match=r"^\[agent\] coordinator"):
        AgentConfig.from_mapping({"coordinator": coordinator, "insecure": True, "job": "j"}, base_dir=tmp_path)


def test_an_agent_config_takes_ha_lists_ipv6_and_sockets(tmp_path):
    for coordinator in ("head-a:7443, head-b:7443", "[fd00::1]:7443", "unix:/run/meshgate/rendezvous.sock"):
        config = AgentConfig.from_mapping({"coordinator": coordinator, "insecure": True, "job": "j"}, base_dir=tmp_path)
        assert config.coordinator == coordinator


def test_grpc_peers_are_read_as_addresses_too():
    # grpc 1.85 percent-encodes an IPv6 peer's brackets: the old reader took the whole string
    # for the host, so an IPv6 loopback caller looked remote and its loopback master was refused.
    assert peer_host("ipv6:%5B::1%5D:35388") == "::1"
    assert peer_host("ipv6:[fd00::2]:5123") == "fd00::2"
    assert peer_host("ipv4:10.0.0.2:5123") == "10.0.0.2"
    assert peer_host("unix:/run/x.sock") is None
    check_endpoint_reachable("127.0.0.1", "ipv6:%5B::1%5D:35388")  # a local caller: its master is fine
    with pytest.raises(RendezvousError, match="reached the coordinator from fd00::2"):
        check_endpoint_reachable("127.0.0.1", "ipv6:%5B fd00::2%5D:5123".replace(" ", ""))
