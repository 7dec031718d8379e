"""LoadSnapshot: what one node tells every other node about its load, and its wire codec.

A snapshot is written by exactly one node (its owner) and replaces a peer's stored copy
when its (version, timestamp_ms) is greater. The dataclasses hold every figure at the
resolution the wire carries (quantized when a record is built), so a node routes on
exactly what its peers see and ``decode(encode(s)) == s`` holds for every valid snapshot.

Wire format (msgpack, format version 2)
---------------------------------------
The top level is a map with one-letter keys::

    "f": format version (int, 2)
    "n": node_id (str, 1..128 bytes of UTF-8)
    "e": endpoints, [[host, port], ...]
    "v": version (uint, < 2**63)
    "t": timestamp, ms since the Unix epoch (uint, < 2**63)
    "s": state: 0 ok, 1 degraded, 2 overloaded, 3 draining
    "l": load score in 1/1000 (0..1000)
    "h": host,   [cpu_util %, mem_used MiB*, mem_total MiB*, load1 0.1*, cpu_pressure % or nil]
    "g": GPUs,   [[index, util %, mem_used MiB*, mem_total MiB*, temp C, power W*,
                   power_limit W*, throttle reasons bitmask, processes, healthy bool], ...]
    "m": models, [[model_id u64, port, rps 1/100*, error_ratio 1/10000, p50 0.1 ms*,
                   p99 0.1 ms*, in_flight*, waiting*, running*, ttft_p99 0.1 ms*,
                   itl_p99 0.1 ms*, tokens/s 0.1*, pace 0.1 ms*, shed_start 1/10000,
                   shed_width 1/10000], ...]
    "k": sessions, [[model_id u64, session key u32, rps 1/100**, ...], ...]; absent when
         empty (a node that routes no sessions, or an older writer)
    "q": requests routed, [[model_id u64, rps 1/100**], ...]: of each model in "k", all its
         requests routed at this node, with a session or not; absent when "k" is, or no
         model of it has a rate (an older writer)

A figure marked * is held to DIGITS (3) significant decimal digits (** to 2) and sent as its log
code (_log_code): the count of units itself below 1000, one code per mantissa above, so
that a figure moving by a few percent moves its code by a few units and a delta carries
it in one byte (gossip/delta.py). docs/snapshot.md says why each figure has its precision.

Records are positional arrays rather than maps: with keys, 8 GPUs and 4 models do not fit
the 576-byte budget. Compatibility rules, so that agents of different releases interoperate:

- A reader ignores top-level keys it does not know and elements past the ones it knows at
  the end of any record; a newer writer adds fields only that way, under the same "f".
- A change an older reader cannot skip (a field removed, re-typed or re-scaled) takes a new
  "f" and a new gossip protocol version (gossip/wire.py), so that agents of the two formats
  refuse each other's datagrams whole instead of misreading figures. Format 2 (the
  quantized figures) came with protocol 3; a reader refuses a format it does not support.

GPU identity (UUID, name) stays on the host: peers route on figures, and eight UUIDs alone
would take 144 of the 576 bytes.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import msgpack

FORMAT_VERSION = 2
SUPPORTED_FORMATS = frozenset({2})
# The significant decimal digits that log-scale figures keep (docs/snapshot.md, "Precision").
DIGITS = 3

MAX_GPUS = 16
MAX_MODELS = 64
MAX_ENDPOINTS = 16
MAX_NODE_ID_BYTES = 128
MAX_HOST_BYTES = 253  # the longest DNS name
MAX_CLOCK = 2**63 - 1  # versions and timestamps stay within a signed 64-bit integer
MAX_MIB = 2**32 - 1
MAX_LOAD_AVERAGE = 100_000.0
MAX_RPS = 10_000_000.0
MAX_LATENCY_MS = 3_600_000.0
MAX_IN_FLIGHT = 2**32 - 1
MAX_TOKENS_PER_S = 100_000_000.0
# Sessions: the busiest few per model, of the models with the most session traffic. The
# bound on sessions' load needs only the sessions that are a large part of a host
# (daemon/routing/heavy.py): fewer than 8 per model at a fleet's smallest host.
MAX_SESSION_MODELS = 8
MAX_SESSIONS = 8
SESSION_KEY_BITS = 32
# No snapshot within the bounds above encodes to more (the worst case is tested), so the
# decoder refuses longer input before unpacking anything.
MAX_ENCODED_BYTES = 12288


class SnapshotError(ValueError):
    """The bytes or values do not make a valid LoadSnapshot."""


class NodeState(enum.Enum):
    OK = "ok"
    DEGRADED = "degraded"
    OVERLOADED = "overloaded"
    DRAINING = "draining"


_STATE_CODES = {NodeState.OK: 0, NodeState.DEGRADED: 1, NodeState.OVERLOADED: 2, NodeState.DRAINING: 3}
_CODE_STATES = {code: state for state, code in _STATE_CODES.items()}


def _round_digits(x: float, digits: int) -> int:
    """The count nearest x that has at most `digits` significant decimal digits. x is
    rounded once, to its digits: rounding it to a whole count first would round twice."""
    top = 10**digits
    if x < top - 0.5:
        return round(x)
    unit = 10 ** (len(str(int(x))) - digits)
    return ((x + unit // 2) // unit if isinstance(x, int) else math.floor(x / unit + 0.5)) * unit


def _log_code(count: int, digits: int) -> int:
    """The code of a count of at most `digits` significant decimal digits. Counts below
    10**digits are their own code; above, each decade holds 9 * 10**(digits - 1) codes,
    one per mantissa, so moving a figure by p % moves its code by about p / 100 times its
    mantissa, whatever its size, and round figures stay round."""
    top = 10**digits
    if count < top:
        return count
    exponent = len(str(count)) - digits
    return top + (exponent - 1) * 9 * (top // 10) + count // 10**exponent - top // 10


def _log_count(code: int, digits: int) -> int:
    top = 10**digits
    if code < top:
        return code
    per_decade = 9 * (top // 10)
    exponent, mantissa = divmod(code - top, per_decade)
    return (mantissa + top // 10) * 10 ** (exponent + 1)


@dataclass(frozen=True)
class _Field:
    """How one record field is checked, quantized and put on the wire.

    kind "int": an integer in [lo, hi]; kind "fixed": a number in [lo, hi], both counted
    in units of 1/scale ("int" has scale 1). With digits 0 the wire carries the count;
    otherwise the count's log-scale code (_log_code), the count rounded to that many
    significant digits. kind "str": UTF-8 of lo..hi bytes. kind "bool": a bool. A field
    holds its value as decoded from the wire, never finer.
    """

    name: str
    kind: Literal["int", "fixed", "str", "bool"]
    hi: float = 0
    lo: float = 0
    scale: int = 1
    digits: int = 0
    optional: bool = False

    @functools.cached_property
    def decoder(self) -> Callable[[Any, str], Any]:
        return _decoder(self)

    @functools.cached_property
    def max_code(self) -> int:
        """hi's code. Each bound has at most `digits` significant digits or rounds down
        (tested), so no figure within it rounds past it."""
        top = int(self.hi * self.scale)
        return _log_code(_round_digits(top, self.digits), self.digits) if self.digits else top


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(spec: _Field, value: object, where: str) -> object:
    """The value as the record holds it (quantized), or SnapshotError."""
    if value is None and spec.optional:
        return None
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise SnapshotError(f"{where}.{spec.name}: expected bool, got {type(value).__name__}")
        return value
    if spec.kind == "str":
        if not isinstance(value, str):
            raise SnapshotError(f"{where}.{spec.name}: expected str, got {type(value).__name__}")
        try:
            size = len(value.encode())
        except UnicodeEncodeError as e:  # lone surrogates cannot travel
            raise SnapshotError(f"{where}.{spec.name}: not valid UTF-8") from e
        if not spec.lo <= size <= spec.hi:
            raise SnapshotError(f"{where}.{spec.name}: {size} bytes, allowed {spec.lo}..{spec.hi}")
        return value
    if spec.kind == "int":
        if not _is_int(value):
            raise SnapshotError(f"{where}.{spec.name}: expected int, got {type(value).__name__}")
    elif not (_is_int(value) or isinstance(value, float)):
        raise SnapshotError(f"{where}.{spec.name}: expected number, got {type(value).__name__}")
    # Written so that NaN fails it too.
    if not spec.lo <= value <= spec.hi:  # type: ignore[operator]
        raise SnapshotError(f"{where}.{spec.name}: {value!r} outside {spec.lo}..{spec.hi}")
    if spec.digits:
        count = _round_digits(value * spec.scale, spec.digits)  # type: ignore[operator]
    elif spec.kind == "fixed":
        count = round(value * spec.scale)  # type: ignore[operator]
    else:
        return value
    return count if spec.kind == "int" else count / spec.scale


def _to_wire(spec: _Field, value: Any) -> Any:
    if spec.digits:
        # value is held quantized: its count has `digits` digits, give or take a float's ulp.
        return _log_code(_round_digits(value * spec.scale, spec.digits), spec.digits)
    if spec.kind == "fixed" and value is not None:
        return round(value * spec.scale)
    return value


def _decoder(spec: _Field) -> Callable[[Any, str], Any]:
    """How a field's value is read from the wire and checked, as _check checks a value
    given: a code expands to a count that has its digits already, so quantizing it again
    would change nothing (tested) and only its bounds are checked. One function per
    field, its kind's branches taken here: decoding is most of a gossiping agent's work."""
    if not (spec.digits or spec.kind == "fixed"):
        return functools.partial(_check, spec)
    name, lo, hi, scale, digits = spec.name, spec.lo, spec.hi, spec.scale, spec.digits
    optional, max_code, whole = spec.optional, spec.max_code, spec.kind == "int"

    def decode_field(code: Any, where: str) -> Any:
        if type(code) is not int:
            if code is None:
                if optional:
                    return None
                raise SnapshotError(f"{where}.{name}: expected number, got NoneType")
            raise SnapshotError(f"{where}.{name}: expected int, got {type(code).__name__}")
        # Checked before expanding: a hostile code of 2**64 would be a number of 10**16 digits.
        if not 0 <= code <= max_code:
            raise SnapshotError(f"{where}.{name}: code {code} outside 0..{max_code}")
        count = _log_count(code, digits) if digits else code
        value = count if whole else count / scale
        if not lo <= value <= hi:
            raise SnapshotError(f"{where}.{name}: {value!r} outside {lo}..{hi}")
        return value

    return decode_field


def _reader(cls: type) -> Callable[[list[Any]], Any]:
    """A record class's from_wire after its checks of the array, in straight-line code
    made once per class (as dataclasses makes __init__): each field's common case inline
    (an int code within its bounds, an int, a bool), and its decoder, the reference, for
    the rest, which gives the same value or raises the same error. Called per field, the
    decoders took 47 us a snapshot of the reference workload (82 figures, each a call
    and a dict comprehension's turn), most of what a gossiping agent spends decoding."""
    where = cls.__name__
    consts: dict[str, Any] = {"new": object.__new__, "cls": cls, "lc": _log_count}
    body: list[str] = []
    for i, spec in enumerate(cls._FIELDS):
        consts[f"d{i}"] = spec.decoder
        slow = f"d{i}(c, {where!r})"
        body.append(f"c = raw[{i}]")
        if spec.digits or spec.kind == "fixed":
            consts[f"lo{i}"], consts[f"hi{i}"] = spec.lo, spec.hi
            count = f"(c if c < {10**spec.digits} else lc(c, {spec.digits}))" if spec.digits else "c"
            value = count if spec.kind == "int" else f"{count} / {spec.scale}"
            body += [f"if type(c) is int and 0 <= c <= {spec.max_code}:",
                     f"    v{i} = {value}",
                     f"    if not lo{i} <= v{i} <= hi{i}:",
                     f"        v{i} = {slow}",
                     "else:",
                     f"    v{i} = {slow}"]
        elif spec.kind == "int" and not spec.optional:
            lo, hi = int(spec.lo), int(spec.hi)
            if (lo, hi) != (spec.lo, spec.hi):
                raise TypeError(f"{where}.{spec.name}: an int field's bounds must be ints")
            body.append(f"v{i} = c if type(c) is int and {lo} <= c <= {hi} else {slow}")
        elif spec.kind == "bool" and not spec.optional:
            body.append(f"v{i} = c if c is True or c is False else {slow}")
        else:
            body.append(f"v{i} = {slow}")
    fields = ", ".join(f"{spec.name!r}: v{i}" for i, spec in enumerate(cls._FIELDS))
    body += ["record = new(cls)", f"record.__dict__.update({{{fields}}})", "return record"]
    inner = "\n".join("        " + line for line in body)
    src = f"def make({', '.join(consts)}):\n    def read(raw):\n{inner}\n    return read\n"
    namespace: dict[str, Any] = {}
    exec(src, namespace)  # noqa: S102  (made from the field table above, never from input)
    read: Callable[[list[Any]], Any] = namespace["make"](**consts)
    return read


class _Record:
    """A frozen dataclass whose fields are all described by _FIELDS, in wire order."""

    _FIELDS: ClassVar[tuple[_Field, ...]]
    _read: ClassVar[Callable[[list[Any]], Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._read = staticmethod(_reader(cls))  # type: ignore[assignment]

    def __post_init__(self) -> None:
        where = type(self).__name__
        for spec in self._FIELDS:
            object.__setattr__(self, spec.name, _check(spec, getattr(self, spec.name), where))

    def to_wire(self) -> list[Any]:
        return [_to_wire(spec, getattr(self, spec.name)) for spec in self._FIELDS]

    @classmethod
    def from_wire(cls, raw: object) -> Any:
        where = cls.__name__
        if not isinstance(raw, list):
            raise SnapshotError(f"{where}: expected array, got {type(raw).__name__}")
        if len(raw) < len(cls._FIELDS):
            raise SnapshotError(f"{where}: {len(raw)} elements, need {len(cls._FIELDS)}")
        # Elements past the known ones come from a newer writer: skipped, by design. Each
        # field is checked once, as it is decoded: made through __init__, it was checked
        # again by __post_init__, which took half of a gossiping agent's CPU at 1000 peers
        # (every node decodes every version of every peer; scripts/bench_agent_cpu.py).
        return cls._read(raw)


@dataclass(frozen=True)
class Endpoint(_Record):
    """Where peers send this node's inference requests."""

    host: str
    port: int

    _FIELDS = (
        _Field("host", "str", lo=1, hi=MAX_HOST_BYTES),
        _Field("port", "int", lo=1, hi=65535),
    )


@dataclass(frozen=True)
class HostLoad(_Record):
    """Host figures. cpu_pressure_pct is PSI "some avg10" for the CPU, None without PSI."""

    cpu_util: float
    mem_used_mib: int
    mem_total_mib: int
    load1: float
    cpu_pressure_pct: float | None

    _FIELDS = (
        _Field("cpu_util", "fixed", hi=1, scale=100),
        _Field("mem_used_mib", "int", hi=MAX_MIB, digits=DIGITS),
        _Field("mem_total_mib", "int", hi=MAX_MIB, digits=DIGITS),
        _Field("load1", "fixed", hi=MAX_LOAD_AVERAGE, scale=10, digits=DIGITS),
        _Field("cpu_pressure_pct", "fixed", hi=100, optional=True),
    )


@dataclass(frozen=True)
class GpuLoad(_Record):
    """One GPU's figures. An unhealthy GPU (NVML failing on it) reports zeros."""

    index: int
    util_pct: int
    mem_used_mib: int
    mem_total_mib: int
    temp_c: int
    power_w: int
    power_limit_w: int
    throttle_reasons: int
    processes: int
    healthy: bool

    _FIELDS = (
        _Field("index", "int", hi=255),
        _Field("util_pct", "int", hi=100),
        _Field("mem_used_mib", "int", hi=MAX_MIB, digits=DIGITS),
        _Field("mem_total_mib", "int", hi=MAX_MIB, digits=DIGITS),
        _Field("temp_c", "int", hi=255),
        _Field("power_w", "int", hi=65535, digits=DIGITS),
        _Field("power_limit_w", "int", hi=65535, digits=DIGITS),
        _Field("throttle_reasons", "int", hi=2**64 - 1),
        _Field("processes", "int", hi=65535),
        _Field("healthy", "bool"),
    )


@dataclass(frozen=True)
class ModelLoad(_Record):
    """Traffic figures for one model on one serving port.

    model_id is the FNV-1a 64 hash of the request's JSON "model" value, as the probes
    compute it; port is the local serving port the traffic was measured on, so a peer
    routing to this node knows which endpoint serves the model. p50_ms and p99_ms are the
    time to the answer's first byte; in_flight = waiting + running (kept for agents that
    read no further). waiting: requests with no first token yet (a non-streamed one: no
    answer yet); running: streams under way; ttft and itl from streamed answers only;
    pace_ms: the median gap between a stream's tokens over the last second (the decode pace
    now, where the window's itl_p99 holds the tail). shed_start, shed_width: the band of
    session coins this node passes on to the next peer of their ring
    (daemon/routing/shed.py), [start, start + width) around [0, 1).
    """

    model_id: int
    port: int
    rps: float
    error_ratio: float
    p50_ms: float
    p99_ms: float
    in_flight: int
    waiting: int = 0
    running: int = 0
    ttft_p99_ms: float = 0.0
    itl_p99_ms: float = 0.0
    tokens_per_s: float = 0.0
    pace_ms: float = 0.0
    shed_start: float = 0.0
    shed_width: float = 0.0

    _FIELDS = (
        _Field("model_id", "int", hi=2**64 - 1),
        _Field("port", "int", lo=1, hi=65535),
        _Field("rps", "fixed", hi=MAX_RPS, scale=100, digits=DIGITS),
        _Field("error_ratio", "fixed", hi=1, scale=10_000),
        _Field("p50_ms", "fixed", hi=MAX_LATENCY_MS, scale=10, digits=DIGITS),
        _Field("p99_ms", "fixed", hi=MAX_LATENCY_MS, scale=10, digits=DIGITS),
        _Field("in_flight", "int", hi=MAX_IN_FLIGHT, digits=DIGITS),
        _Field("waiting", "int", hi=MAX_IN_FLIGHT, digits=DIGITS),
        _Field("running", "int", hi=MAX_IN_FLIGHT, digits=DIGITS),
        _Field("ttft_p99_ms", "fixed", hi=MAX_LATENCY_MS, scale=10, digits=DIGITS),
        _Field("itl_p99_ms", "fixed", hi=MAX_LATENCY_MS, scale=10, digits=DIGITS),
        _Field("tokens_per_s", "fixed", hi=MAX_TOKENS_PER_S, scale=10, digits=DIGITS),
        _Field("pace_ms", "fixed", hi=MAX_LATENCY_MS, scale=10, digits=DIGITS),
        _Field("shed_start", "fixed", hi=1, scale=10_000),
        _Field("shed_width", "fixed", hi=1, scale=10_000),
    )

    @property
    def key(self) -> tuple[int, int]:
        return (self.model_id, self.port)


_SESSION_MODEL = _Field("model_id", "int", hi=2**64 - 1)
_SESSION_KEY = _Field("session", "int", hi=2**SESSION_KEY_BITS - 1)
_SESSION_RPS = _Field("rps", "fixed", hi=MAX_RPS, scale=100, digits=2)
_ROUTED_RPS = _Field("routed_rps", "fixed", hi=MAX_RPS, scale=100, digits=2)


@dataclass(frozen=True)
class SessionRates:
    """The busiest sessions of one model among the requests routed at this node: each as
    (key, requests per second), its key the high 32 bits of the session's ring hash
    (daemon/routing/ring.hash64), sorted by key. Every node sums its peers' figures for a
    session into the fleet's (daemon/routing/heavy.py). Two significant digits: a session
    is heavy or not by a quarter of a host's share, so a figure moving by a few percent
    need not travel. 32-bit keys: among the few dozen sessions heavy at once, two that
    share one are a 2**-22 chance, and a client that chose its session names to collide
    only sums its own sessions' figures. routed_rps: all the model's requests routed at
    this node per second, counted as the sessions' are: every node sums them into the
    whole that a session's share is of (0 from an older writer)."""

    model_id: int
    sessions: tuple[tuple[int, float], ...]
    routed_rps: float = 0.0

    def __post_init__(self) -> None:
        where = "SessionRates"
        object.__setattr__(self, "model_id", _check(_SESSION_MODEL, self.model_id, where))
        object.__setattr__(self, "routed_rps", _check(_ROUTED_RPS, self.routed_rps, where))
        if not isinstance(self.sessions, (list, tuple)):
            raise SnapshotError(f"{where}.sessions: expected a sequence, got {type(self.sessions).__name__}")
        pairs = []
        for pair in self.sessions:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise SnapshotError(f"{where}.sessions: expected (key, rps) pairs, got {pair!r}")
            pairs.append((_check(_SESSION_KEY, pair[0], where), _check(_SESSION_RPS, pair[1], where)))
        object.__setattr__(self, "sessions", _sessions_in_order(pairs))

    def to_wire(self) -> list[Any]:
        out: list[Any] = [self.model_id]
        for key, rps in self.sessions:
            out += (key, _to_wire(_SESSION_RPS, rps))
        return out

    @classmethod
    def from_wire(cls, raw: object) -> SessionRates:
        where = "SessionRates"
        if not isinstance(raw, list) or len(raw) % 2 != 1:
            raise SnapshotError(f"{where}: expected an array of a model id and (key, rps) pairs")
        if len(raw) // 2 > MAX_SESSIONS:
            raise SnapshotError(f"{where}: {len(raw) // 2} sessions, at most {MAX_SESSIONS}")
        key, rps = _SESSION_KEY.decoder, _SESSION_RPS.decoder
        record: SessionRates = object.__new__(cls)
        record.__dict__.update(
            model_id=_SESSION_MODEL.decoder(raw[0], where),
            sessions=_sessions_in_order([(key(raw[i], where), rps(raw[i + 1], where))
                                         for i in range(1, len(raw), 2)]),
            routed_rps=0.0)
        return record


def _sessions_in_order(pairs: list[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    if len(pairs) > MAX_SESSIONS:
        raise SnapshotError(f"SessionRates.sessions: {len(pairs)} entries, at most {MAX_SESSIONS}")
    return _unique_sorted(pairs, operator.itemgetter(0), "SessionRates.sessions")


_NODE_ID = _Field("node_id", "str", lo=1, hi=MAX_NODE_ID_BYTES)
_VERSION = _Field("version", "int", hi=MAX_CLOCK)
_TIMESTAMP = _Field("timestamp_ms", "int", hi=MAX_CLOCK)
_SCORE = _Field("score", "fixed", hi=1, scale=1000)


def wire_score(score: float) -> float:
    """score at the resolution the snapshot holds it, so the state a node derives from it
    matches the score its peers see."""
    return _check(_SCORE, score, "score")  # type: ignore[return-value]


_ENDPOINT_KEY = operator.attrgetter("host", "port")
_GPU_KEY = operator.attrgetter("index")
_MODEL_KEY = operator.attrgetter("model_id", "port")
_SESSIONS_KEY = operator.attrgetter("model_id")


def _unique_sorted(items: Sequence[Any], key: Any, name: str) -> tuple[Any, ...]:
    """Sorted, so that equal content compares and encodes equal; duplicates are refused.
    name: the field, with its class (the error names it)."""
    ordered = tuple(sorted(items, key=key))
    for a, b in itertools.pairwise(ordered):
        if key(a) == key(b):
            raise SnapshotError(f"{name}: duplicate {key(a)!r}")
    return ordered


@dataclass(frozen=True)
class LoadSnapshot:
    node_id: str
    endpoints: tuple[Endpoint, ...]
    version: int
    timestamp_ms: int
    state: NodeState
    score: float
    host: HostLoad
    gpus: tuple[GpuLoad, ...]
    models: tuple[ModelLoad, ...]
    sessions: tuple[SessionRates, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.state, NodeState):
            raise SnapshotError(f"LoadSnapshot.state: expected NodeState, got {type(self.state).__name__}")
        if not isinstance(self.host, HostLoad):
            raise SnapshotError(f"LoadSnapshot.host: expected HostLoad, got {type(self.host).__name__}")
        for name, cls in (("endpoints", Endpoint), ("gpus", GpuLoad), ("models", ModelLoad),
                          ("sessions", SessionRates)):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise SnapshotError(f"LoadSnapshot.{name}: expected a sequence, got {type(value).__name__}")
            for item in value:
                if not isinstance(item, cls):
                    raise SnapshotError(f"LoadSnapshot.{name}: expected {cls.__name__}, got {type(item).__name__}")
        self._settle()

    def _settle(self) -> None:
        """Checks the figures and puts the records in their order, in place: its records are
        of the right classes already (checked by __post_init__, or made by from_wire)."""
        fields = self.__dict__
        for spec in (_NODE_ID, _VERSION, _TIMESTAMP, _SCORE):
            fields[spec.name] = _check(spec, fields[spec.name], "LoadSnapshot")
        for name, limit, key in (("endpoints", MAX_ENDPOINTS, _ENDPOINT_KEY), ("gpus", MAX_GPUS, _GPU_KEY),
                                 ("models", MAX_MODELS, _MODEL_KEY),
                                 ("sessions", MAX_SESSION_MODELS, _SESSIONS_KEY)):
            value = fields[name]
            if len(value) > limit:
                raise SnapshotError(f"LoadSnapshot.{name}: {len(value)} entries, at most {limit}")
            fields[name] = _unique_sorted(value, key, f"LoadSnapshot.{name}")


def encode(snap: LoadSnapshot) -> bytes:
    top = {
        "f": FORMAT_VERSION,
        "n": snap.node_id,
        "e": [e.to_wire() for e in snap.endpoints],
        "v": snap.version,
        "t": snap.timestamp_ms,
        "s": _STATE_CODES[snap.state],
        "l": _to_wire(_SCORE, snap.score),
        "h": snap.host.to_wire(),
        "g": [g.to_wire() for g in snap.gpus],
        "m": [m.to_wire() for m in snap.models],
    }
    if snap.sessions:
        top["k"] = [k.to_wire() for k in snap.sessions]
        if routed := [[k.model_id, _to_wire(_ROUTED_RPS, k.routed_rps)] for k in snap.sessions if k.routed_rps]:
            top["q"] = routed
    data: bytes = msgpack.packb(top, use_bin_type=True)
    return data


def decode(data: bytes) -> LoadSnapshot:
    """The snapshot in data; SnapshotError for anything else, whatever the bytes."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SnapshotError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_ENCODED_BYTES:
        raise SnapshotError(f"{len(data)} bytes, a snapshot is at most {MAX_ENCODED_BYTES}")
    try:
        # msgpack reports every malformation (truncation, trailing bytes, bad UTF-8,
        # nesting too deep, non-string map keys) as a ValueError.
        top = msgpack.unpackb(data, raw=False)
    except ValueError as e:
        raise SnapshotError(f"not msgpack: {e}") from e
    if not isinstance(top, dict):
        raise SnapshotError(f"expected a map, got {type(top).__name__}")
    missing = [k for k in "fnevtslhgm" if k not in top]
    if missing:
        raise SnapshotError(f"missing keys {missing}")
    fmt = top["f"]
    if not _is_int(fmt) or fmt not in SUPPORTED_FORMATS:
        raise SnapshotError(f"unsupported format version {fmt!r}")
    if not _is_int(top["s"]) or top["s"] not in _CODE_STATES:
        raise SnapshotError(f"unknown state {top['s']!r}")
    sessions = top.get("k", ())
    for key, value in (("e", top["e"]), ("g", top["g"]), ("m", top["m"]), ("k", sessions)):
        if not isinstance(value, (list, tuple)):
            raise SnapshotError(f"{key!r}: expected array, got {type(value).__name__}")
    if len(sessions) > MAX_SESSION_MODELS:
        raise SnapshotError(f"'k': {len(sessions)} models, at most {MAX_SESSION_MODELS}")
    # Made as the dataclass's __init__ would, less its checks of the records' classes
    # (from_wire made them): 20.6 us a reference snapshot, 23.1 through __init__ (every
    # node decodes every version of every peer: scripts/bench_agent_cpu.py).
    snap: LoadSnapshot = object.__new__(LoadSnapshot)
    snap.__dict__.update(
        node_id=top["n"],
        endpoints=[Endpoint.from_wire(e) for e in top["e"]],
        version=top["v"],
        timestamp_ms=top["t"],
        state=_CODE_STATES[top["s"]],
        score=_SCORE.decoder(top["l"], "LoadSnapshot"),
        host=HostLoad.from_wire(top["h"]),
        gpus=[GpuLoad.from_wire(g) for g in top["g"]],
        models=[ModelLoad.from_wire(m) for m in top["m"]],
        sessions=[SessionRates.from_wire(k) for k in sessions],
    )
    _routed_from_wire(top.get("q", ()), snap.sessions)
    snap._settle()
    return snap


def _routed_from_wire(raw: object, records: list[SessionRates]) -> None:
    """Puts each model's routed rate ("q") in its record of "k"."""
    if not isinstance(raw, (list, tuple)):
        raise SnapshotError(f"'q': expected array, got {type(raw).__name__}")
    by_model = {k.model_id: k for k in records}
    seen = set()
    for pair in raw:
        if not isinstance(pair, list) or len(pair) < 2:
            raise SnapshotError(f"'q': expected [model_id, rps] arrays, got {pair!r}")
        model = _SESSION_MODEL.decoder(pair[0], "'q'")
        if model not in by_model or model in seen:
            raise SnapshotError(f"'q': model {model!r} is not in 'k' or is named twice")
        seen.add(model)
        by_model[model].__dict__["routed_rps"] = _ROUTED_RPS.decoder(pair[1], "'q'")
