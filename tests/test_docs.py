"""The docs against the code: every configuration key with its default, every metric family
with its type and labels, every command and flag, every route decision's reason, every file
and test named (the API's endpoints: tests/test_endpoints.py). Each check reads the code's
own definitions (the settings, a collect() of the exporter, the argument parser, the Reason
enum, the tree), so a change to either side that the other does not follow fails here."""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

from loadmesh.daemon.cli import build_parser
from loadmesh.daemon.config import Config
from loadmesh.daemon.metrics import AgentCollector
from loadmesh.daemon.routing.reasons import Reason
from loadmesh.settings import settings_of
from test_metrics import _agent_view

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
CONFIGURATION = (ROOT / "docs" / "configuration.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
ALL_DOCS = README + "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row ("\\|" inside a cell is not a separator)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _schema(cls: type, section: str = "") -> dict[str, dict[str, Any]]:
    """Section ("" for the top level, "load.weights") -> key -> default, from the dataclasses'
    settings (their other fields are tuning set in code, not keys)."""
    out: dict[str, dict[str, Any]] = {section: {}}
    hints = typing.get_type_hints(cls)
    for f in settings_of(cls):
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(_schema(hints[f.name], f"{section}.{f.name}" if section else f.name))
        else:
            out[section][f.name] = default
    return out


def _documented_keys() -> dict[str, dict[str, str]]:
    """Section -> key -> default as written, from docs/configuration.md's tables."""
    out: dict[str, dict[str, str]] = {}
    section = None
    for line in CONFIGURATION.splitlines():
        heading = re.fullmatch(r"## (?:Top level|`\[([a-z_.]+)\]`)", line)
        if heading:
            section = heading.group(1) or ""
            out[section] = {}
        elif line.startswith("## "):
            section = None
        elif section is not None and line.startswith("| `"):
            key, default = _cells(line)[:2]
            out[section][key.strip("`")] = default.strip("`")
    return out


def _plain(value: Any) -> Any:
    """A default as TOML reads it back: tuples are arrays."""
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def test_every_configuration_key_is_documented_with_its_default() -> None:
    schema = _schema(Config)
    documented = _documented_keys()
    assert set(documented) == set(schema), "sections of docs/configuration.md vs the schema"
    for section, keys in schema.items():
        where = f"[{section}]" if section else "the top level"
        assert set(documented[section]) == set(keys), f"keys of {where}"
        for key, default in keys.items():
            written = tomllib.loads(f"v = {documented[section][key]}")["v"]
            assert written == _plain(default) and type(written) is type(_plain(default)), \
                f"{where} {key}: documented {documented[section][key]}, the schema says {default!r}"


def test_the_readme_example_uses_real_keys_with_their_defaults() -> None:
    example = README.split("```toml\n", 1)[1].split("```", 1)[0]
    schema = _schema(Config)
    for section, table in tomllib.loads(example).items():
        keys = table.items() if isinstance(table, dict) else [(section, table)]
        where = section if isinstance(table, dict) else ""
        for key, value in keys:
            assert key in schema[where], f"README's example: {where}.{key} is not a key"
            if key != "node_id":  # the example shows a host name where the default is ""
                assert value == _plain(schema[where][key]), f"README's example: {where}.{key}"


def _families() -> dict[str, tuple[str, set[str]]]:
    """Exposed name -> (type, label names) of every family the exporter writes."""
    out = {}
    for family in AgentCollector(_agent_view(), 64).collect():
        labels = {name for s in family.samples for name in s.labels} - {"le"}
        name = family.name + "_total" if family.type == "counter" else family.name
        out[name] = (family.type, labels)
    return out


def test_every_metric_family_is_in_the_operations_table_with_its_type_and_labels() -> None:
    table: dict[str, tuple[str, set[str]]] = {}
    for line in OPERATIONS.split("| family | type | labels | source |", 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        names, kind, labels = _cells(line)[:3]
        for name in re.findall(r"`(loadmesh_\w+)`", names):
            table[name] = (kind.split()[0].rstrip(","),
                           set(re.findall(r"`(\w+)`", labels)))
    assert table == _families()


def test_every_metric_name_the_docs_mention_is_exposed() -> None:
    exposed = set(_families())
    suffixes = ("_bucket", "_sum", "_count")
    for name in set(re.findall(r"\bloadmesh_[a-z0-9_]*[a-z0-9]\b", ALL_DOCS)):
        base = next((name.removesuffix(s) for s in suffixes if name.endswith(s)), name)
        assert name in exposed or base in exposed, f"the docs name {name}, which is not exposed"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[
        tuple[tuple[str, ...], argparse.ArgumentParser]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*path, name))
    return out or [(path, parser)]


def test_every_command_and_flag_is_in_the_readme() -> None:
    rows = [_cells(line)[0] for line in README.splitlines() if line.startswith("| `loadmesh ")]
    shared = README.split("Each client command", 1)[1].split("\n\n", 1)[0]
    for path, parser in _commands(build_parser()):
        row = next((r for r in rows if all(re.search(rf"\b{w}\b", r) for w in path)), None)
        assert row is not None, f"`loadmesh {' '.join(path)}` is not in the README's table"
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = [o for o in action.option_strings if o.startswith("--")]
            if not flags:  # a positional argument: its metavar
                assert (action.metavar or action.dest) in row, f"{path}: {action.metavar}"
                continue
            assert flags[0] in row or flags[0] in shared, f"loadmesh {' '.join(path)} {flags[0]}"


def test_every_route_decision_reason_is_in_the_operations_table() -> None:
    row = next(line for line in OPERATIONS.splitlines()
               if line.startswith("| `loadmesh_route_decisions_total`"))
    labels = _cells(row)[2]
    for outcome in ("routed", "no_peer"):
        assert outcome in labels
    documented = set(re.findall(r"[a-z_]+", labels.split("`reason`", 1)[1]))
    assert {r.label for r in Reason} <= documented
    assert documented - {r.label for r in Reason} <= {"routed", "no_peer"}


def test_every_file_and_test_the_docs_name_exists() -> None:
    # A path inside the tree, not one on the host (/etc/systemd/system/...).
    paths = set(re.findall(r"(?<![\w/.])((?:daemon|probes|gossip|scripts|tests|systemd|src|docs)"
                           r"/[\w./-]*\w)", ALL_DOCS))
    assert len(paths) >= 20
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []
    for path, name in re.findall(r"(tests/\w+\.py)::(\w+)", ALL_DOCS):
        assert f"def {name}(" in (ROOT / path).read_text(), f"{path}::{name}"


def test_every_dotted_key_the_docs_name_is_a_configuration_key() -> None:
    schema = _schema(Config)
    keys = {f"{section}.{key}" for section, table in schema.items() if section
            for key in table} | {section for section in schema if section}
    named = set(re.findall(r"`((?:probes|gossip|routing|load|api|metrics)\.[a-z_.]*[a-z_])"
                           r"(?:\.\*)?`", ALL_DOCS))
    assert len(named) >= 10
    assert sorted(n for n in named if n not in keys and not n.endswith(".md")) == []
