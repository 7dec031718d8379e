import math
import subprocess
import sys
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadmesh.gossip.snapshot import (
    DIGITS,
    MAX_ENCODED_BYTES,
    MAX_GPUS,
    MAX_MODELS,
    MAX_SESSION_MODELS,
    MAX_SESSIONS,
    Endpoint,
    GpuLoad,
    HostLoad,
    LoadSnapshot,
    ModelLoad,
    NodeState,
    SessionRates,
    SnapshotError,
    decode,
    encode,
)

# --- strategies ------------------------------------------------------------------------

def _text(max_bytes: int) -> st.SearchStrategy[str]:
    return st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=max_bytes).filter(
        lambda s: len(s.encode()) <= max_bytes
    )


def _num(hi: float) -> st.SearchStrategy[float]:
    return st.floats(0, hi, allow_nan=False)


endpoints = st.builds(Endpoint, host=_text(253), port=st.integers(1, 65535))
hosts = st.builds(
    HostLoad,
    cpu_util=_num(1),
    mem_used_mib=st.integers(0, 2**32 - 1),
    mem_total_mib=st.integers(0, 2**32 - 1),
    load1=_num(100_000),
    cpu_pressure_pct=st.none() | _num(100),
)
gpus = st.builds(
    GpuLoad,
    index=st.integers(0, 255),
    util_pct=st.integers(0, 100),
    mem_used_mib=st.integers(0, 2**32 - 1),
    mem_total_mib=st.integers(0, 2**32 - 1),
    temp_c=st.integers(0, 255),
    power_w=st.integers(0, 65535),
    power_limit_w=st.integers(0, 65535),
    throttle_reasons=st.integers(0, 2**64 - 1),
    processes=st.integers(0, 65535),
    healthy=st.booleans(),
)
models = st.builds(
    ModelLoad,
    model_id=st.integers(0, 2**64 - 1),
    port=st.integers(1, 65535),
    rps=_num(1e7),
    error_ratio=_num(1),
    p50_ms=_num(3.6e6),
    p99_ms=_num(3.6e6),
    in_flight=st.integers(0, 2**32 - 1),
    waiting=st.integers(0, 2**32 - 1),
    running=st.integers(0, 2**32 - 1),
    ttft_p99_ms=_num(3.6e6),
    itl_p99_ms=_num(3.6e6),
    tokens_per_s=_num(1e8),
)
session_rates = st.builds(
    SessionRates,
    model_id=st.integers(0, 2**64 - 1),
    sessions=st.lists(st.tuples(st.integers(0, 2**32 - 1), _num(1e7)), max_size=MAX_SESSIONS,
                      unique_by=lambda pair: pair[0]),
    routed_rps=_num(1e7),
)
snapshots = st.builds(
    LoadSnapshot,
    node_id=_text(128),
    endpoints=st.lists(endpoints, max_size=16, unique_by=lambda e: (e.host, e.port)),
    version=st.integers(0, 2**63 - 1),
    timestamp_ms=st.integers(0, 2**63 - 1),
    state=st.sampled_from(NodeState),
    score=_num(1),
    host=hosts,
    gpus=st.lists(gpus, max_size=MAX_GPUS, unique_by=lambda g: g.index),
    models=st.lists(models, max_size=MAX_MODELS, unique_by=lambda m: m.key),
    sessions=st.lists(session_rates, max_size=MAX_SESSION_MODELS, unique_by=lambda k: k.model_id),
)


