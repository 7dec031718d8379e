"""The agent's configuration: a typed schema with embedded defaults, read from TOML.

Every key has a default, so `loadmesh agent` runs with no file at all (a one-node mesh on
this host). A file only overrides what it names. Anything the schema does not know, a value
of the wrong type or a value out of range stops the agent with an error that names the file
and the dotted key, because an agent fleet-deployed with a typo must fail loudly on the
first host rather than run with a silently ignored setting.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadmesh.daemon.score import ScoreWeights
from loadmesh.gossip.config import GossipParams

_GOSSIP = GossipParams()

Check = Callable[[Any], str | None]


# sysexits' EX_CONFIG: the unit file keeps systemd from restarting into the same bad file.
EXIT_CONFIG = 78


class ConfigError(Exception):
    """A configuration problem, already phrased for the operator."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")
        self.source = source
        self.key = key
        self.problem = problem


def split_host_port(value: str, allow_any_port: bool = False) -> tuple[str, int]:
    """Split "host:port" or "[v6]:port"; raises ValueError with a reason. Port 0 ("any
    free port") only with allow_any_port."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected host:port, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 address needs brackets: [{host}]:{port_text}")
    low = 0 if allow_any_port else 1
    if not port_text.isdigit() or not low <= int(port_text) < 65536:
        raise ValueError(f"port must be {low}..65535, got {port_text!r}")
    return host, int(port_text)


def _host_port(value: str) -> str | None:
    try:
        split_host_port(value)
    except ValueError as exc:
        return str(exc)
    return None


def _ip_port(value: str, allow_any_port: bool = False) -> str | None:
    """A listen address must be a literal IP: binding to a name would depend on DNS at boot."""
    try:
        host, _ = split_host_port(value, allow_any_port)
        ipaddress.ip_address(host)
    except ValueError as exc:
        return str(exc)
    return None


def _seeds(values: tuple[str, ...]) -> str | None:
    for i, seed in enumerate(values):
        problem = _host_port(seed)
        if problem:
            return f"[{i}]: {problem}"
    return None


def _ip_port_or_any(value: str) -> str | None:
    return _ip_port(value, allow_any_port=True)


def _ip_port_or_off(value: str) -> str | None:
    return None if value == "" else _ip_port(value)


def _optional_path(value: str) -> str | None:
    return None if not value or os.path.isabs(value) else f"must be an absolute path, got {value!r}"


def _ports(values: tuple[int, ...]) -> str | None:
    if not values:
        return "at least one serving port is needed"
    bad = [p for p in values if not 0 < p < 65536]
    if bad:
        return f"ports must be 1..65535, got {bad}"
    if len(set(values)) != len(values):
        return "ports must not repeat"
    return None


def _interfaces(values: tuple[str, ...]) -> str | None:
    for name in values:
        # IFNAMSIZ is 16 including the NUL; '/' and whitespace can never be in a name.
        if not name or len(name) > 15 or "/" in name or any(c.isspace() for c in name):
            return f"not a valid interface name: {name!r}"
    return None


def _at_least(low: int) -> Check:
    return lambda v: None if v >= low else f"must be at least {low}, got {v}"


def _between(low: int, high: int) -> Check:
    return lambda v: None if low <= v <= high else f"must be {low}..{high}, got {v}"


def _range(low: float, high: float) -> Check:
    return lambda v: None if low <= v <= high else f"must be {low:g}..{high:g}, got {v:g}"


def _advertise(value: str) -> str | None:
    if value and (len(value) > 253 or any(c.isspace() or c in "/[]" for c in value)):
        return f"not a host name or address: {value!r}"
    return None


def _absolute_path(value: str) -> str | None:
    if not os.path.isabs(value):
        return f"must be an absolute path, got {value!r}"
    # sun_path holds 108 bytes including the NUL.
    if len(os.fsencode(value)) > 107:
        return "a Unix socket path must be at most 107 bytes"
    return None


def _node_id(value: str) -> str | None:
    # Empty means "the host name", filled in after parsing.
    if len(value.encode()) > 128:
        return "must be at most 128 bytes"
    if any(not c.isprintable() or c.isspace() for c in value):
        return "must be printable, without spaces"
    return None


def _log_level(value: str) -> str | None:
    levels = ("debug", "info", "warning", "error")
    return None if value in levels else f"must be one of {', '.join(levels)}"


def _key(default: Any, check: Check | None = None, doc: str = "") -> Any:
    meta = {"check": check, "doc": doc}
    if isinstance(default, (tuple, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ProbesConfig:
    interfaces: tuple[str, ...] = _key(("lo",), _interfaces, "interfaces the TC probes attach to")
    ports: tuple[int, ...] = _key((8000,), _ports, "TCP ports the inference servers listen on")
    required: bool = _key(False, doc="exit instead of running without probes")
    window_s: float = _key(10.0, _range(1, 300), "sliding window of the latency percentiles, s")
    scan_limit: int = _key(65536, _between(64, 1 << 20),
                           'request body bytes searched for "model" at each end (docs/probes.md)')
    max_connections: int = _key(16384, _between(1, 1 << 22), "in-flight map: live connections")
    max_fingerprints: int = _key(16384, _between(1, 1 << 22),
                                 "fingerprints map: flow x model x status rows")
    max_histogram_buckets: int = _key(16384, _between(1, 1 << 22),
                                      "latency buckets in use, all models, ports and kinds")
    max_models: int = _key(1024, _between(1, 1 << 22), "distinct model names kept")


@dataclass(frozen=True)
class GossipConfig:
    bind: str = _key("0.0.0.0:7946", _ip_port_or_any, "UDP address the gossip listens on "
                     "(port 0: any free port)")
    seeds: tuple[str, ...] = _key((), _seeds, "host:port of peers to join through")
    interval_ms: int = _key(500, _between(10, 60_000), "gossip round period")
    fanout: int = _key(3, _between(1, 64), "peers contacted each round")
    key_file: str = _key("", _optional_path, "HMAC keys, one per line, the first signs "
                         "(empty: an open mesh, see insecure)")
    insecure: bool = _key(False, doc="allow an open mesh (no key_file) on an address other "
                          "hosts reach: anyone there can then publish snapshots and node ids")
    discovery: bool = _key(False, doc="find peers on the LAN by mDNS (_loadmesh._udp.local.)")
    # The defaults are the gossip package's, chosen by measurement (docs/gossip.md).
    max_datagram: int = _key(_GOSSIP.max_datagram, _between(512, 65_507),
                             "largest datagram sent or accepted, the same on every node")
    suspect_after_ms: int = _key(_GOSSIP.suspect_after_ms, _between(100, 3_600_000),
                                 "a peer whose version stood still this long is suspect")
    dead_after_ms: int = _key(_GOSSIP.dead_after_ms, _between(200, 3_600_000),
                              "... and dead (not routed to)")
    reap_after_ms: int = _key(_GOSSIP.reap_after_ms, _between(1000, 86_400_000), "... and forgotten")
    max_peers: int = _key(_GOSSIP.max_peers, _between(1, 1_000_000), "bound of the peer table")
    max_table_bytes: int = _key(_GOSSIP.max_table_bytes, _between(64 << 10, 1 << 30),
                                "bound of the peers' snapshot encodings held")

    def __post_init__(self) -> None:
        if not self.suspect_after_ms < self.dead_after_ms < self.reap_after_ms:
            raise ValueError("need suspect_after_ms < dead_after_ms < reap_after_ms")
        # A peer beats every beat_interval_ms: suspecting it sooner would suspect everyone.
        if self.suspect_after_ms <= _GOSSIP.beat_interval_ms:
            raise ValueError(f"suspect_after_ms must be above the beat interval "
                             f"({_GOSSIP.beat_interval_ms} ms)")


def open_mesh_refusal(gossip: GossipConfig) -> str:
    """Why the agent must not start with this gossip section, or "".

    An open mesh is a choice, not a default: anyone who reaches the port can publish
    snapshots and node ids that steer every host's routing. A loopback address is
    reachable from this host only."""
    host, _ = split_host_port(gossip.bind, allow_any_port=True)
    if gossip.key_file or gossip.insecure or ipaddress.ip_address(host).is_loopback:
        return ""
    return (f"gossip: no key_file, and {gossip.bind} is open to other hosts: set gossip.key_file "
            "(one key for the mesh, made by `openssl rand -hex 32`) or gossip.insecure = true "
            "for an open mesh")


@dataclass(frozen=True)
class RoutingConfig:
    choices: int = _key(3, _between(1, 16), "d of the power of d choices")
    alternatives: int = _key(2, _between(0, 16), "retry targets returned with each answer")
    epsilon: float = _key(0.15, _range(0.01, 10), "load per slot above the fleet's, as a fraction, "
                          "at which a host starts passing its sessions on")
    vnodes: int = _key(160, _between(100, 10_000), "ring points per peer")
    slow_start_s: float = _key(30.0, _range(0, 3600), "ramp of a joined or recovered peer")
    breaker_failures: int = _key(3, _between(1, 1000), "consecutive failures that open a circuit")
    breaker_cooldown_s: float = _key(10.0, _range(0, 3600), "open time before a trial request")
    error_ratio_threshold: float = _key(0.05, _range(0, 1),
                                        "a peer reporting more errors than this is degraded")
    freshness_s: float = _key(15.0, _range(0.1, 3600), "older snapshots count as stale")
    static_models: dict[str, tuple[str, ...]] = _key(
        {}, None, "node_id -> models it serves before traffic shows them")


@dataclass(frozen=True)
class ApiConfig:
    socket: str = _key("/run/loadmesh/loadmesh.sock", _absolute_path, "local API Unix socket")


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = _key("127.0.0.1:9464", _ip_port_or_off, "address of the Prometheus exporter's "
                       "HTTP /metrics (empty: no exporter)")
    model_labels: int = _key(64, _between(1, 4096), "models with series of their own "
                             "(clients name them); later ones count under model=\"(other)\"")


@dataclass(frozen=True)
class LoadConfig:
    tick_ms: int = _key(250, _between(100, 60_000), "how often the snapshot is rebuilt")
    heartbeat_ms: int = _key(5000, _between(500, 600_000),
                             "the version moves at least this often, changed or not")
    half_life_s: float = _key(3.0, _range(0.1, 600), "score smoothing: a sample's weight halves in this time")
    degraded_at: float = _key(0.7, _range(0.01, 1), "score from which the node is degraded")
    overloaded_at: float = _key(0.9, _range(0.01, 1), "score from which the node is overloaded")
    list_models_s: float = _key(30.0, _range(0, 86_400),
                                "how often each serving port's GET /v1/models is asked, so that "
                                "peers route a model here before its first request (0: never)")
    weights: ScoreWeights = field(default_factory=ScoreWeights)

    def __post_init__(self) -> None:
        if self.degraded_at >= self.overloaded_at:
            raise ValueError(f"degraded_at ({self.degraded_at:g}) must be below "
                             f"overloaded_at ({self.overloaded_at:g})")


@dataclass(frozen=True)
class Config:
    node_id: str = _key("", _node_id, "this node's name in the mesh (default: host name)")
    log_level: str = _key("info", _log_level, "debug, info, warning or error")
    advertise: str = _key("", _advertise, "host peers send inference requests to "
                          "(default: this host's first non-loopback address)")
    state_dir: str = _key("/var/lib/loadmesh", _absolute_path, "where state survives restarts")
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)


def _describe(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "a table"}.get(type(value), type(value).__name__)


def _coerce(value: Any, kind: Any, source: str, key: str) -> Any:
    """Check one TOML value against a schema type and return it in the schema's form."""
    origin = typing.get_origin(kind)
    if origin is dict:
        value_kind = typing.get_args(kind)[1]
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected a table, got {_describe(value)}")
        return {k: _coerce(v, value_kind, source, f"{key}.{k}") for k, v in value.items()}
    if origin is tuple:
        item_kind = typing.get_args(kind)[0]
        if not isinstance(value, list):
            raise ConfigError(source, key, f"expected an array, got {_describe(value)}")
        return tuple(_coerce(v, item_kind, source, f"{key}[{i}]") for i, v in enumerate(value))
    # bool is a subclass of int in Python, but `fanout = true` is a mistake, not a 1.
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(source, key, f"expected an integer, got {_describe(value)}")
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, key, f"expected a number, got {_describe(value)}")
        return float(value)
    if kind in (bool, str) and not isinstance(value, kind):
        raise ConfigError(source, key, f"expected {_describe(kind())}, got {_describe(value)}")
    return value


