"""ProbeSet: why it degrades, that it detaches exactly what it attached (also when start
fails half-way, also next to foreign filters), port changes without a recompile, pause and
resume. Runs as root on veth pairs into namespaces it creates, never on real interfaces."""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import nettopo
from loadmesh.probes import MapSizes, ProbeSet, ProbeUnavailable, abi, loader
from loadmesh.model_id import model_id

pytestmark = pytest.mark.root
ROOT = Path(__file__).resolve().parent.parent
SERVER = [sys.executable, str(ROOT / "tests" / "probe_servers.py")]


def bpf_prog_fds() -> int:
    """BPF programs this process holds open."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:bpf-prog"
        except OSError:
            pass
    return n


def ours(ifname: str, direction: str) -> list[int]:
    """Ids of our programs on a hook: tcx links (nothing else here makes them) and
    cls_bpf filters named lm_tc_*."""
    return nettopo.tcx_progs(ifname, direction) + [
        f["options"]["prog"]["id"] for f in nettopo.tc_filters(ifname, direction)
        if f["options"].get("bpf_name", "").startswith("lm_tc_")]


def post(host: str, port: int, model: str) -> int:
    body = b'{"model": "%s", "messages": []}' % model.encode()
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
                  b"Connection: close\r\n\r\n%s" % (len(body), body))
        return int(s.makefile("rb").readline().split()[1])


def responses(probes: ProbeSet, model: str) -> int:
    mid = model_id(model)
    return sum(n for (m, _p, _e, kind, _s, _b), n in probes.read_maps().histograms.items()
               if m == mid and kind == abi.const("LM_HK_TTFB"))


@pytest.fixture
def topo() -> Iterator[nettopo.VethTopo]:
    with nettopo.veth_netns() as t:
        yield t
    assert not nettopo.leftovers("lmt")


@pytest.fixture
def foreign_filter(topo: nettopo.VethTopo) -> Iterator[str]:
    """Someone else's clsact and bpf filter on the interface before the probes come."""
    from bcc import BPF

    bpf = BPF(text=b"int foreign_tc(struct __sk_buff *skb) { return -1; }")
    fn = bpf.load_func(b"foreign_tc", BPF.SCHED_CLS)
    nettopo.sh(["tc", "qdisc", "add", "dev", topo.host_if, "clsact"])
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=topo.host_if)[0]
        ipr.tc("add-filter", "bpf", idx, 7, fd=fn.fd, name=fn.name, parent=0xFFFFFFF2,
               classid=1, direct_action=True, prio=1, protocol=3)
    try:
        yield topo.host_if
    finally:
        nettopo.sh(["tc", "qdisc", "del", "dev", topo.host_if, "clsact"], check=False)
        bpf.cleanup()


# ---- reasons to degrade ----

def test_not_root_is_a_one_line_reason() -> None:
    code = ("from loadmesh.probes import ProbeSet, ProbeUnavailable\n"
            "try:\n    ProbeSet(['lo'], [8000]).start()\n"
            "except ProbeUnavailable as e:\n    print('REASON', e)\n")

    def drop() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, preexec_fn=drop, timeout=60)
    assert out.stdout.startswith("REASON not root (needs CAP_BPF"), out.stdout + out.stderr
    assert len(out.stdout.strip().splitlines()) == 1