def typical(n_gpus: int = 8, n_models: int = 4, n_sessions: int = 0) -> LoadSnapshot:
    """A busy 8-GPU host serving 4 models on 4 ports, each figure as wide on the wire as
    it gets in practice: millisecond clocks, 140 GB GPUs, 2 TB of RAM, 64-bit model ids;
    with n_sessions, that many sessions' rates per model."""
    return LoadSnapshot(
        node_id="gpu-node-0042.dc1.example.net",
        endpoints=[Endpoint("10.120.33.142", 8000 + i) for i in range(n_models)],
        version=1_764_500_000_123,
        timestamp_ms=1_764_500_123_456,
        state=NodeState.DEGRADED,
        score=0.7345,
        host=HostLoad(cpu_util=0.4567, mem_used_mib=1_500_000, mem_total_mib=2_063_000, load1=123.45,
                      cpu_pressure_pct=12.34),
        gpus=[GpuLoad(i, 97, 140_000, 143_771, 83, 699, 700, 0x44, 3, True) for i in range(n_gpus)],
        models=[
            ModelLoad(0xCBF29CE484222325 ^ (i * 0x100000001B3), 8000 + i, 1234.56, 0.0123, 812.3,
                      9876.5, 345, waiting=120, running=225, ttft_p99_ms=3456.7, itl_p99_ms=45.6,
                      tokens_per_s=5432.1)
            for i in range(n_models)
        ],
        sessions=[SessionRates(0xCBF29CE484222325 ^ (i * 0x100000001B3),
                               [(0x9E3779B9 * (j + 1) % 2**32, 12.3 / (j + 1)) for j in range(n_sessions)],
                               routed_rps=1234.56)
                  for i in range(n_models if n_sessions else 0)],
    )


def wire(snap: LoadSnapshot) -> dict:
    return msgpack.unpackb(encode(snap), raw=False)


