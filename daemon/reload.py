"""Configuration reload (SIGHUP): reread the file, apply what can change in a running
agent, and name what needs a restart.

Applied in place: log_level, the serving ports (probe filter and advertised endpoints),
gossip seeds and key file (a key rotation edits the file and reloads: it is reread on
every reload), every routing setting, the score's weights and thresholds, and how often
the servers' model lists are asked. Everything else (addresses, sockets, interfaces, node
identity, map and timing sizes) is bound into sockets, maps or timers at start: a change to it is logged as
needing a restart and the running value stays, so the next reload names it again until
the agent restarts.

A file that does not parse, or a key file that cannot be read, changes nothing: the
error is logged with the file and the key, and the agent keeps its running configuration.
So does a file without a key file where the running mesh is keyed: a reload never opens
a keyed mesh (a line lost in an edit would drop every signature); a restart does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from loadmesh.daemon import config as config_mod
from loadmesh.daemon import config_rules
from loadmesh.daemon import logs
from loadmesh.daemon.config import Config, ConfigError
from loadmesh.daemon.gossip_component import GossipComponent
from loadmesh.daemon.probes_component import ProbesComponent
from loadmesh.daemon.routing_component import RoutingComponent
from loadmesh.daemon.snapshot_component import SnapshotComponent
from loadmesh.gossip.keyring import Keyring, load_keyring
from loadmesh.settings import settings_of

log = logs.get("reload")

# Dotted keys (or whole sections) a running agent takes without a restart.
RELOADABLE = ("log_level", "probes.ports", "gossip.seeds", "gossip.key_file", "routing",
              "load.degraded_at", "load.overloaded_at", "load.weights", "load.list_models_s")


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configurations (or sections)."""
    out = []
    for f in settings_of(type(old)):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if dataclasses.is_dataclass(a):
            out += changed_keys(a, b, f"{prefix}{f.name}.")
        elif a != b:
            out.append(prefix + f.name)
    return out


def reloadable(key: str) -> bool:
    return any(key == r or key.startswith(r + ".") for r in RELOADABLE)


def _get(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _with(config: Any, path: list[str], value: Any) -> Any:
    """config with the value at the path replaced (frozen dataclasses all the way down)."""
    head, *rest = path
    new = _with(getattr(config, head), rest, value) if rest else value
    return dataclasses.replace(config, **{head: new})


def merge(running: Config, new: Config, keys: list[str]) -> Config:
    """running, with the given keys taken from new."""
    for key in keys:
        running = _with(running, key.split("."), _get(new, key))
    return running


class Reloader:
    """Rereads the agent's file and applies it to the running components."""

    def __init__(self, path: str | None, probes: ProbesComponent, snapshot: SnapshotComponent,
                 gossip: GossipComponent, routing: RoutingComponent) -> None:
        self.path = path
        self.probes = probes
        self.snapshot = snapshot
        self.gossip = gossip
        self.routing = routing
        # For the exporter, as Prometheus reports its own reloads.
        self.last_ok = True
        self.last_success_s = time.time()

    async def reload(self, running: Config) -> Config:
        """The configuration now in effect: running, with what could be applied from the
        file. Never raises: a problem is logged and leaves running as it was."""
        if self.path is None:
            log.warning("the agent runs on its defaults (no --config): nothing to reread")
            return running
        try:
            new = await asyncio.to_thread(config_mod.load, self.path)
            if running.gossip.key_file and not new.gossip.key_file:
                raise ConfigError(self.path, "gossip.key_file",
                                  "empty where the running mesh is keyed: a reload never "
                                  "opens a keyed mesh (restart the agent to run it open)")
            keyring = await self._keyring(new)
            changed = changed_keys(running, new)
            apply = [k for k in changed if reloadable(k)]
            effective = merge(running, new, apply)
            broken = config_rules.broken(effective)
            if broken:
                key, problem = broken
                raise ConfigError(self.path, key, f"{problem} (as it would run: the keys that "
                                                  f"need a restart keep their running values)")
            if "probes.ports" in apply:
                # First: the one step that can still refuse (more ports than the probes
                # watch), before anything else has changed.
                try:
                    await self.probes.set_ports(new.probes.ports)
                except ValueError as exc:
                    raise ConfigError(self.path, "probes.ports", str(exc)) from None
        except ConfigError as exc:
            self.last_ok = False
            log.error("failed, keeping the running configuration: %s", exc)
            return running
        await self._apply(effective, apply, keyring)
        self.last_ok = True
        self.last_success_s = time.time()
        log.info("%s", f"applied {', '.join(apply)}" if apply else "no change to apply")
        restart = [f"{k} (running {_get(running, k)!r}, file {_get(new, k)!r})"
                   for k in changed if not reloadable(k)]
        if restart:
            log.warning("changes that need a restart, not in effect: %s", "; ".join(restart))
        return effective

    async def _keyring(self, new: Config) -> Keyring | None:
        """The key file's keys, reread on every reload: rotating keys only edits the file."""
        if not new.gossip.key_file:
            return None
        try:
            return await asyncio.to_thread(load_keyring, new.gossip.key_file)
        except ValueError as exc:
            raise ConfigError(self.path or "", "gossip.key_file", str(exc)) from None

    async def _apply(self, new: Config, keys: list[str], keyring: Keyring | None) -> None:
        """The steps that cannot fail once the file has been checked."""
        if "log_level" in keys:
            logs.setup(new.log_level)
        if any(k == "probes.ports" or k.startswith("load.") for k in keys):
            self.snapshot.reconfigure(new)
        if keyring is not None:
            self.gossip.set_keyring(new.gossip.key_file, keyring)
        if "gossip.seeds" in keys:
            await self.gossip.set_seeds(new.gossip.seeds)
        if any(k.startswith(("routing.", "load.degraded_at", "load.overloaded_at")) for k in keys):
            self.routing.reconfigure(new.routing)