def _build(cls: type, table: Mapping[str, Any], source: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields))
        raise ConfigError(source, prefix + unknown[0], f"unknown key (known here: {known})")
    values: dict[str, Any] = {}
    for name, spec in fields.items():
        key = prefix + name
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            sub = table.get(name, {})
            if not isinstance(sub, dict):
                raise ConfigError(source, key, f"expected a table, got {_describe(sub)}")
            values[name] = _build(kind, sub, source, key + ".")
            continue
        if name not in table:
            continue
        value = _coerce(table[name], kind, source, key)
        check = spec.metadata.get("check")
        problem = check(value) if check else None
        if problem:
            raise ConfigError(source, key, problem)
        values[name] = value
    try:
        return cls(**values)
    except ValueError as exc:  # a section that checks its keys together (score weights)
        raise ConfigError(source, prefix.rstrip("."), str(exc)) from None


def parse(text: str, source: str = "<config>") -> Config:
    """Parse TOML text into a Config; `source` names the file in every error."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    config: Config = _build(Config, table, source, "")
    if not config.node_id:
        config = dataclasses.replace(config, node_id=socket.gethostname())
    return config


def load(path: str | os.PathLike[str] | None) -> Config:
    """Load the file at `path`, or the embedded defaults when `path` is None."""
    if path is None:
        return parse("", "<defaults>")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "", f"cannot read: {exc}") from None
    return parse(text, str(path))


def defaults_toml() -> str:
    """The embedded defaults as a commented TOML document (for `loadmesh config defaults`)."""
    lines = ["# loadmesh configuration: every key shown with its default.", ""]

    def emit(cls: type, instance: Any, section: str) -> None:
        nested = []
        for f in dataclasses.fields(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((f.name, value))
                continue
            if f.metadata.get("doc"):
                lines.append(f"# {f.metadata['doc']}")
            lines.append(f"{f.name} = {_toml_value(value)}")
        for name, value in nested:
            lines.extend(["", f"[{section}{name}]"])
            emit(type(value), value, f"{section}{name}.")

    emit(Config, Config(), "")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


__all__ = ["EXIT_CONFIG", "Config", "open_mesh_refusal", "ConfigError", "ProbesConfig", "GossipConfig", "ApiConfig",
           "MetricsConfig", "LoadConfig", "RoutingConfig", "parse", "load", "split_host_port", "defaults_toml"]
