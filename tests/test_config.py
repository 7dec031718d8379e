"""Configuration: defaults, overrides, and errors that name the file and the key."""

from __future__ import annotations

import ast
import dataclasses
import socket
import subprocess
import typing
from collections import Counter
from pathlib import Path

import pytest

from conftest import LOADMESH
from loadmesh.daemon import config
from loadmesh.daemon.config import ConfigError
from loadmesh.daemon.score import ScoreConfig
from loadmesh.gossip.config import GossipParams
from loadmesh.settings import settings_of

REPO = Path(__file__).resolve().parent.parent


def parse_error(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        config.parse(text, "/etc/loadmesh/loadmesh.toml")
    return info.value


def test_no_file_gives_the_documented_defaults() -> None:
    c = config.load(None)
    assert c.node_id == socket.gethostname()
    assert c.probes.interfaces == ("lo",) and c.probes.ports == (8000,)
    assert c.probes.required is False
    assert c.gossip.bind == "0.0.0.0:7946" and c.gossip.seeds == ()
    assert c.gossip.interval_ms == 500 and c.gossip.fanout == 3
    assert c.api.socket == "/run/loadmesh/loadmesh.sock"
    assert c.metrics.listen == "127.0.0.1:9464"


def test_a_file_overrides_only_what_it_names(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('node_id = "gpu-a17"\n[gossip]\nfanout = 5\nseeds = ["10.0.0.1:7946", "[fd00::1]:7946"]\n')
    c = config.load(path)
    assert c.node_id == "gpu-a17"
    assert c.gossip.fanout == 5
    assert c.gossip.seeds == ("10.0.0.1:7946", "[fd00::1]:7946")
    assert c.gossip.interval_ms == 500 and c.probes.ports == (8000,)


@pytest.mark.parametrize("text, key", [
    ("fanout = 3\n", "fanout"),
    ("[gossip]\nfan_out = 3\n", "gossip.fan_out"),
    ("[probe]\nports = [1]\n", "probe"),
])
def test_unknown_key_is_named(text: str, key: str) -> None:
    err = parse_error(text)
    assert err.key == key
    assert str(err).startswith(f"/etc/loadmesh/loadmesh.toml: {key}: unknown key")


@pytest.mark.parametrize("text, key, problem", [
    ('[gossip]\nfanout = "3"\n', "gossip.fanout", "expected an integer, got a string"),
    ("[gossip]\nfanout = true\n", "gossip.fanout", "expected an integer, got a boolean"),
    ("[gossip]\ninterval_ms = 0.5\n", "gossip.interval_ms", "expected an integer, got a number"),
    ('[probes]\nports = ["8000"]\n', "probes.ports[0]", "expected an integer, got a string"),
    ('[probes]\nports = 8000\n', "probes.ports", "expected an array, got an integer"),
    ('[probes]\nrequired = "yes"\n', "probes.required", "expected a boolean, got a string"),
    ("node_id = 7\n", "node_id", "expected a string, got an integer"),
    ("probes = 1\n", "probes", "expected a table, got an integer"),
])
def test_wrong_type_is_named(text: str, key: str, problem: str) -> None:
    err = parse_error(text)
    assert (err.key, err.problem) == (key, problem)
    assert "/etc/loadmesh/loadmesh.toml" in str(err)


@pytest.mark.parametrize("text, key", [
    ("[probes]\nports = [0]\n", "probes.ports"),
    ("[probes]\nports = [70000]\n", "probes.ports"),
    ("[probes]\nports = []\n", "probes.ports"),
    ("[probes]\nports = [8000, 8000]\n", "probes.ports"),
    ('[probes]\ninterfaces = ["eth0/1"]\n', "probes.interfaces"),
    ('[probes]\ninterfaces = ["a-very-long-interface"]\n', "probes.interfaces"),
    ("[gossip]\nfanout = 0\n", "gossip.fanout"),
    ("[gossip]\ninterval_ms = 1\n", "gossip.interval_ms"),
    ('[gossip]\nbind = "0.0.0.0"\n', "gossip.bind"),
    ('[gossip]\nbind = "example.com:7946"\n', "gossip.bind"),
    ('[gossip]\nbind = "::1:7946"\n', "gossip.bind"),
    ('[gossip]\nseeds = ["10.0.0.1"]\n', "gossip.seeds"),
    ('[api]\nsocket = "loadmesh.sock"\n', "api.socket"),
    ('[api]\nsocket = "/' + "x" * 120 + '"\n', "api.socket"),
    ('[metrics]\nlisten = "127.0.0.1:99999"\n', "metrics.listen"),
    ('log_level = "chatty"\n', "log_level"),
    ('node_id = "has space"\n', "node_id"),
    ("[gossip]\nprobe_timeout_ms = 300\n", "gossip.probe_timeout_ms"),
    ("[gossip]\nsuspicion_min_ms = 700000\n", "gossip.suspicion_min_ms"),
    ("[load]\ndegraded_at = 0.9\noverloaded_at = 0.8\n", "load"),
    ("[load.weights]\ngpu_util = -1.0\n", "load.weights"),
])
def test_bad_value_is_named(text: str, key: str) -> None:
    assert parse_error(text).key == key


def test_ipv6_listen_addresses_are_accepted() -> None:
    c = config.parse('[gossip]\nbind = "[::]:7946"\n[metrics]\nlisten = "[::1]:9464"\n')
    assert c.gossip.bind == "[::]:7946"
    assert config.split_host_port(c.metrics.listen) == ("::1", 9464)


def test_toml_syntax_error_names_the_file() -> None:
    err = parse_error("[gossip\n")
    assert str(err).startswith("/etc/loadmesh/loadmesh.toml: not valid TOML")


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        config.load(missing)
    assert str(missing) in str(info.value) and "cannot read" in str(info.value)


def test_printed_defaults_parse_back_to_the_defaults() -> None:
    assert config.parse(config.defaults_toml()) == config.load(None)


def _schema_classes(cls: type) -> set[type]:
    """Every dataclass the schema is made of: the sections, the classes they extend, and
    the dataclasses they hold (the router's score thresholds)."""
    found = {c for c in cls.__mro__ if dataclasses.is_dataclass(c)}
    for f in dataclasses.fields(cls):
        kind = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(kind):
            found |= _schema_classes(kind)
    return found


def _keys(cls: type, prefix: str = "") -> list[str]:
    out = []
    for f in settings_of(cls):
        kind = typing.get_type_hints(cls)[f.name]
        nested = dataclasses.is_dataclass(kind)
        out += _keys(kind, f"{prefix}{f.name}.") if nested else [prefix + f.name]
    return out


def test_no_setting_is_defined_twice() -> None:
    classes = _schema_classes(config.Config)
    # Each field is defined in one class only: none copied into another section's class,
    # none redefined by a class that extends another.
    homes: dict[str, list[str]] = {}
    for cls in classes:
        for name in cls.__dict__.get("__annotations__", {}):
            homes.setdefault(name, []).append(cls.__qualname__)
    assert {n: h for n, h in homes.items() if len(h) > 1} == {}
    # No key twice in the schema, and every key a field of the class that uses it.
    keys = _keys(config.Config)
    assert len(keys) == len(set(keys))
    assert {"gossip.interval_ms", "gossip.bind", "load.degraded_at", "load.weights.cpu",
            "routing.freshness_s", "probes.ports"} <= set(keys)
    assert "routing.score" not in keys and "gossip.beat_interval_ms" not in keys
    # No second class of the same name anywhere in the package (there were two RoutingConfig).
    names = Counter(node.name for root in ("daemon", "gossip", "probes", "src")
                    for path in (REPO / root).rglob("*.py")
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.ClassDef))
    assert {c.__name__: names[c.__name__] for c in classes} == {c.__name__: 1 for c in classes}


def test_the_sections_are_what_the_components_use() -> None:
    c = config.load(None)
    assert isinstance(c.gossip, GossipParams) and isinstance(c.load, ScoreConfig)
    # The router judges peers by this node's own thresholds, also once they are replaced.
    assert c.routing.score == c.load
    changed = dataclasses.replace(c, load=dataclasses.replace(c.load, degraded_at=0.5))
    assert changed.routing.score.degraded_at == 0.5


# Each rule broken by one key, and the other key it names (config_rules.py).
CROSS_KEY = [
    # Rounds of 2.149 s: four of them (9.452 s) and the heartbeat's 5.55 s exceed 15 s.
    ("[gossip]\ninterval_ms = 2149\n", "routing.freshness_s", "load.heartbeat_ms"),
    # 5000 + 250 + 2200 + 300 ms = 7.75 s before a quiet peer's next snapshot is here.
    ("[routing]\nfreshness_s = 7.7\n", "routing.freshness_s", "load.heartbeat_ms"),
    ("[load]\nheartbeat_ms = 20000\n", "routing.freshness_s", "load.heartbeat_ms"),
    ("[load]\ntick_ms = 2000\nheartbeat_ms = 1000\n", "load.heartbeat_ms", "load.tick_ms"),
]


@pytest.mark.parametrize("text, key, other", CROSS_KEY)
def test_keys_that_depend_on_each_other_are_checked_together(text: str, key: str,
                                                             other: str) -> None:
    err = parse_error(text)
    assert err.key == key and other in err.problem


@pytest.mark.parametrize("text", [
    "[gossip]\ninterval_ms = 2148\n",
    "[routing]\nfreshness_s = 7.75\n",
    "[load]\nheartbeat_ms = 20000\n[routing]\nfreshness_s = 22.75\n",
    "[load]\ntick_ms = 1000\nheartbeat_ms = 1000\n",
])
def test_the_bounds_of_the_rules_are_accepted(text: str) -> None:
    config.parse(text)


@pytest.mark.parametrize("text, key, other", [CROSS_KEY[0], CROSS_KEY[2], CROSS_KEY[3]])
def test_the_agent_refuses_a_broken_rule_with_exit_78(tmp_path: Path, text: str, key: str,
                                                      other: str) -> None:
    path = tmp_path / "loadmesh.toml"
    path.write_text(text)
    run = subprocess.run([LOADMESH, "agent", "--config", str(path)], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == config.EXIT_CONFIG
    assert f"{path}: {key}: " in run.stderr and other in run.stderr
