"""Where rank 0's control service listens, and the address it gives the workers to dial.

The control path must work wherever Horovod's collectives do. On several hosts a
host name often resolves only on its own host (containers without cluster DNS), so
rank 0 advertises an address, chosen in this order:

1. ``TFSYNC_CONTROL_HOST``, when set: bound and advertised as given (a name or an
   address), for setups the rules below cannot see (NAT, a service address).
2. The address of the network interface Horovod chose for Gloo (``HOROVOD_GLOO_IFACE``,
   set by ``horovodrun`` from ``--network-interfaces`` or its own probe of the
   interfaces every host has): the network every rank already reaches rank 0 on.
3. The address rank 0's host name resolves to on its own host.

In each case the service binds that one address, not every interface, on the port
``TFSYNC_CONTROL_PORT`` names (default 0: a free port the system picks). Where an
interface or a name has several, a non-loopback address comes before a loopback
one and IPv4 before IPv6; an IPv6 address works too (link-local ones, which need
a zone, are skipped). When no
rule gives an address, the error lists what was tried.
"""

import dataclasses
import ipaddress
import os
import socket

from tfsync import _env

GLOO_IFACE_ENV = "HOROVOD_GLOO_IFACE"


@dataclasses.dataclass(frozen=True)
class ControlAddress:
    """Where the control service binds, the host the workers dial, and why (for messages)."""

    bind: str
    advertise: str
    source: str
    port: int = 0  # TFSYNC_CONTROL_PORT; 0: a free port the system picks


def _usable(address):
    """An address of this host other hosts can dial: not link-local (it would need a zone)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    return not ip.is_link_local and not ip.is_unspecified and not ip.is_multicast


def _prefer(addresses):
    """The first usable address: not loopback before loopback, IPv4 before IPv6; else None."""
    usable = [a for a in addresses if _usable(a)]
    rank = lambda a: (ipaddress.ip_address(a).is_loopback, ipaddress.ip_address(a).version)  # noqa: E731
    return min(usable, key=rank) if usable else None


def interface_addresses():
    """Every local interface's IP addresses, by interface name (psutil, as Horovod uses)."""
    import psutil

    families = (socket.AF_INET, socket.AF_INET6)
    return {name: [a.address for a in addrs if a.family in families] for name, addrs in psutil.net_if_addrs().items()}


def resolve(hostname):
    """The addresses ``hostname`` resolves to on this host, in resolver order."""
    infos = socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(info[4][0] for info in infos))


def choose(environ=None, hostname=None, interfaces=interface_addresses, resolver=resolve):
    """Rank 0's :class:`ControlAddress`, by the rules of the module docstring.

    ``interfaces`` and ``resolver`` are injected so that the rules are tested
    without the host's real network.

    Raises:
      RuntimeError: no rule gave an address; the message lists what was tried.
    """
    environ = os.environ if environ is None else environ
    port = _env.control_port(environ)
    return dataclasses.replace(_choose_host(environ, hostname, interfaces, resolver), port=port)


def choose_relay(environ=None, hostname=None, interfaces=interface_addresses, resolver=resolve):
    """Where a control group relay (:mod:`tfsync.control.relay`) on this host listens:
    rules 2 and 3 of the module docstring (``TFSYNC_CONTROL_HOST`` names rank 0's host, not
    this one), on a free port.

    Raises:
      RuntimeError: no rule gave an address; the message lists what was tried.
    """
    environ = os.environ if environ is None else environ
    return _choose_host(environ, hostname, interfaces, resolver, explicit=False, who="this host's control group relay")


def _choose_host(environ, hostname, interfaces, resolver, explicit=True, who="rank 0's control service"):
    chosen = _env.CONTROL_HOST.get(environ) if explicit else None
    if chosen:
        return ControlAddress(chosen, chosen, f"{_env.CONTROL_HOST.name}={chosen}")
    tried = [f"{_env.CONTROL_HOST.name} is not set"] if explicit else []

    iface = environ.get(GLOO_IFACE_ENV, "").strip()
    if iface:
        table = interfaces()
        if iface not in table:
            tried.append(f"{GLOO_IFACE_ENV}={iface}, but this host has no interface {iface!r} ({sorted(table)})")
        else:
            chosen = _prefer(table[iface])
            if chosen:
                return ControlAddress(chosen, chosen, f"interface {iface} ({GLOO_IFACE_ENV})")
            tried.append(f"{GLOO_IFACE_ENV}={iface}, whose addresses {table[iface]} have none other hosts can dial")
    else:
        tried.append(f"{GLOO_IFACE_ENV} is not set (not launched by horovodrun with Gloo)")

    hostname = hostname or socket.gethostname()
    try:
        addresses = resolver(hostname)
    except OSError as exc:
        tried.append(f"the host name {hostname!r} does not resolve here ({exc})")
    else:
        chosen = _prefer(addresses)
        if chosen:
            return ControlAddress(chosen, chosen, f"host name {hostname!r}")
        tried.append(f"the host name {hostname!r} resolves to {addresses}, none of which other hosts can dial")
    raise RuntimeError(
        f"tfsync: no address for {who}: "
        + "; ".join(tried)
        + (
            f". Set {_env.CONTROL_HOST.name} to an address of rank 0's host that every worker can reach "
            if explicit
            else ". Let this host's name resolve to an address the other hosts reach "
        )
        + "(or launch with horovodrun --network-interfaces IFACE)"
    )
