"""The agent's configuration: a typed schema with embedded defaults, read from TOML.

Every key has a default, so `loadmesh agent` runs with no file at all (a one-node mesh on
this host). A file only overrides what it names. Anything the schema does not know, a value
of the wrong type or a value out of range stops the agent with an error that names the file
and the dotted key, because an agent fleet-deployed with a typo must fail loudly on the
first host rather than run with a silently ignored setting.

The schema is derived from the dataclasses of the code that uses the settings
(src/loadmesh/settings.py): each section is such a class, or extends one, so the
components take their section as it is. Rules across keys are in config_rules.py.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadmesh.daemon import config_rules
from loadmesh.daemon.score import ScoreConfig
from loadmesh.gossip.config import GossipParams
from loadmesh.settings import (SettingError, between, check_settings, in_range, section, setting,
                               settings_of)


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


@dataclass(frozen=True)
class ProbesConfig:
    interfaces: tuple[str, ...] = setting(("lo",), _interfaces,
                                          "interfaces the TC probes attach to")
    ports: tuple[int, ...] = setting((8000,), _ports, "TCP ports the inference servers listen on")
    required: bool = setting(False, doc="exit instead of running without probes")
    window_s: float = setting(10.0, in_range(1, 300),
                              "sliding window of the latency percentiles, s")
    scan_limit: int = setting(65536, between(64, 1 << 20), 'request body bytes searched for '
                              '"model" at each end (docs/probes.md)')
    max_connections: int = setting(16384, between(1, 1 << 22), "in-flight map: live connections")
    max_fingerprints: int = setting(16384, between(1, 1 << 22),
                                    "fingerprints map: flow x model x status rows")
    max_model_rows: int = setting(64, between(1, 8192), "rows of model figures: model x "
                                  "port x endpoint x status (19 KB of kernel memory each)")
    max_models: int = setting(1024, between(1, 1 << 22), "distinct model names kept")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class GossipConfig(GossipParams):
    """The protocol's settings (gossip/config.py holds them, with their defaults chosen by
    measurement in docs/gossip.md) and the agent's socket, peers and keys."""

    bind: str = setting("0.0.0.0:7946", _ip_port_or_any, "UDP address the gossip listens on "
                        "(port 0: any free port)")
    seeds: tuple[str, ...] = setting((), _seeds, "host:port of peers to join through")
    key_file: str = setting("", _optional_path, "HMAC keys, one per line, the first signs "
                            "(empty: an open mesh, see insecure)")
    insecure: bool = setting(False, doc="allow an open mesh (no key_file) on an address other "
                             "hosts reach: anyone there can then publish snapshots and node ids")
    discovery: bool = setting(False, doc="find peers on the LAN by mDNS (_loadmesh._udp.local.)")


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
    """The router's settings (daemon/routing/), and its internal tuning."""

    choices: int = setting(3, between(1, 16), "d of the power of d choices")
    alternatives: int = setting(2, between(0, 16), "retry targets returned with each answer")
    # Sessions' slack: this node passes sessions on while its load per slot is above
    # (1 + epsilon) x its model's fleet's (routing/shed.py).
    epsilon: float = setting(0.15, in_range(0.01, 10), "load per slot above the fleet's, as a "
                             "fraction, at which a host starts passing its sessions on")
    # At least 100 for an even spread.
    vnodes: int = setting(160, between(100, 10_000), "ring points per peer")
    slow_start_s: float = setting(30.0, in_range(0, 3600), "ramp of a joined or recovered peer")
    slow_start_floor: float = 0.1      # the ramp's starting fraction
    breaker_failures: int = setting(3, between(1, 1000), "consecutive failures (errors or "
                                    "timeouts) that open a circuit")
    breaker_cooldown_s: float = setting(10.0, in_range(0, 3600),
                                        "open time before a trial request")
    error_ratio_threshold: float = setting(0.05, in_range(0, 1),
                                           "a peer reporting more errors than this is degraded")
    degraded_weight: float = 0.75      # capacity factor of a degraded peer
    overloaded_weight: float = 0.5     # capacity factor of an overloaded peer
    # A snapshot older than this no longer says anything about the peer's load: such
    # peers are used only when no peer with a fresh one is left (config_rules.py: how it
    # must compare with load.heartbeat_ms).
    freshness_s: float = setting(15.0, in_range(0.1, 3600), "older snapshots count as stale")
    # Scaling of this node's own traffic since a snapshot to the fleet's (p2c.OwnShare).
    own_share_half_life_s: float = 10.0
    own_share_cap: float = 32.0
    static_models: dict[str, tuple[str, ...]] = setting(
        {}, None, "node_id -> models it serves before traffic shows them")
    seed: int | None = None            # for reproducible draws (tests, simulator)
    # The thresholds a peer's score is judged by: the agent's own [load] ones (Config joins
    # them), so that this node calls a peer degraded where it would call itself so.
    score: ScoreConfig = field(default_factory=ScoreConfig)

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.own_share_half_life_s > 0 or not self.own_share_cap >= 1:
            raise ValueError("own_share_half_life_s must be positive, own_share_cap >= 1")
        if not all(0 < w <= 1 for w in (self.slow_start_floor, self.degraded_weight,
                                        self.overloaded_weight)):
            raise ValueError("slow_start_floor, degraded_weight and overloaded_weight must be "
                             "in (0, 1]")


