"""Shared fixtures: real agent processes with their own config, socket and logs."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

LOADMESH = str(Path(sys.executable).with_name("loadmesh"))

# `make test` runs the suite on several workers (pytest-xdist, --dist loadscope): a module
# runs whole on one worker, so that its module fixtures (a fleet's 45 s run, a compiled
# probe set) are made once; the workers take the modules in this order. The longest start
# first, or the last of them would be running alone at the end.
LONGEST = ("test_fleet_routing.py", "test_fleet_sessions.py", "test_llm_traffic.py",
           "test_mesh.py", "test_hostile_gossip.py", "test_probes_traffic.py", "test_install.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)

    items.sort(key=rank)


class AgentProcess:
    """One `loadmesh agent` process; always killed at the end of the test that made it."""

    def __init__(self, workdir: Path, config_text: str) -> None:
        self.workdir = workdir
        self.config_path = workdir / "loadmesh.toml"
        self.config_path.write_text(config_text)
        self.log_path = workdir / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [LOADMESH, "agent", "--config", str(self.config_path)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, socket_path: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode}: {self.logs()}")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(socket_path)
                if "ready" in self.logs():
                    return
            except OSError:
                pass
            finally:
                probe.close()
            time.sleep(0.05)
        raise AssertionError(f"agent not ready after {timeout}s: {self.logs()}")

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """A short private directory for sockets: sun_path is limited to 107 bytes, and
    pytest's tmp_path can come close to that."""
    path = Path(tempfile.mkdtemp(prefix="lm-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def agent_config(socket_path: Path | str, node_id: str = "test-node", extra: str = "",
                 probes: str = "interfaces = []",
                 gossip: str = 'bind = "127.0.0.1:0"', metrics: str = 'listen = ""') -> str:
    """A test agent's config: its own node id, socket and state directory (beside the
    socket), probes off unless the test attaches them somewhere, gossip on a free loopback
    port unless the test builds a mesh, no metrics exporter unless the test scrapes one (they
    would all want port 9464), then what the test adds."""
    state_dir = Path(socket_path).parent / f"state-{node_id}"
    return (f'node_id = "{node_id}"\nstate_dir = "{state_dir}"\n{extra}\n'
            f'[api]\nsocket = "{socket_path}"\n[probes]\n{probes}\n'
            f'[gossip]\n{gossip}\n[metrics]\n{metrics}\n')


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[Callable[[str], AgentProcess]]:
    made: list[AgentProcess] = []

    def make(config_text: str) -> AgentProcess:
        workdir = tmp_path / f"agent{len(made)}"
        workdir.mkdir()
        made.append(AgentProcess(workdir, config_text))
        return made[-1]

    yield make
    for agent in made:
        agent.kill()
