"""Reading the probe maps into plain Python values.

Big maps are read with one BPF_MAP_LOOKUP_BATCH pass into reused buffers and decoded with
struct (layouts from abi.codec, i.e. from loadmesh.h): for 10,000 flows that is a few
system calls, where BCC's per-key iteration costs two system calls and several ctypes
objects per entry. Per-CPU values are summed here (maxima taken as maxima).

The decoding loops give up the GIL every YIELD_EVERY entries: the reader runs them in a
worker thread, and without that the daemon's event loop could wait for a whole poll.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

from . import abi
from .model_id import NO_MODEL

IPPROTO_TCP = 6
_V4_MAPPED = bytes(10) + b"\xff\xff"
# Entries handled between two GIL releases (about a millisecond of work), and how long to
# stay off the GIL then. sleep(0) is not enough: it releases the GIL, but on a busy machine
# this thread takes it back before the event loop's thread gets a CPU to claim it.
YIELD_EVERY = 1000
YIELD_S = 0.0005


def pause_point(i: int) -> None:
    """Lets other threads (the event loop) run every YIELD_EVERY iterations."""
    if i % YIELD_EVERY == YIELD_EVERY - 1:
        time.sleep(YIELD_S)


# A fingerprint: (client, client_port, server, server_port, model_id, status), addresses as
# 16 raw bytes (IPv4-mapped for IPv4), ports in host order; and its figures: (count,
# lat_sum_ns, lat_max_ns, last_ns) with last_ns on CLOCK_MONOTONIC. Plain tuples, not
# NamedTuples: CPython's collector never untracks tuple subclasses, and tens of thousands of
# tracked ones made each full collection, run while the reader's thread holds the GIL,
# stall the daemon's event loop for 70 ms.
FlowKey = tuple[bytes, int, bytes, int, int, int]
FlowStats = tuple[int, int, int, int]


class PortStats(NamedTuple):
    conns_accepted: int
    conns_opened: int
    retransmits: int
    resets_sent: int
    resets_received: int


@dataclass(frozen=True)
class MapSnapshot:
    """Everything the probes hold, read at one moment (mono_ns, CLOCK_MONOTONIC). Kernel
    counters are cumulative since the maps were created, i.e. since the probes started."""

    mono_ns: int
    flows: Mapping[FlowKey, FlowStats] = field(default_factory=dict)
    # (model_id, serving port, status, bucket) -> responses
    histograms: Mapping[tuple[int, int, int, int], int] = field(default_factory=dict)
    models: Mapping[int, str] = field(default_factory=dict)
    errors: Mapping[str, int] = field(default_factory=dict)
    ports: Mapping[int, PortStats] = field(default_factory=dict)
    # (model_id, serving port) -> requests sent and not answered yet
    inflight: Mapping[tuple[int, int], int] = field(default_factory=dict)


@lru_cache(maxsize=65536)
def format_ip(raw: bytes) -> str:
    if raw[:12] == _V4_MAPPED:
        return str(ipaddress.IPv4Address(raw[12:]))
    return str(ipaddress.IPv6Address(raw))


def format_endpoint(raw: bytes, port: int) -> str:
    ip = format_ip(raw)
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def ip_bytes(address: str) -> bytes:
    """16-byte form the probes use for an address (IPv4 becomes IPv4-mapped)."""
    ip = ipaddress.ip_address(address)
    return _V4_MAPPED + ip.packed if ip.version == 4 else ip.packed


class _Batch:
    """BPF_MAP_LOOKUP_BATCH over a whole map into buffers kept between reads."""

    def __init__(self, lib: Any, fd: int, key_size: int, value_size: int, capacity: int):
        self._lib = lib
        self.fd = fd
        self.key_size = key_size
        self.value_size = value_size
        self._capacity = capacity
        self._keys = ctypes.create_string_buffer(key_size * capacity)
        self._values = ctypes.create_string_buffer(value_size * capacity)

    def read(self) -> tuple[memoryview, memoryview, int]:
        token = ctypes.c_uint32(0)
        count = ctypes.c_uint32(0)
        total = 0
        while total < self._capacity:
            count.value = self._capacity - total
            rc = self._lib.bpf_lookup_batch(
                self.fd,
                ctypes.byref(token) if total else None,
                ctypes.byref(token),
                ctypes.byref(self._keys, total * self.key_size),
                ctypes.byref(self._values, total * self.value_size),
                ctypes.byref(count),
            )
            err = ctypes.get_errno()
            total += count.value
            if rc != 0:
                if err == errno.ENOENT:  # the map's end
                    break
                raise OSError(err, f"BPF_MAP_LOOKUP_BATCH: {os.strerror(err)}")
            if count.value == 0:
                break
        keys = memoryview(self._keys)[: total * self.key_size]
        values = memoryview(self._values)[: total * self.value_size]
        return keys, values, total


def _per_cpu_struct(value: abi.Codec, ncpu: int) -> struct.Struct:
    """One entry of a per-CPU map: ncpu values, each padded to 8 bytes by the kernel."""
    one = value.struct.format.lstrip("<")
    pad = -value.struct.size % 8
    return struct.Struct("<" + (one + (f"{pad}x" if pad else "")) * ncpu)


class MapReader:
    """Decodes the maps of one compiled probe set (a bcc.BPF)."""

    def __init__(self, bpf: Any, lib: Any, ncpu: int):
        self._bpf = bpf
        self._lib = lib
        self._ncpu = ncpu
        fp = bpf[b"fingerprints"]
        self._fp_key = abi.codec(fp.Key)
        self._fp_val = abi.codec(fp.sLeaf)
        self._fp = _Batch(lib, fp.map_fd, ctypes.sizeof(fp.Key),
                          _per_cpu_struct(self._fp_val, ncpu).size, fp.max_entries)
        self._fp_vals = _per_cpu_struct(self._fp_val, ncpu)
        hist = bpf[b"histograms"]
        self._hist_key = abi.codec(hist.Key)
        self._hist = _Batch(lib, hist.map_fd, ctypes.sizeof(hist.Key), 8 * ncpu,
                            hist.max_entries)
        infl = bpf[b"inflight"]
        self._infl_key = abi.codec(infl.Key)
        self._infl_val = abi.codec(infl.Leaf)
        self._infl = _Batch(lib, infl.map_fd, ctypes.sizeof(infl.Key),
                            ctypes.sizeof(infl.Leaf), infl.max_entries)
        self._depth = abi.const("LM_PIPE_DEPTH")
        self._error_names = abi.error_names()
        self._flow_keys: dict[bytes, FlowKey] = {}  # raw key -> decoded, from the last read

    def read(self) -> MapSnapshot:
        mono = time.monotonic_ns()
        return MapSnapshot(
            mono_ns=mono,
            flows=self.flows(),
            histograms=self.histograms(),
            models=self.models(),
            errors=self.errors(),
            ports=self.ports(),
            inflight=self.inflight(),
        )

    def flows(self) -> dict[FlowKey, FlowStats]:
        keys, values, n = self._fp.read()
        ks, vs = self._fp.key_size, self._fp.value_size
        kc = self._fp_key
        fields = [kc.index(f) for f in ("flow.client", "flow.client_port", "flow.server",
                                        "flow.server_port", "model_id", "status")]
        vf = self._fp_val.fields
        width = len(vf)
        cnt, lsum = vf.index("count"), vf.index("lat_sum_ns")
        lmax, last = vf.index("lat_max_ns"), vf.index("last_ns")
        unpack_value = self._fp_vals.unpack_from
        known, seen = self._flow_keys, {}
        out: dict[FlowKey, FlowStats] = {}
        for i in range(n):
            pause_point(i)
            raw = bytes(keys[i * ks:(i + 1) * ks])
            key = known.get(raw)
            if key is None:
                k = kc.struct.unpack(raw)
                key = tuple([k[f] for f in fields])
            seen[raw] = key
            v = unpack_value(values, i * vs)
            out[key] = (sum(v[cnt::width]), sum(v[lsum::width]), max(v[lmax::width]),
                        max(v[last::width]))
        self._flow_keys = seen
        return out

    def histograms(self) -> dict[tuple[int, int, int, int], int]:
        keys, values, _ = self._hist.read()
        kc = self._hist_key
        mi, pi = kc.index("model_id"), kc.index("port")
        si, bi = kc.index("status"), kc.index("bucket")
        per_entry = struct.Struct(f"<{self._ncpu}Q")
        return {
            (k[mi], k[pi], k[si], k[bi]): sum(v)
            for k, v in zip(kc.struct.iter_unpack(keys), per_entry.iter_unpack(values))
        }

    def models(self) -> dict[int, str]:
        out = {}
        for k, v in self._bpf[b"models"].items():
            out[k.value] = bytes(v.name[: min(v.len, len(v.name))]).decode("utf-8", "replace")
        return out

    def errors(self) -> dict[str, int]:
        table = self._bpf[b"errors"]
        return {name: sum(table[ctypes.c_int(i)]) for i, name in enumerate(self._error_names)}

    def ports(self) -> dict[int, PortStats]:
        out = {}
        for k, per_cpu in self._bpf[b"port_stats"].items():
            out[k.value] = PortStats(*(sum(getattr(v, f) for v in per_cpu)
                                       for f in PortStats._fields))
        return out

    def inflight(self) -> dict[tuple[int, int], int]:
        """Requests sent and not yet answered, per (model, serving port); model 0: unknown
        yet or none."""
        keys, values, _ = self._infl.read()
        port_at = self._infl_key.index("server_port")
        vc = self._infl_val
        hi, ti, oi = vc.index("head"), vc.index("tail"), vc.index("overflow")
        model_at = [vc.index(f"ring.{i}.model_id") for i in range(self._depth)]
        mask = self._depth - 1
        out: dict[tuple[int, int], int] = {}
        for i, (k, v) in enumerate(zip(self._infl_key.struct.iter_unpack(keys),
                                       vc.struct.iter_unpack(values))):
            pause_point(i)
            port, head, tail, over = k[port_at], v[hi], v[ti], v[oi]
            if over:
                out[NO_MODEL, port] = out.get((NO_MODEL, port), 0) + over
            for pos in range(head, head + min((tail - head) & 0xFFFFFFFF, self._depth)):
                key = (v[model_at[pos & mask]], port)
                out[key] = out.get(key, 0) + 1
        return out

    def delete_flows(self, keys: Iterable[FlowKey]) -> None:
        """Deletes fingerprints (the reader expires idle ones) in one batch call."""
        kc = self._fp_key
        packed = []
        for client, client_port, server, server_port, model, status in keys:
            item = dict.fromkeys(kc.fields, 0)
            item.update({"flow.client": client, "flow.server": server,
                         "flow.client_port": client_port, "flow.server_port": server_port,
                         "flow.proto": IPPROTO_TCP, "flow.pad": b"", "model_id": model,
                         "status": status, "pad": b""})
            packed.append(kc.struct.pack(*(item[f] for f in kc.fields)))
        if not packed:
            return
        buf = ctypes.create_string_buffer(b"".join(packed), len(packed) * kc.struct.size)
        count = ctypes.c_uint32(len(packed))
        if self._lib.bpf_delete_batch(self._fp.fd, buf, ctypes.byref(count)) == 0:
            return
        # The batch stops at the first key that is already gone: delete the rest singly.
        size = kc.struct.size
        for i in range(count.value, len(packed)):
            if self._lib.bpf_delete_elem(self._fp.fd, ctypes.byref(buf, i * size)):
                err = ctypes.get_errno()
                if err != errno.ENOENT:
                    raise OSError(err, f"BPF_MAP_DELETE_ELEM: {os.strerror(err)}")
