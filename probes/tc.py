"""TC clsact attachment with pyroute2: add one bpf filter per interface and direction,
remember exactly what was added (filters, and clsact qdiscs that did not exist before),
and remove exactly that.

A filter left behind outlives the process, so removal tolerates an interface that is
already gone, and attach() first removes filters of ours that a killed agent left behind
(found by program name; they would run alongside the new ones for nothing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

log = logging.getLogger(__name__)

CLSACT_HANDLE = 0xFFFF0000
INGRESS = 0xFFFFFFF2
EGRESS = 0xFFFFFFF3
ETH_P_ALL = 0x0003
HANDLE = 1
# Program names of our entry programs start with it; the kernel keeps 15 characters.
PROG_PREFIX = "lm_tc_"

ARPHRD_ETHER = 1
ARPHRD_LOOPBACK = 772
ARPHRD_NONE = 65534  # WireGuard, tun: packets start at the IP header

_ENODEV = 19
_ENOENT = 2
_EINVAL = 22


@dataclass(frozen=True)
class Filter:
    """One bpf filter we added."""

    ifname: str
    ifindex: int
    parent: int
    prio: int


def link(ipr: Any, ifname: str) -> tuple[int, int]:
    """(ifindex, ARPHRD link type) of an interface; LookupError when there is none."""
    found = ipr.link_lookup(ifname=ifname)
    if not found:
        raise LookupError(f"interface {ifname} not found")
    idx = found[0]
    return idx, ipr.get_links(idx)[0]["ifi_type"]


def directions(link_type: int) -> tuple[int, ...]:
    """Hooks to attach to. On loopback every packet passes egress and then ingress, so one
    direction sees both the requests and the responses, once each."""
    if link_type == ARPHRD_LOOPBACK:
        return (INGRESS,)
    return (INGRESS, EGRESS)


def has_clsact(ipr: Any, ifindex: int) -> bool:
    return any(q.get_attr("TCA_KIND") == "clsact" for q in ipr.get_qdiscs(ifindex))


def add_clsact(ipr: Any, ifindex: int) -> None:
    ipr.tc("add", "clsact", ifindex)


def _filters(ipr: Any, ifindex: int, parent: int) -> list[dict[str, Any]]:
    """(prio, protocol, handle, name) of each filter under a clsact hook."""
    out = []
    for f in ipr.get_filters(ifindex, parent=parent):
        if not f["handle"]:
            continue  # the per-prio chain header the kernel lists before its filters
        opts = f.get_attr("TCA_OPTIONS")
        name = opts.get_attr("TCA_BPF_NAME") if opts is not None else None
        out.append(
            {
                "prio": f["info"] >> 16,
                "protocol": ((f["info"] & 0xFF) << 8) | ((f["info"] >> 8) & 0xFF),
                "handle": f["handle"],
                "kind": f.get_attr("TCA_KIND"),
                "name": name or "",
            }
        )
    return out


def remove_stale(ipr: Any, ifname: str, ifindex: int, parent: int) -> int:
    """Deletes bpf filters of ours left by an agent that died without cleaning up."""
    removed = 0
    for f in _filters(ipr, ifindex, parent):
        if f["kind"] == "bpf" and f["name"].startswith(PROG_PREFIX):
            ipr.tc("del-filter", "bpf", ifindex, f["handle"], parent=parent, prio=f["prio"],
                   protocol=f["protocol"])
            log.warning("removed a stale loadmesh filter on %s (prio %d): a previous agent "
                        "did not detach", ifname, f["prio"])
            removed += 1
    return removed


def free_prio(ipr: Any, ifindex: int, parent: int) -> int:
    """Lowest prio no filter uses: ours then runs first, and since it always passes the
    packet on (TC_ACT_UNSPEC) the filters behind it see every packet as before."""
    used = {f["prio"] for f in _filters(ipr, ifindex, parent)}
    prio = 1
    while prio in used:
        prio += 1
    return prio


def add_filter(ipr: Any, ifname: str, ifindex: int, parent: int, prog_fd: int,
               prog_name: str) -> Filter:
    prio = free_prio(ipr, ifindex, parent)
    ipr.tc("add-filter", "bpf", ifindex, HANDLE, fd=prog_fd, name=prog_name, parent=parent,
           classid=1, direct_action=True, prio=prio, protocol=ETH_P_ALL)
    return Filter(ifname, ifindex, parent, prio)


def _gone(exc: NetlinkError) -> bool:
    """The interface or the object went away meanwhile (a deleted veth takes its qdiscs
    and filters with it)."""
    return exc.code in (_ENODEV, _ENOENT, _EINVAL)


def del_filter(ipr: Any, f: Filter) -> None:
    try:
        ipr.tc("del-filter", "bpf", f.ifindex, HANDLE, parent=f.parent, prio=f.prio,
               protocol=ETH_P_ALL)
    except NetlinkError as exc:
        if not _gone(exc):
            raise


def del_clsact_if_unused(ipr: Any, ifindex: int) -> bool:
    """Deletes a clsact we added, unless someone attached filters to it meanwhile."""
    try:
        if _filters(ipr, ifindex, INGRESS) or _filters(ipr, ifindex, EGRESS):
            return False
        ipr.tc("del", "clsact", ifindex)
        return True
    except NetlinkError as exc:
        if not _gone(exc):
            raise
        return False
