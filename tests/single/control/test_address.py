"""Which address rank 0's control service binds and advertises (tfsync.control.address)."""

import time

import pytest

from tfsync.control import ControlClient, ControlServer
from tfsync.control.address import choose

TOKEN = "t" * 32
# the two hosts of the report: an interface eth1 per host, host names only each host resolves
INTERFACES = {"lo": ["127.0.0.1", "::1"], "eth1": ["fe80::1%eth1", "198.18.0.1"], "eth0": ["10.9.0.5"]}


def no_resolver(hostname):
    raise OSError(f"[Errno -2] Name or service not known: {hostname}")


def resolver(table):
    return lambda hostname: table[hostname]


def test_control_host_overrides_everything():
    env = {"TFSYNC_CONTROL_HOST": "head.example", "HOROVOD_GLOO_IFACE": "eth1"}
    chosen = choose(env, hostname="tfh1", interfaces=lambda: INTERFACES, resolver=no_resolver)
    assert (chosen.bind, chosen.advertise) == ("head.example", "head.example")
    assert "TFSYNC_CONTROL_HOST" in chosen.source


def test_the_gloo_interface_gives_its_address_not_the_host_name():
    # the report: rank 0 advertised its host name, which the other host could not resolve
    env = {"HOROVOD_GLOO_IFACE": "eth1"}
    chosen = choose(env, hostname="tfh1", interfaces=lambda: INTERFACES, resolver=no_resolver)
    assert (chosen.bind, chosen.advertise) == ("198.18.0.1", "198.18.0.1")
    assert "eth1" in chosen.source


def test_an_interface_with_only_ipv6_gives_its_global_ipv6_address_not_the_link_local_one():
    interfaces = {"eth1": ["fe80::1%eth1", "fd00:18::1"]}
    chosen = choose({"HOROVOD_GLOO_IFACE": "eth1"}, interfaces=lambda: interfaces, resolver=no_resolver)
    assert chosen.advertise == "fd00:18::1"


def test_a_local_job_on_the_loopback_interface_uses_loopback():
    chosen = choose({"HOROVOD_GLOO_IFACE": "lo"}, interfaces=lambda: INTERFACES, resolver=no_resolver)
    assert chosen.advertise == "127.0.0.1"


def test_without_horovod_the_host_name_address_prefers_a_routable_ipv4():
    table = {"tfh1": ["127.0.1.1", "fd00::7", "198.18.0.1"]}
    chosen = choose({}, hostname="tfh1", interfaces=lambda: INTERFACES, resolver=resolver(table))
    assert chosen.advertise == "198.18.0.1" and "tfh1" in chosen.source


def test_a_host_name_that_resolves_only_to_loopback_is_used_on_one_host():
    chosen = choose({}, hostname="vm", interfaces=lambda: INTERFACES, resolver=resolver({"vm": ["127.0.1.1"]}))
    assert chosen.advertise == "127.0.1.1"


@pytest.mark.parametrize(
    "env, interfaces, expected",
    [
        ({"HOROVOD_GLOO_IFACE": "eth9"}, INTERFACES, "no interface 'eth9'"),
        ({"HOROVOD_GLOO_IFACE": "eth1"}, {"eth1": ["fe80::1%eth1"]}, "none other hosts can dial"),
        ({}, INTERFACES, "HOROVOD_GLOO_IFACE is not set"),
    ],
)
def test_when_nothing_works_the_error_lists_what_was_tried(env, interfaces, expected):
    with pytest.raises(RuntimeError) as info:
        choose(env, hostname="tfh1", interfaces=lambda: interfaces, resolver=no_resolver)
    message = str(info.value)
    for part in ("TFSYNC_CONTROL_HOST is not set", expected, "'tfh1' does not resolve", "Set TFSYNC_CONTROL_HOST"):
        assert part in message, message


def test_the_server_binds_one_address_and_advertises_another():
    # binding is separate from advertising (a NAT or service address in front of rank 0)
    server = ControlServer(size=1, t0=time.time(), token=TOKEN, host="127.0.0.1", advertise="localhost")
    try:
        assert server.address == f"localhost:{server.port}"
        ControlClient(server.address, 0, TOKEN, connect_timeout_s=5).close()
    finally:
        server.stop()


def test_the_control_path_works_over_ipv6():
    server = ControlServer(size=1, t0=time.time(), token=TOKEN, host="::1")
    try:
        assert server.address == f"[::1]:{server.port}"
        client = ControlClient(server.address, 0, TOKEN, connect_timeout_s=5)
        client.close()
    finally:
        server.stop()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_fixed_control_port_is_the_one_bound_and_advertised():
    # a firewall or a container publishes one known port, not the system's pick
    port = _free_port()
    env = {"HOROVOD_GLOO_IFACE": "lo", "TFSYNC_CONTROL_PORT": str(port)}
    chosen = choose(env, hostname="tfh1", interfaces=lambda: INTERFACES, resolver=no_resolver)
    assert (chosen.bind, chosen.port) == ("127.0.0.1", port)
    server = ControlServer(size=1, t0=time.time(), token=TOKEN, host=chosen.bind, port=chosen.port)
    try:
        assert server.address == f"127.0.0.1:{port}"
        ControlClient(server.address, 0, TOKEN, connect_timeout_s=5).close()
    finally:
        server.stop()


def test_without_a_fixed_port_the_system_picks_one():
    chosen = choose({"HOROVOD_GLOO_IFACE": "lo"}, hostname="tfh1", interfaces=lambda: INTERFACES, resolver=no_resolver)
    assert chosen.port == 0


@pytest.mark.parametrize("raw", ["http", "-1", "65536", "8.5"])
def test_a_control_port_that_is_not_a_port_number_is_refused(raw):
    with pytest.raises(ValueError, match=f"TFSYNC_CONTROL_PORT='{raw}': expected a TCP port number, 1 to 65535"):
        choose({"TFSYNC_CONTROL_PORT": raw}, hostname="tfh1", interfaces=lambda: INTERFACES, resolver=no_resolver)


def test_a_control_port_in_use_says_which_variable_to_change():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="TFSYNC_CONTROL_PORT to a free port"):
            ControlServer(size=1, t0=time.time(), token=TOKEN, host="127.0.0.1", port=port)
