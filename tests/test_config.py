"""Configuration: defaults, overrides, and errors that name the file and the key."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from loadmesh.daemon import config
from loadmesh.daemon.config import ConfigError


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
    ("[gossip]\nsuspect_after_ms = 5000\n", "gossip"),
    ("[gossip]\nsuspect_after_ms = 1000\ndead_after_ms = 2000\n", "gossip"),
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