def pack(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# --- round trip and size ---------------------------------------------------------------

@settings(max_examples=300)
@given(snapshots)
def test_round_trip(snap: LoadSnapshot) -> None:
    data = encode(snap)
    assert decode(data) == snap
    assert encode(decode(data)) == data
    # Figures are held quantized: building the snapshot again from them changes nothing.
    again = replace(snap, host=replace(snap.host), gpus=[replace(g) for g in snap.gpus],
                    models=[replace(m) for m in snap.models], sessions=[replace(k) for k in snap.sessions])
    assert again == snap
    assert encode(again) == data


def test_eight_gpus_four_models_fit_576_bytes() -> None:
    size = len(encode(typical()))
    print(f"8 GPU / 4 model snapshot: {size} bytes")
    assert size <= 576


def test_largest_possible_snapshot_fits_decoder_limit() -> None:
    biggest = LoadSnapshot(
        node_id="n" * 128,
        endpoints=[Endpoint("h" * 253, 65535 - i) for i in range(16)],
        version=2**63 - 1,
        timestamp_ms=2**63 - 1,
        state=NodeState.OVERLOADED,
        score=1.0,
        host=HostLoad(1.0, 2**32 - 1, 2**32 - 1, 100_000.0, 100.0),
        gpus=[
            GpuLoad(255 - i, 100, 2**32 - 1, 2**32 - 1, 255, 65535, 65535, 2**64 - 1, 65535, True) for i in range(16)
        ],
        models=[ModelLoad(2**64 - 1 - i, 65535, 1e7, 1.0, 3.6e6, 3.6e6, 2**32 - 1, 2**32 - 1,
                          2**32 - 1, 3.6e6, 3.6e6, 1e8) for i in range(64)],
        sessions=[SessionRates(2**64 - 1 - i, [(2**32 - 1 - j, 1e7) for j in range(MAX_SESSIONS)], 1e7)
                  for i in range(MAX_SESSION_MODELS)],
    )
    data = encode(biggest)
    assert len(data) <= MAX_ENCODED_BYTES
    assert decode(data) == biggest


def test_figures_are_held_at_wire_resolution() -> None:
    m = ModelLoad(1, 8000, rps=12.3456, error_ratio=0.012345, p50_ms=10.04, p99_ms=1234.56, in_flight=1234,
                  running=999)
    # Three significant digits, and 1/100 rps, 0.1 ms, one request below them.
    assert (m.rps, m.error_ratio, m.p50_ms, m.p99_ms, m.in_flight, m.running) == (
        12.3, 0.0123, 10.0, 1230.0, 1230, 999)
    g = GpuLoad(0, 97, 140_051, 143_771, 83, 699, 700, 0, 1, True)
    assert (g.mem_used_mib, g.mem_total_mib, g.power_w, g.power_limit_w) == (140_000, 144_000, 699, 700)
    h = HostLoad(cpu_util=0.4567, mem_used_mib=1_500_000, mem_total_mib=2_063_000, load1=123.45,
                 cpu_pressure_pct=12.34)
    assert (h.cpu_util, h.mem_used_mib, h.mem_total_mib, h.load1, h.cpu_pressure_pct) == (
        0.46, 1_500_000, 2_060_000, 123.0, 12.0)
    assert replace(typical(), score=0.73456).score == 0.735


# Every field held to DIGITS significant digits: its record, name, units per 1, bound,
# and whether it is an integer.
LOG_FIELDS = [
    (ModelLoad, name, scale, hi, scale == 1)
    for name, scale, hi in (("rps", 100, 1e7), ("p50_ms", 10, 3.6e6), ("p99_ms", 10, 3.6e6),
                            ("ttft_p99_ms", 10, 3.6e6), ("itl_p99_ms", 10, 3.6e6), ("pace_ms", 10, 3.6e6),
                            ("tokens_per_s", 10, 1e8), ("in_flight", 1, 2**32 - 1),
                            ("waiting", 1, 2**32 - 1), ("running", 1, 2**32 - 1))
] + [
    (GpuLoad, "mem_used_mib", 1, 2**32 - 1, True),
    (GpuLoad, "mem_total_mib", 1, 2**32 - 1, True),
    (GpuLoad, "power_w", 1, 65535, True),
    (GpuLoad, "power_limit_w", 1, 65535, True),
    (HostLoad, "mem_used_mib", 1, 2**32 - 1, True),
    (HostLoad, "mem_total_mib", 1, 2**32 - 1, True),
    (HostLoad, "load1", 10, 100_000, False),
]


def _held(cls: type, name: str, value: float) -> float:
    """value as a record of cls holds it in field `name`."""
    base = {ModelLoad: ModelLoad(1, 8000, 0, 0, 0, 0, 0),
            GpuLoad: GpuLoad(0, 0, 0, 0, 0, 0, 0, 0, 0, True),
            HostLoad: HostLoad(0, 0, 0, 0, None)}[cls]
    return getattr(replace(base, **{name: value}), name)


@settings(max_examples=400)
@given(st.sampled_from(LOG_FIELDS), st.data())
def test_log_scale_figures_keep_their_precision(field: tuple, data: st.DataObject) -> None:
    cls, name, scale, hi, integral = field
    draw = st.integers(0, int(hi)) if integral else st.floats(0, hi, allow_nan=False)
    x, y = sorted((data.draw(draw), data.draw(draw)))
    qx, qy = _held(cls, name, x), _held(cls, name, y)
    # Within half a unit of the scale, or half a unit of the last kept digit (at most
    # 1/200 of the figure).
    assert abs(qx - x) <= max(0.5 / scale, x / 200) * (1 + 1e-9)
    assert 0 <= qx <= hi
    assert _held(cls, name, qx) == qx  # quantizing is idempotent
    assert qx <= qy  # and keeps the order, so used <= total stays true


@given(st.sampled_from(LOG_FIELDS), st.integers(1, 10**DIGITS - 1), st.integers(0, 6))
def test_round_figures_stay_exact(field: tuple, mantissa: int, exponent: int) -> None:
    cls, name, scale, hi, integral = field
    count = mantissa * 10**exponent
    value = count if integral else count / scale
    if value <= hi:
        assert _held(cls, name, value) == value


def test_records_are_sorted_so_equal_content_encodes_equal() -> None:
    snap = typical()
    shuffled = replace(snap, gpus=snap.gpus[::-1], models=snap.models[::-1], endpoints=snap.endpoints[::-1])
    assert shuffled == snap
    assert encode(shuffled) == encode(snap)


# --- forward compatibility ---------------------------------------------------------------

def test_newer_writer_extra_keys_and_trailing_fields_are_ignored() -> None:
    snap = typical()
    w = wire(snap)
    w["zz"] = {"a future": ["field", 1.5]}
    w["h"].append("future host field")
    for record in w["g"] + w["m"] + w["e"]:
        record.extend([7, "x"])
    assert decode(pack(w)) == snap


def test_a_record_cut_short_is_refused() -> None:
    # Format 2 has no older writer: every record carries all its fields.
    w = wire(typical())
    del w["m"][0][14:]
    with pytest.raises(SnapshotError, match="14 elements, need 15"):
        decode(pack(w))


def test_largest_code_decodes_and_the_next_is_refused() -> None:
    # 65535 W is held as 65500 W: code 1000 + 900 (the decade of 1000..9990) + 655 - 100.
    w = wire(typical())
    w["g"][0][5] = 2455
    assert decode(pack(w)).gpus[0].power_w == 65_500
    w["g"][0][5] = 2456
    with pytest.raises(SnapshotError, match="code 2456 outside 0..2455"):
        decode(pack(w))


@pytest.mark.parametrize("field", LOG_FIELDS, ids=[f"{f[0].__name__}.{f[1]}" for f in LOG_FIELDS])
def test_no_figure_rounds_past_its_bound(field: tuple) -> None:
    cls, name, scale, hi, integral = field
    assert _held(cls, name, hi) <= hi


# --- rejection -------------------------------------------------------------------------

def _mutated(mutate) -> bytes:
    w = wire(typical())
    mutate(w)
    return pack(w)


BAD = {
    "format 1, before quantization": lambda w: w.update(f=1),
    "unknown format version": lambda w: w.update(f=3),
    "format version as a string": lambda w: w.update(f="1"),
    "missing key": lambda w: w.pop("v"),
    "unknown state": lambda w: w.update(s=9),
    "NaN score": lambda w: w.update(l=math.nan),
    "float where an int goes": lambda w: w.update(v=1.0),
    "bool where an int goes": lambda w: w["g"][0].__setitem__(1, True),
    "score above 1": lambda w: w.update(l=10_001),
    "negative version": lambda w: w.update(v=-1),
    "version past 2**63": lambda w: w.update(v=2**63),
    "util above 100": lambda w: w["g"][0].__setitem__(1, 101),
    "error ratio above 1": lambda w: w["m"][0].__setitem__(3, 10_001),
    "log code past the bound": lambda w: w["m"][0].__setitem__(2, 2**64 - 1),
    "negative log code": lambda w: w["m"][0].__setitem__(4, -1),
    "float log code": lambda w: w["m"][0].__setitem__(4, 1.0),
    "score as 1/10000": lambda w: w.update(l=7345),
    "port 0": lambda w: w["m"][0].__setitem__(1, 0),
    "node_id too long": lambda w: w.update(n="x" * 129),
    "empty node_id": lambda w: w.update(n=""),
    "node_id as bytes": lambda w: w.update(n=b"node"),
    "too many GPUs": lambda w: w.update(g=[[i, *w["g"][0][1:]] for i in range(MAX_GPUS + 1)]),
    "too many models": lambda w: w.update(m=[[i, *w["m"][0][1:]] for i in range(MAX_MODELS + 1)]),
    "duplicate GPU index": lambda w: w["g"][1].__setitem__(0, w["g"][0][0]),
    "duplicate model": lambda w: w["m"].append(list(w["m"][0])),
    "short GPU record": lambda w: w["g"][0].pop(),
    "host as a map": lambda w: w.update(h={"c": 1}),
    "GPUs as a map": lambda w: w.update(g={}),
    "only unknown keys": lambda w: (w.clear(), w.update(x=1)),
    "sessions as a map": lambda w: w.update(k={}),
    "too many sessions' models": lambda w: w.update(k=[[i, 1, 1] for i in range(MAX_SESSION_MODELS + 1)]),
    "too many sessions": lambda w: w.update(k=[[1, *range(2 * MAX_SESSIONS + 2)]]),
    "duplicate session": lambda w: w.update(k=[[1, 5, 1, 5, 2]]),
    "duplicate sessions' model": lambda w: w.update(k=[[1, 5, 1], [1, 6, 1]]),
    "session key past 32 bits": lambda w: w.update(k=[[1, 2**32, 1]]),
    "session without its rate": lambda w: w.update(k=[[1, 5]]),
    "session rate as a float": lambda w: w.update(k=[[1, 5, 1.5]]),
    "routed rate of a model without sessions": lambda w: w.update(k=[[1, 5, 1]], q=[[2, 10]]),
    "routed rate named twice": lambda w: w.update(k=[[1, 5, 1]], q=[[1, 10], [1, 11]]),
    "routed rate without its figure": lambda w: w.update(k=[[1, 5, 1]], q=[[1]]),
    "routed rates as a map": lambda w: w.update(k=[[1, 5, 1]], q={1: 10}),
    "routed rate past its bound": lambda w: w.update(k=[[1, 5, 1]], q=[[1, 2**64 - 1]]),
}


@pytest.mark.parametrize("mutate", BAD.values(), ids=BAD.keys())
def test_rejects_invalid_content(mutate) -> None:
    with pytest.raises(SnapshotError):
        decode(_mutated(mutate))


def test_the_routed_rates_travel_beside_the_sessions_and_an_older_writer_has_none() -> None:
    snap = typical(n_models=2, n_sessions=3)
    top = wire(snap)
    assert [pair[0] for pair in top["q"]] == [k.model_id for k in snap.sessions]
    assert [k.routed_rps for k in decode(encode(snap)).sessions] == [1200.0, 1200.0]  # two digits
    # Future fields past the two of a pair are skipped, as in any record.
    top["q"] = [[*pair, 7] for pair in top["q"]]
    assert decode(pack(top)) == snap
    del top["q"]
    assert [k.routed_rps for k in decode(pack(top)).sessions] == [0.0, 0.0]
    # None routed (all 0): the key is left out.
    assert "q" not in wire(replace(snap, sessions=[replace(k, routed_rps=0.0) for k in snap.sessions]))


def test_a_duplicate_names_the_field_it_is_in() -> None:
    with pytest.raises(SnapshotError, match=r"^SessionRates\.sessions: duplicate 5$"):
        decode(_mutated(BAD["duplicate session"]))
    with pytest.raises(SnapshotError, match=r"^LoadSnapshot\.sessions: duplicate 1$"):
        decode(_mutated(BAD["duplicate sessions' model"]))
    with pytest.raises(SnapshotError, match=r"^LoadSnapshot\.models: duplicate "):
        decode(_mutated(BAD["duplicate model"]))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        encode(typical()) + b"\x00",
        encode(typical())[:-1],
        pack([1, 2]),
        b"\xff" * (MAX_ENCODED_BYTES + 1),
    ],
    ids=["empty", "reserved byte", "trailing byte", "truncated", "not a map", "too long"],
)
def test_rejects_malformed_bytes(data: bytes) -> None:
    with pytest.raises(SnapshotError):
        decode(data)


