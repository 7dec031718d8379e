import math
import subprocess
import sys
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadmesh.gossip.snapshot import (
    MAX_ENCODED_BYTES,
    MAX_GPUS,
    MAX_MODELS,
    Endpoint,
    GpuLoad,
    HostLoad,
    LoadSnapshot,
    ModelLoad,
    NodeState,
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
)


def typical(n_gpus: int = 8, n_models: int = 4) -> LoadSnapshot:
    """A busy 8-GPU host serving 4 models on 4 ports, each figure as wide on the wire as
    it gets in practice: millisecond clocks, 140 GB GPUs, 2 TB of RAM, 64-bit model ids."""
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
    )
    data = encode(biggest)
    assert len(data) <= MAX_ENCODED_BYTES
    assert decode(data) == biggest


def test_figures_are_held_at_wire_resolution() -> None:
    m = ModelLoad(1, 8000, rps=12.3456, error_ratio=0.012345, p50_ms=10.04, p99_ms=123.456, in_flight=3)
    assert (m.rps, m.error_ratio, m.p50_ms, m.p99_ms) == (12.35, 0.0123, 10.0, 123.5)


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


def test_older_writer_without_the_llm_figures_reads_as_zeros() -> None:
    """An agent from before the LLM figures sends 7-element model records."""
    snap = typical()
    w = wire(snap)
    for record in w["m"]:
        del record[7:]
    old = decode(pack(w))
    assert [(m.waiting, m.running, m.ttft_p99_ms, m.itl_p99_ms, m.tokens_per_s)
            for m in old.models] == [(0, 0, 0.0, 0.0, 0.0)] * len(snap.models)
    assert [(m.model_id, m.in_flight) for m in old.models] == [
        (m.model_id, m.in_flight) for m in snap.models]


def test_a_model_record_cut_before_the_original_fields_is_refused() -> None:
    w = wire(typical())
    del w["m"][0][6:]
    with pytest.raises(SnapshotError, match="6 elements, need 7"):
        decode(pack(w))


# --- rejection -------------------------------------------------------------------------

def _mutated(mutate) -> bytes:
    w = wire(typical())
    mutate(w)
    return pack(w)


BAD = {
    "unknown format version": lambda w: w.update(f=2),
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
}


@pytest.mark.parametrize("mutate", BAD.values(), ids=BAD.keys())
def test_rejects_invalid_content(mutate) -> None:
    with pytest.raises(SnapshotError):
        decode(_mutated(mutate))


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
    raw = bytearray(encode(typical()))
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
    w = wire(typical(data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))))
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
