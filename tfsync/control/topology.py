"""Which ranks relay whose control traffic: the relay topology of a job, from its hosts.

A pure function of every rank's host name (gathered when the engine starts): the first rank
of each host but rank 0's with several ranks runs that host's relay (:mod:`~tfsync.control.relay`),
and past :data:`GROUP_HOSTS` relaying hosts the host relays of each ``GROUP_HOSTS``
consecutive hosts attach to a group relay.  The engine's start (:mod:`tfsync.engine.lifecycle`)
starts what this module names.
"""

GROUP_HOSTS = 8  # host relays per group relay, once a job has more relaying hosts than this


def relay_leaders(hosts, home=False) -> dict:
    """``{rank: the first rank of its host}`` for the ranks whose host is not rank 0's and holds
    several ranks (``hosts``: every rank's host name, in rank order): those attach through their
    host's relay.  ``home``: rank 0's host's other ranks too, if there are several (their relay
    runs in rank 1's process; rank 0 attaches to its own service directly)."""
    ranks_of = {}
    for rank, host in enumerate(hosts):
        if rank > 0 and (home or host != hosts[0]):
            ranks_of.setdefault(host, []).append(rank)
    return {rank: ranks[0] for ranks in ranks_of.values() if len(ranks) > 1 for rank in ranks}


def relay_groups(leaders) -> dict:
    """``{host relay's rank: the rank of its group relay}`` (``leaders`` as :func:`relay_leaders`
    gives them): past :data:`GROUP_HOSTS` relaying hosts, the relays
    of each ``GROUP_HOSTS`` consecutive hosts attach to the group relay of the first of them
    (a host left alone attaches to rank 0); ``{}`` for fewer."""
    heads = sorted(set(leaders.values()))
    if len(heads) <= GROUP_HOSTS:
        return {}
    groups = {}
    for start in range(0, len(heads), GROUP_HOSTS):
        chunk = heads[start : start + GROUP_HOSTS]
        if len(chunk) > 1:
            groups.update(dict.fromkeys(chunk, chunk[0]))
    return groups


def relays(hosts, relaying: str = "auto") -> tuple:
    """``(leaders, groups)`` of a job whose ranks run on ``hosts`` (every rank's host name, in
    rank order) relayed as ``relaying`` says (``TFSYNC_CONTROL_RELAYS``: ``"auto"``, ``"hosts"``
    or ``"off"``): ``leaders`` as :func:`relay_leaders` gives them (rank 0's host's other ranks
    included once there are groups), ``groups`` as :func:`relay_groups`."""
    leaders = relay_leaders(hosts) if relaying != "off" else {}
    groups = relay_groups(leaders) if relaying == "auto" else {}
    if groups:  # (a job this large: rank 0's host's other workers through a relay too)
        leaders = relay_leaders(hosts, home=True)
    return leaders, groups


__all__ = ["GROUP_HOSTS", "relay_groups", "relay_leaders", "relays"]