_RAW_LEAF = (st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats(allow_nan=True)
             | st.text(max_size=4) | st.lists(st.integers(0, 9), max_size=2))


@settings(max_examples=600)
@given(st.sampled_from([Endpoint, HostLoad, GpuLoad, ModelLoad]), st.data())
def test_a_record_read_from_the_wire_is_one_its_constructor_accepts_unchanged(cls, data) -> None:
    # from_wire checks each field once, as it decodes it, and makes the record without
    # __post_init__: whatever it lets through, the constructor's checks and quantizing
    # must let through unchanged.
    raw = data.draw(st.lists(_RAW_LEAF, min_size=len(cls._FIELDS), max_size=len(cls._FIELDS) + 1))
    for i, spec in enumerate(cls._FIELDS):  # near each field's range as often as not
        if spec.kind != "str" and data.draw(st.booleans()):
            raw[i] = data.draw(st.integers(0, max(int(spec.hi * spec.scale), spec.max_code) + 2))
    try:
        record = cls.from_wire(raw)
    except SnapshotError:
        return
    assert replace(record) == record


def _by_field(cls: type, raw: list) -> object:
    """What each field's decoder makes of raw: the reference that from_wire's straight-line
    reader must match, value for value and error for error."""
    try:
        return {s.name: s.decoder(v, cls.__name__) for s, v in zip(cls._FIELDS, raw, strict=False)}
    except SnapshotError as e:
        return str(e)


