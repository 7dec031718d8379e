"""Reading the probe maps into plain Python values.

Big maps are read with one BPF_MAP_LOOKUP_BATCH pass into reused buffers and decoded with
struct (layouts from abi.codec, i.e. from loadmesh.h): for 10,000 flows that is a few
system calls, where BCC's per-key iteration costs two system calls and several ctypes
objects per entry. Per-CPU values (small counters only) are summed here.

The reader polls four times a second, from a worker thread that shares the GIL with the
daemon's event loop, so a poll must cost little whatever the number of flows and CPUs:
it reads no map that grows with either (the flow table is read only for a dump, and its
rows are not per-CPU), the per-entry work runs inside C loops (memoryview slices, map,
zip, itertools), and flow keys are decoded only as a dump writes them. Python loops over
entries give up the GIL every YIELD_EVERY of them.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
import struct
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain, compress, repeat
from operator import add, and_, itemgetter, not_, or_, sub, truth, xor
from typing import Any, NamedTuple

from . import abi, buckets

_V4_MAPPED = bytes(10) + b"\xff\xff"
# Entries handled between two GIL releases (about a millisecond of work), and how long to
# stay off the GIL then. sleep(0) is not enough: it releases the GIL, but on a busy machine
# this thread takes it back before the event loop's thread gets a CPU to claim it.
YIELD_EVERY = 1000
YIELD_S = 0.0005
# Entries per BPF_MAP_LOOKUP_BATCH call. One call over a whole map of 100,000 connections
# runs 37 ms in the kernel without a point where the scheduler can take the CPU back
# (CONFIG_PREEMPT_NONE, the default of server kernels): a thread woken on that CPU, the
# event loop's, waits for it to end. 4096 entries take about 1.5 ms.
BATCH_STEP = 4096
# Bytes of a row's histograms (row_data) decoded as one: 16 buckets of the 4 kinds.
HIST_BLOCK = 512
# Connections whose in-flight figures are counted between two GIL releases: the longest
# C loop then holds the GIL well under a millisecond.
INFLIGHT_STEP = 4096


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


class FlowTable(Mapping[FlowKey, FlowStats]):
    """The fingerprints map as read: keys kept as read (raw map keys) and decoded on first
    use, figures kept as columns (count, lat_sum_ns, lat_max_ns, last_ns), one list of ints
    each. Columns of ints are not containers: building them gives the cyclic collector
    nothing to track, so a dump does not bring on the full collections that would stall
    the event loop."""

    def __init__(self, keys: Sequence[Hashable], columns: Sequence[Sequence[int]],
                 decode: Callable[[Any], FlowKey]) -> None:
        self._keys = keys
        self._columns = columns
        self._decode = decode
        self._decoded: dict[FlowKey, FlowStats] | None = None

    @classmethod
    def of(cls, flows: Mapping[FlowKey, FlowStats]) -> FlowTable:
        """A table of decoded flows (fakes and tests)."""
        keys = list(flows)
        return cls(keys, [[flows[k][i] for k in keys] for i in range(4)], lambda key: key)


    def rows(self) -> Iterator[tuple[FlowKey, int, int, int, int]]:
        """(key, count, lat_sum_ns, lat_max_ns, last_ns) per flow, made as they are taken:
        a dump of every flow keeps no container per flow alive."""
        decode = self._decode
        for i, (key, count, lat_sum, lat_max, last) in enumerate(zip(self._keys,
                                                                      *self._columns)):
            pause_point(i)
            yield decode(key), count, lat_sum, lat_max, last

    def _mapping(self) -> dict[FlowKey, FlowStats]:
        if self._decoded is None:
            self._decoded = {key: tuple(stats) for key, *stats in self.rows()}
        return self._decoded

    def __getitem__(self, key: FlowKey) -> FlowStats:
        return self._mapping()[key]

    def __iter__(self) -> Iterator[FlowKey]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._keys)


class PortStats(NamedTuple):
    conns_accepted: int
    conns_opened: int
    retransmits: int
    resets_sent: int
    resets_received: int


class RequestStats(NamedTuple):
    """How a (model, port, endpoint)'s requests ended, and the tokens their answers' usage
    objects reported (cumulative). Field order: lm_req_stats, outcomes as LM_OUT_*."""

    complete: int = 0
    error: int = 0
    aborted: int = 0
    truncated: int = 0
    unanswered: int = 0
    usage_answers: int = 0  # answers whose usage gave their output tokens
    usage_events: int = 0  # the data: events of those answers
    output_tokens: int = 0  # from usage
    prompt_tokens: int = 0  # from usage
    e2e_ns: int = 0  # first byte to last, summed over the answers whose end was seen
    e2e_tokens: int = 0  # the output tokens of those answers


class InFlight(NamedTuple):
    waiting: int  # request seen, no first token yet (a non-streamed one: no answer yet)
    running: int  # its answer streams, and has not ended


# (model_id, serving port, endpoint class): the unit of a model's figures.
EndpointKey = tuple[int, int, int]
# (model_id, serving port, endpoint class, kind LM_HK_*, status, bucket)
HistKey = tuple[int, int, int, int, int, int]


@dataclass(frozen=True)
class MapSnapshot:
    """Everything the probes hold, read at one moment (mono_ns, CLOCK_MONOTONIC). Kernel
    counters are cumulative since the maps were created, i.e. since the probes started.
    flows is None when the read left the flow table out (it is the one big map)."""

    mono_ns: int
    flows: FlowTable | None = field(default_factory=lambda: FlowTable.of({}))
    histograms: Mapping[HistKey, int] = field(default_factory=dict)  # -> samples
    requests: Mapping[EndpointKey, RequestStats] = field(default_factory=dict)
    models: Mapping[int, str] = field(default_factory=dict)
    errors: Mapping[str, int] = field(default_factory=dict)
    ports: Mapping[int, PortStats] = field(default_factory=dict)
    inflight: Mapping[EndpointKey, InFlight] = field(default_factory=dict)


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
    """BPF_MAP_LOOKUP_BATCH over a map into buffers kept between reads. The buffers grow to
    what a read asks for, up to the map's size: an array map read from its start (row_data:
    19 KB an entry) costs memory for the entries in use, not for all it could hold."""

    def __init__(self, lib: Any, fd: int, key_size: int, value_size: int, capacity: int,
                 *, grow: bool = False):
        self._lib = lib
        self.fd = fd
        self.key_size = key_size
        self.value_size = value_size
        self._capacity = capacity
        self._size = 0
        self._keys = self._values = ctypes.create_string_buffer(0)
        if not grow:
            self._reserve(capacity)

    def _reserve(self, entries: int) -> None:
        if entries > self._size:
            self._size = min(self._capacity, max(entries, 2 * self._size))
            self._keys = ctypes.create_string_buffer(self.key_size * self._size)
            self._values = ctypes.create_string_buffer(self.value_size * self._size)

    def read(self, limit: int | None = None) -> tuple[memoryview, memoryview, int]:
        """The map's first `limit` entries (all when None)."""
        want = self._capacity if limit is None else min(limit, self._capacity)
        self._reserve(want)
        token = ctypes.c_uint32(0)
        count = ctypes.c_uint32(0)
        total = 0
        while total < want:
            count.value = min(want - total, BATCH_STEP)
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