@dataclass(frozen=True)
class ApiConfig:
    socket: str = setting("/run/loadmesh/loadmesh.sock", _absolute_path, "local API Unix socket")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = setting("127.0.0.1:9464", _ip_port_or_off, "address of the Prometheus "
                          "exporter's HTTP /metrics (empty: no exporter)")
    model_labels: int = setting(64, between(1, 4096), "models with series of their own "
                                "(clients name them); later ones count under model=\"(other)\"")

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class LoadConfig(ScoreConfig):
    """The score's settings (daemon/score.py holds them) and the snapshot's timing."""

    tick_ms: int = setting(250, between(100, 60_000), "how often the snapshot is rebuilt")
    heartbeat_ms: int = setting(5000, between(500, 600_000),
                                "the version moves at least this often, changed or not")
    queue_deadband: float = setting(0.0, in_range(0, 1000),
                                    "a model's in-flight, waiting or running count "
                                    "moves the version when it changes by more than this "
                                    "many requests (0: any change; a fleet of hundreds of "
                                    "hosts may trade routing precision for gossip bytes "
                                    "with 2)")
    list_models_s: float = setting(30.0, in_range(0, 86_400),
                                   "how often each serving port's GET /v1/models is asked, so "
                                   "that peers route a model here before its first request "
                                   "(0: never)")


@dataclass(frozen=True)
class Config:
    node_id: str = setting("", _node_id, "this node's name in the mesh (default: host name)")
    log_level: str = setting("info", _log_level, "debug, info, warning or error")
    advertise: str = setting("", _advertise, "host peers send inference requests to "
                             "(default: this host's first non-loopback address)")
    state_dir: str = setting("/var/lib/loadmesh", _absolute_path, "where state survives restarts")
    probes: ProbesConfig = section(ProbesConfig, "the eBPF probes (docs/probes.md)")
    gossip: GossipConfig = section(GossipConfig, "the mesh (docs/gossip.md)")
    api: ApiConfig = section(ApiConfig, "the local API")
    metrics: MetricsConfig = section(MetricsConfig, "the Prometheus exporter")
    load: LoadConfig = section(LoadConfig, "this node's snapshot and score (docs/snapshot.md)")
    routing: RoutingConfig = section(RoutingConfig, "the choice of a peer (docs/routing.md)")

    def __post_init__(self) -> None:
        check_settings(self)
        # Frozen, but made here: every Config, parsed or replaced on a reload, joins them.
        object.__setattr__(self, "routing", dataclasses.replace(self.routing, score=self.load))


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
    keys = [f.name for f in settings_of(cls)]
    unknown = sorted(set(table) - set(keys))
    if unknown:
        known = ", ".join(sorted(keys))
        raise ConfigError(source, prefix + unknown[0], f"unknown key (known here: {known})")
    values: dict[str, Any] = {}
    for name in keys:
        key = prefix + name
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            sub = table.get(name, {})
            if not isinstance(sub, dict):
                raise ConfigError(source, key, f"expected a table, got {_describe(sub)}")
            values[name] = _build(kind, sub, source, key + ".")
        elif name in table:
            values[name] = _coerce(table[name], kind, source, key)
    try:
        return cls(**values)
    except SettingError as exc:
        raise ConfigError(source, prefix + exc.name, exc.problem) from None
    except ValueError as exc:  # keys of one section checked together: the message names them
        raise ConfigError(source, prefix.rstrip("."), str(exc)) from None


def parse(text: str, source: str = "<config>") -> Config:
    """Parse TOML text into a Config; `source` names the file in every error."""
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, "", f"not valid TOML: {exc}") from None
    config: Config = _build(Config, table, source, "")
    broken = config_rules.broken(config)
    if broken:
        raise ConfigError(source, *broken)
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

    def emit(cls: type, instance: Any, prefix: str) -> None:
        nested = []
        for f in settings_of(cls):
            value = getattr(instance, f.name)
            if dataclasses.is_dataclass(value):
                nested.append((f, value))
                continue
            lines.append(f"# {f.metadata['doc']}")
            lines.append(f"{f.name} = {_toml_value(value)}")
        for f, value in nested:
            lines.extend(["", f"# {f.metadata['doc']}", f"[{prefix}{f.name}]"])
            emit(type(value), value, f"{prefix}{f.name}.")

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