@settings(max_examples=1500)
@given(st.sampled_from([Endpoint, HostLoad, GpuLoad, ModelLoad]), st.data())
def test_the_straight_line_reader_reads_as_the_field_decoders_do(cls, data) -> None:
    raw = data.draw(st.lists(_RAW_LEAF, min_size=len(cls._FIELDS), max_size=len(cls._FIELDS) + 1))
    for i, spec in enumerate(cls._FIELDS):  # each field at and around its bounds too
        if spec.kind != "str" and data.draw(st.booleans()):
            top = max(int(spec.hi * spec.scale), spec.max_code)
            raw[i] = data.draw(st.sampled_from([0, top, top + 1, -1, True, None, 0.5])
                               | st.integers(0, top + 2))
    try:
        got: object = cls.from_wire(raw).__dict__
    except SnapshotError as e:
        got = str(e)
    expected = _by_field(cls, raw)
    assert got == expected
    if isinstance(expected, dict):  # 1 == 1.0 == True: the types must match too
        assert [type(v) for v in got.values()] == [type(v) for v in expected.values()]  # type: ignore[union-attr]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.5])
def test_local_construction_is_checked_too(bad: float) -> None:
    with pytest.raises(SnapshotError):
        ModelLoad(1, 8000, rps=bad, error_ratio=0, p50_ms=0, p99_ms=0, in_flight=0)
    with pytest.raises(SnapshotError):
        replace(typical(), score=bad)
    with pytest.raises(SnapshotError):
        replace(typical(), node_id="\udc80")