def test_no_kernel_headers_names_where_it_looked(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    monkeypatch.setattr(loader, "MODULES_DIR", tmp_path)
    monkeypatch.setattr(loader, "KHEADERS", tmp_path / "kheaders.tar.xz")
    probes = ProbeSet(["lo"], [8000])
    with pytest.raises(ProbeUnavailable) as exc:
        probes.start()
    assert str(exc.value) == f"no kernel headers at {tmp_path}/{os.uname().release}/build"
    assert not probes.running and probes.attachments == ()


def test_no_tracefs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(loader, "TRACEFS_DIRS", (tmp_path / "tracing",))
    with pytest.raises(ProbeUnavailable, match="^tracefs not mounted at "):
        ProbeSet(["lo"], [8000]).start()


def test_bpf_refused_by_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    import bcc

    class Refusing(bcc.BPF):  # type: ignore[misc]
        def __init__(self, *args: object, **kwargs: object) -> None:
            raise Exception("Failed to load BPF program b'lm_req': Operation not permitted")

    monkeypatch.setattr(bcc, "BPF", Refusing)
    with pytest.raises(ProbeUnavailable) as exc:
        ProbeSet(["lo"], [8000]).start()
    assert str(exc.value) == ("BPF not supported: Failed to load BPF program b'lm_req': "
                              "Operation not permitted")


def test_sources_from_another_directory(tmp_path: Path) -> None:
    """ProbeSet(sources=...) compiles that directory's C parts, not the package's (an A/B
    of two trees: scripts/bench_probes_ab.py)."""
    for part in loader.HERE.iterdir():
        if part.suffix in (".c", ".h"):
            (tmp_path / part.name).write_text(part.read_text())
    with (tmp_path / "http_entry.bpf.c").open("a") as f:
        f.write('\n#error "the copy was compiled"\n')
    probes = ProbeSet(["lo"], [8000], sources=tmp_path)
    try:
        with pytest.raises(ProbeUnavailable, match="^BPF program does not compile"):
            probes.start()
    finally:
        probes.stop()


def test_failure_half_way_detaches_what_was_attached(topo: nettopo.VethTopo) -> None:
    fds = bpf_prog_fds()
    probes = ProbeSet([topo.host_if, "lmnosuch0"], [8000])
    with pytest.raises(ProbeUnavailable, match="^interface lmnosuch0 not found$"):
        probes.start()
    assert probes.attachments == () and not probes.running
    assert nettopo.attached(topo.host_if) == []
    assert bpf_prog_fds() == fds


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ProbeSet([], [8000])
    with pytest.raises(ValueError):
        ProbeSet(["lo"], [0])
    with pytest.raises(ValueError):
        ProbeSet(["lo"], range(1000, 1010), MapSizes(ports=4))
    with pytest.raises(ValueError):
        MapSizes(inflight=0)


# ---- attach and detach ----

def test_detaches_exactly_what_it_attached(topo: nettopo.VethTopo,
                                           foreign_filter: str) -> None:
    fds = bpf_prog_fds()
    with nettopo.veth_netns() as other:
        probes = ProbeSet([topo.host_if, other.host_if], [8000])
        probes.start()
        try:
            for ifname in (topo.host_if, other.host_if):
                assert len(ours(ifname, "ingress")) == 1 and len(ours(ifname, "egress")) == 1
            assert probes.attached_as == "tcx links"
            assert len(probes.attachments) == 4
        finally:
            probes.stop()
        assert ours(topo.host_if, "ingress") == ours(topo.host_if, "egress") == []
        # the foreign filter and the clsact it hangs on were there before: they stay
        names = [f["options"]["bpf_name"] for f in nettopo.tc_filters(topo.host_if, "ingress")]
        assert names == ["foreign_tc"]
        assert nettopo.attached(other.host_if) == []
        assert probes.attachments == () and bpf_prog_fds() == fds
        probes.stop()  # idempotent


def test_replaces_filters_left_by_a_killed_agent(topo: nettopo.VethTopo) -> None:
    from bcc import BPF
    from pyroute2 import IPRoute

    stale = BPF(text=b"int lm_tc_eth(struct __sk_buff *skb) { return -1; }")
    fn = stale.load_func(b"lm_tc_eth", BPF.SCHED_CLS)
    nettopo.sh(["tc", "qdisc", "add", "dev", topo.host_if, "clsact"])
    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=topo.host_if)[0]
        ipr.tc("add-filter", "bpf", idx, 1, fd=fn.fd, name=fn.name, parent=0xFFFFFFF2,
               classid=1, direct_action=True, prio=5, protocol=3)
    (stale_id,) = ours(topo.host_if, "ingress")
    stale.cleanup()  # the filter keeps the program alive, as after a SIGKILL
    probes = ProbeSet([topo.host_if], [8000])
    probes.start()
    try:
        (only,) = ours(topo.host_if, "ingress")
        assert only != stale_id
    finally:
        probes.stop()
        nettopo.sh(["tc", "qdisc", "del", "dev", topo.host_if, "clsact"], check=False)
    assert ours(topo.host_if, "ingress") == []


# ---- ports and pausing, with traffic ----

def test_port_list_changes_without_recompile_and_pause_keeps_counts(
        topo: nettopo.VethTopo) -> None:
    with topo.ns.popen(SERVER + ["--port", "8001"], ready="ready"), \
            topo.ns.popen(SERVER + ["--port", "8002"], ready="ready"):
        probes = ProbeSet([topo.host_if], [8001])
        probes.start()
        try:
            bpf, progs = probes._bpf, ours(topo.host_if, "ingress")
            assert post(topo.ns_v4, 8001, "ports-a") == 200
            assert post(topo.ns_v4, 8002, "ports-b") == 200
            assert (responses(probes, "ports-a"), responses(probes, "ports-b")) == (1, 0)
            probes.set_ports([8002])
            assert post(topo.ns_v4, 8001, "ports-a") == 200
            assert post(topo.ns_v4, 8002, "ports-b") == 200
            assert (responses(probes, "ports-a"), responses(probes, "ports-b")) == (1, 1)
            # same programs, same filters: nothing was compiled or attached again
            assert probes._bpf is bpf
            assert ours(topo.host_if, "ingress") == progs

            probes.pause()
            assert ours(topo.host_if, "ingress") == [] and probes.attachments == ()
            assert post(topo.ns_v4, 8002, "ports-b") == 200
            assert responses(probes, "ports-b") == 1
            probes.resume()
            assert len(ours(topo.host_if, "egress")) == 1
            assert post(topo.ns_v4, 8002, "ports-b") == 200
            assert responses(probes, "ports-b") == 2
        finally:
            probes.stop()
    assert ours(topo.host_if, "ingress") == ours(topo.host_if, "egress") == []


def test_falls_back_to_cls_bpf_filters_without_tcx(topo: nettopo.VethTopo,
                                                   foreign_filter: str,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A kernel before 6.6 refuses tcx links with EINVAL: the probes go on as cls_bpf
    filters in front of the foreign one, count, and leave the foreign clsact as it was."""
    from loadmesh.probes import tcx

    def no_tcx(*_args: object) -> tcx.Link:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(tcx, "attach", no_tcx)
    caplog.set_level(logging.INFO, logger="loadmesh.probes.loader")
    with topo.ns.popen(SERVER + ["--port", "8001"], ready="ready"):
        probes = ProbeSet([topo.host_if], [8001])
        probes.start()
        try:
            assert "no tcx links on this kernel" in caplog.text
            assert probes.attached_as == "cls_bpf filters"
            names = [f["options"]["bpf_name"] for f in nettopo.tc_filters(topo.host_if, "ingress")]
            assert sorted(names) == ["foreign_tc", "lm_tc_eth"]
            assert len(ours(topo.host_if, "egress")) == 1
            assert nettopo.tcx_progs(topo.host_if, "ingress") == []
            assert post(topo.ns_v4, 8001, "cls-bpf") == 200
            assert responses(probes, "cls-bpf") == 1
        finally:
            probes.stop()
    names = [f["options"]["bpf_name"] for f in nettopo.tc_filters(topo.host_if, "ingress")]
    assert names == ["foreign_tc"] and ours(topo.host_if, "egress") == []