_Samples = list[tuple[HistKey, int]]
_Row = tuple[bytes, _Samples, list[_Samples], tuple[int, ...]]


class _Rows:
    """The model figures: `rows` names each row (model, port, endpoint, status) by its index
    in `row_data`, whose entries hold the row's outcomes, usage and histograms (lm_row).
    Both are read whole each poll, row_data from its start to the highest index in use.
    A row's histograms are decoded in blocks of HIST_BLOCK bytes (16 buckets, a power of
    two of latencies, of the four kinds), and a block only when it changed since the last
    poll: a latency's samples span a few of the 37 blocks, and most polls change a few
    buckets of a few rows."""

    def __init__(self, lib: Any, rows: Any, data: Any):
        self._key = abi.codec(rows.Key)
        self._pick = itemgetter(*(self._key.index(f)
                                  for f in ("model_id", "port", "endpoint", "status")))
        self._index = _Batch(lib, rows.map_fd, ctypes.sizeof(rows.Key), 4, rows.max_entries)
        self._data = _Batch(lib, data.map_fd, 4, ctypes.sizeof(data.Leaf), data.max_entries,
                            grow=True)
        leaf = data.Leaf
        types = {name: ctype for name, ctype, *_ in leaf._fields_}
        req = abi.codec(types["req"])
        if len(req.fields) != len(RequestStats._fields):
            raise TypeError("lm_req_stats: RequestStats does not match its fields")
        self._req = req.struct
        self._req_at = leaf.req.offset
        self._kinds = abi.const("LM_HK_COUNT")
        hist_bytes = ctypes.sizeof(types["hist"])
        if hist_bytes != 8 * self._kinds * buckets.N_BUCKETS or hist_bytes % HIST_BLOCK:
            raise TypeError("lm_row.hist: not LM_HK_COUNT histograms of buckets.N_BUCKETS")
        self._blocks = [(at, at + HIST_BLOCK) for at in range(
            leaf.hist.offset, leaf.hist.offset + hist_bytes, HIST_BLOCK)]
        self._row_bytes = ctypes.sizeof(leaf)
        self._zero_row = bytes(self._row_bytes)
        # index -> its bytes at the last poll, its samples, the same by block, its
        # lm_req_stats
        self._seen: dict[int, _Row] = {}

    def read(self) -> tuple[dict[HistKey, int], dict[EndpointKey, RequestStats]]:
        keys, values, n = self._index.read()
        named = dict(zip(values.cast("B").cast("I")[:n], map(self._pick,
                                                             self._key.struct.iter_unpack(keys))))
        hist: dict[HistKey, int] = {}
        requests: dict[EndpointKey, tuple[int, ...]] = {}
        if not named:
            return hist, {}
        _, data, m = self._data.read(max(named) + 1)
        size = self._row_bytes
        for i, key in named.items():
            if i >= m:
                continue
            raw = data[i * size:(i + 1) * size].tobytes()
            seen = self._seen.get(i)
            if seen is None or seen[0] != raw:
                seen = self._decode(raw, key, seen)
                self._seen[i] = seen
            hist.update(seen[1])
            if any(seen[3]):
                ekey = key[:3]
                have = requests.get(ekey)
                requests[ekey] = seen[3] if have is None else tuple(map(add, have, seen[3]))
        return hist, {k: RequestStats(*v) for k, v in requests.items()}

    def _decode(self, raw: bytes, key: tuple[int, int, int, int], seen: _Row | None) -> _Row:
        old, old_blocks = (self._zero_row, None) if seen is None else (seen[0], seen[2])
        model, port, endpoint, status = key
        kinds = self._kinds
        first_at = self._blocks[0][0]
        blocks = []
        for j, (a, b) in enumerate(self._blocks):
            part = raw[a:b]
            if part == old[a:b]:
                blocks.append(old_blocks[j] if old_blocks else [])
                continue
            counts = memoryview(part).cast("Q")
            first = (a - first_at) // 8
            blocks.append([((model, port, endpoint, x % kinds, status, x // kinds),
                            counts[x - first])
                           for x in compress(range(first, first + len(counts)), counts)])
        return raw, list(chain.from_iterable(blocks)), blocks, self._req.unpack_from(
            raw, self._req_at)


class MapReader:
    """Decodes the maps of one compiled probe set (a bcc.BPF)."""

    def __init__(self, bpf: Any, lib: Any):
        self._bpf = bpf
        self._lib = lib
        fp = bpf[b"fingerprints"]
        self._fp_key = abi.codec(fp.Key)
        self._fp_cols = [_Column.of(fp.Leaf, name)
                         for name in ("count", "lat_sum_ns", "lat_max_ns", "last_ns")]
        self._fp = _Batch(lib, fp.map_fd, ctypes.sizeof(fp.Key), ctypes.sizeof(fp.Leaf), fp.max_entries)
        # Decoded keys of the flows seen lately (most flows live for many polls), emptied
        # when it outgrows the map. A plain dict of tuples of bytes and ints: the collector
        # stops tracking those, where lru_cache would keep a tracked list per entry, and
        # each full collection walks every tracked object while this thread holds the GIL.
        self._flow_keys: dict[bytes, FlowKey] = {}
        self._flow_keys_max = fp.max_entries
        self._flow_key_of = itemgetter(*(self._fp_key.index(f) for f in (
            "flow.client", "flow.client_port", "flow.server", "flow.server_port", "model_id",
            "status")))
        self._rows = _Rows(lib, bpf[b"rows"], bpf[b"row_data"])
        infl = bpf[b"inflight"]
        self._infl_key = abi.codec(infl.Key)
        self._infl_val = abi.codec(infl.Leaf)
        self._infl = _Batch(lib, infl.map_fd, ctypes.sizeof(infl.Key),
                            ctypes.sizeof(infl.Leaf), infl.max_entries)
        self._depth = abi.const("LM_PIPE_DEPTH")
        self._error_names = abi.error_names()
        self._infl_cols = {name: _Column.of(infl.Leaf, name)
                           for name in ("head", "tail", "overflow", "ans_model", "aflags", "ans_ep")}
        self._infl_port = _Column.of(infl.Key, "server_port")
        self._pending_cols = [_Column.of(infl.Leaf, name) for name in (
            "fp_count", "fp_lat_sum", "fp_lat_max", "fp_last", "fp_model", "fp_status")]
        # a row's key as lm_fp_key lays it out: the connection's key, model_id, status
        self._pending_key = struct.Struct(
            f"={ctypes.sizeof(infl.Key)}sQH{ctypes.sizeof(fp.Key) - fp.Key.status.offset - 2}x")
        if (fp.Key.model_id.offset, fp.Key.status.offset) != (ctypes.sizeof(infl.Key),
                                                             ctypes.sizeof(infl.Key) + 8):
            raise TypeError("lm_fp_key: not (lm_flow, model_id, status) in that order")
        self._active = abi.const("LM_A_ACTIVE")
        self._streams = abi.const("LM_A_SSE")
        self._first = abi.const("LM_A_FIRST")

    def read(self, with_flows: bool = True) -> MapSnapshot:
        """Every map; with_flows False leaves out the flow table, the only map whose read
        grows with the number of connections (a poll leaves it out; a dump reads it)."""
        mono = time.monotonic_ns()
        histograms, requests = self._rows.read()
        return MapSnapshot(
            mono_ns=mono,
            flows=self.flows() if with_flows else None,
            histograms=histograms,
            requests=requests,
            models=self.models(),
            errors=self.errors(),
            ports=self.ports(),
            inflight=self.inflight(),
        )

    def flows(self, since_ns: int = 0) -> FlowTable:
        """The rows last answered at or after since_ns (CLOCK_MONOTONIC), read a thousand
        at a time between GIL releases: at 100,000 rows any one step over all of them
        holds the GIL for milliseconds. A live connection's latest run of like answers is
        still in its state (lm_flow_state.fp_*), read after the map and added to its row:
        a run that moves into the map between the two reads is missed by this dump, never
        counted twice."""
        keys, values, n = self._fp.read()
        pending = self._pending()
        ks = self._fp.key_size
        split: list[bytes] = []
        columns: list[list[int]] = [[] for _ in self._fp_cols]
        for start in range(0, n, YIELD_EVERY):
            end = min(n, start + YIELD_EVERY)
            raw = keys[start * ks:end * ks].tobytes()
            rows = [raw[i:i + ks] for i in range(0, len(raw), ks)]
            figures = [col.read(values, start, end) for col in self._fp_cols]
            if pending:
                for i in [i for i, key in enumerate(rows) if key in pending]:
                    _add_row(figures, i, pending.pop(rows[i]))
            keep = list(map(since_ns.__le__, figures[-1]))
            split += compress(rows, keep)
            for column, figure in zip(columns, figures):
                column += compress(figure, keep)
            pause_point(YIELD_EVERY - 1)
        for j, (key, figure) in enumerate(pending.items()):
            if figure[-1] >= since_ns:
                split.append(key)
                for column, v in zip(columns, figure):
                    column.append(v)
            pause_point(j)
        return FlowTable(split, columns, self._decode_flow)

    def _pending(self) -> dict[bytes, tuple[int, int, int, int]]:
        """The rows live connections hold in their state, by lm_fp_key: (count,
        lat_sum_ns, lat_max_ns, last_ns)."""
        keys, values, n = self._infl.read()
        ks = self._infl.key_size
        out: dict[bytes, tuple[int, int, int, int]] = {}
        for start in range(0, n, YIELD_EVERY):
            end = min(n, start + YIELD_EVERY)
            count, lat_sum, lat_max, last, model, status = (
                col.read(values, start, end) for col in self._pending_cols)
            for i in compress(range(end - start), count):
                at = (start + i) * ks
                key = self._pending_key.pack(keys[at:at + ks].tobytes(), model[i], status[i])
                out[key] = (count[i], lat_sum[i], lat_max[i], last[i])
            if end < n:
                time.sleep(YIELD_S)
        return out

    def _decode_flow(self, raw: bytes) -> FlowKey:
        key = self._flow_keys.get(raw)
        if key is None:
            if len(self._flow_keys) >= self._flow_keys_max:
                self._flow_keys = {}
            key = self._flow_key_of(self._fp_key.struct.unpack(raw))
            self._flow_keys[raw] = key
        return key

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

    def inflight(self) -> dict[EndpointKey, InFlight]:
        """Requests outstanding per (model, serving port, endpoint): the one being answered
        is running once its answer streams tokens (or, not streamed, has begun), the others
        wait. Model 0: unknown yet, or none. Every connection is read each poll, in steps
        of INFLIGHT_STEP between GIL releases, by passes of C loops over field columns
        (about 0.3 µs a connection); only a connection with more than one request
        outstanding is decoded in Python."""
        keys, values, n = self._infl.read()
        counts: dict[EndpointKey, list[int]] = {}
        for start in range(0, n, INFLIGHT_STEP):
            if start:
                time.sleep(YIELD_S)
            self._count_inflight(keys, values, start, min(n, start + INFLIGHT_STEP), counts)
        return {key: InFlight(*n) for key, n in counts.items()}

    def _count_inflight(self, keys: memoryview, values: memoryview, a: int, b: int,
                        counts: dict[EndpointKey, list[int]]) -> None:
        def col(name: str) -> list[int]:
            return self._infl_cols[name].read(values, a, b)

        heads, tails, overs = col("head"), col("tail"), col("overflow")
        depth = list(map(and_, map(sub, tails, heads), repeat(0xFFFFFFFF)))
        # 0 where exactly one request is outstanding, in the ring (nearly every busy
        # connection): the kernel keeps its model and endpoint in ans_model and ans_ep
        not_one = list(map(or_, map(xor, depth, repeat(1)), overs))
        one = list(map(not_, not_one))
        if any(one):
            bits = self._active | self._streams | self._first
            ports = self._infl_port.read(keys, a, b)
            tally = Counter(zip(compress(col("ans_model"), one), compress(ports, one),
                                compress(col("ans_ep"), one),
                                map(and_, compress(col("aflags"), one), repeat(bits))))
            for (model, port, ep, flags), n in tally.items():
                counts.setdefault((model, port, ep), [0, 0])[self._running(flags)] += n
        several = map(and_, map(truth, not_one), map(truth, map(or_, depth, overs)))
        for i in compress(range(a, b), several):
            self._count_queue(keys, values, i, counts)

    def _running(self, flags: int) -> int:
        """1 when the answer being sent makes its request running: streaming tokens, or
        begun when not streamed."""
        return int(bool(flags & self._active) and
                   (not flags & self._streams or bool(flags & self._first)))

    def _count_queue(self, keys: memoryview, values: memoryview, i: int,
                     counts: dict[EndpointKey, list[int]]) -> None:
        """One connection with several requests outstanding, or some beyond the ring."""
        vc = self._infl_val
        v = vc.struct.unpack_from(values, i * vc.struct.size)
        head, tail, over = (v[vc.index(f)] for f in ("head", "tail", "overflow"))
        flags = v[vc.index("aflags")]
        (port,) = self._infl_port.read(keys, i, i + 1)
        eps = v[vc.index("ep")]
        mask = self._depth - 1
        queued = [(v[vc.index(f"ring.{pos & mask}.model_id")], port, eps[pos & mask])
                  for pos in range(head, head + min((tail - head) & 0xFFFFFFFF, self._depth))]
        queued += [(0, port, 0)] * over
        if flags & self._active and queued:
            queued.pop(0)
            key = (v[vc.index("ans_model")], port, v[vc.index("ans_ep")])
            counts.setdefault(key, [0, 0])[self._running(flags)] += 1
        for key in queued:
            counts.setdefault(key, [0, 0])[0] += 1


def _add_row(figures: list[list[int]], i: int, more: tuple[int, int, int, int]) -> None:
    """Adds a flow's (count, lat_sum_ns, lat_max_ns, last_ns) to row i of figures."""
    figures[0][i] += more[0]
    figures[1][i] += more[1]
    figures[2][i] = max(figures[2][i], more[2])
    figures[3][i] = max(figures[3][i], more[3])


@dataclass(frozen=True)
class _Column:
    """One integer field of every record in a buffer of fixed-size records, read as a list
    by one slice of a typed memoryview (a C loop, whatever the number of records)."""

    record: int  # record size, bytes
    offset: int  # the field's, bytes
    code: str  # struct code of its width

    @classmethod
    def of(cls, ctype: type, name: str) -> _Column:
        field = getattr(ctype, name)
        code = {1: "B", 2: "H", 4: "I", 8: "Q"}[field.size]
        record = ctypes.sizeof(ctype)
        if field.offset % field.size or record % field.size:
            raise TypeError(f"{ctype.__name__}.{name}: not aligned to its size")
        return cls(record, field.offset, code)

    def read(self, buf: memoryview, a: int, b: int) -> list[int]:
        """The field of records a to b - 1."""
        width = struct.calcsize(self.code)
        view = buf.cast("B").cast(self.code)
        step = self.record // width
        return view[(a * self.record + self.offset) // width:b * step:step].tolist()