def _decodes_cleanly(data: bytes) -> None:
    try:
        snap = decode(data)
    except SnapshotError:
        return
    assert isinstance(snap, LoadSnapshot)
    assert decode(encode(snap)) == snap


@settings(max_examples=500)
@given(st.binary(max_size=600))
def test_any_bytes_decode_cleanly(data: bytes) -> None:
    _decodes_cleanly(data)


@settings(max_examples=500)
@given(st.data())
def test_corrupted_snapshots_decode_cleanly(data: st.DataObject) -> None:
    raw = bytearray(encode(typical(n_sessions=data.draw(st.sampled_from([0, 8])))))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    _decodes_cleanly(bytes(raw[: data.draw(st.integers(0, len(raw)))]))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=2), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400)
@given(st.data())
def test_junk_in_any_field_decodes_cleanly(data: st.DataObject) -> None:
    # Junk goes into slots of a valid wire map, at any depth, so that it reaches each
    # field's checks instead of failing at the first structural one.
    w = wire(typical(data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))))
    for _ in range(data.draw(st.integers(1, 3))):
        slot: dict | list = w
        key: object = data.draw(st.sampled_from(sorted(w)))
        while isinstance(slot[key], list) and slot[key] and data.draw(st.booleans()):
            slot, key = slot[key], data.draw(st.integers(0, len(slot[key]) - 1))
        slot[key] = data.draw(msgpack_values)
    _decodes_cleanly(pack(w))


def test_gossip_does_not_import_daemon_or_probes() -> None:
    code = (
        "import sys, loadmesh.gossip.snapshot; "
        "bad = [m for m in sys.modules if m.split('.')[:2] in (['loadmesh', 'daemon'], "
        "['loadmesh', 'probes'])]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
