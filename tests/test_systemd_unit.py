"""systemd/loadmesh.service: it verifies, its hardening scores what it scored when it was
reviewed, and the agent runs its probes within it: as an unprivileged user holding only
the unit's capabilities, under the unit's system call filter (tests/unit_sandbox.py
applies it, systemd not being PID 1 here). Each capability is shown necessary."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import nettopo
from conftest import LOADMESH
from metrics_helpers import free_port, metrics_config, scrape, wait_for
from unit_sandbox import unit_settings

UNIT = Path(__file__).parents[1] / "systemd" / "loadmesh.service"
SANDBOX = str(Path(__file__).with_name("unit_sandbox.py"))
# systemd-analyze security's exposure (0 safest .. 10) when the unit was last reviewed;
# a change that loosens the sandbox makes this test fail until the bound is revisited.
EXPOSURE = 2.2
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespace, BPF)")


@needs_root
def test_the_unit_verifies_against_the_installed_layout() -> None:
    # A private mount namespace puts this checkout's loadmesh where the unit expects it,
    # without touching the host's /opt.
    script = ("mount -t tmpfs tmpfs /opt && mkdir -p /opt/loadmesh/venv/bin && "
              f"ln -s {LOADMESH} /opt/loadmesh/venv/bin/loadmesh && "
              f"exec systemd-analyze verify {UNIT}")
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout + out.stderr == "", out.stdout + out.stderr


def test_the_exposure_score_has_not_regressed() -> None:
    out = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(UNIT)],
                         capture_output=True, text=True, timeout=60)
    found = re.search(r"Overall exposure level for loadmesh\.service: (\d+\.\d+)", out.stdout)
    assert found, out.stdout + out.stderr
    assert float(found.group(1)) <= EXPOSURE, out.stdout


def _capabilities() -> list[str]:
    settings = unit_settings(UNIT)
    (ambient,), (bounding,) = settings["AmbientCapabilities"], settings["CapabilityBoundingSet"]
    assert ambient.split() == bounding.split(), "the agent holds exactly what it may ever hold"
    return ambient.split()


def _sandboxed(capabilities: list[str], config: Path) -> list[str]:
    """The agent as the unit runs it, with nobody standing in for user loadmesh."""
    caps = ",".join(["-all", *(f"+{c.removeprefix('CAP_').lower()}" for c in capabilities)])
    return [shutil.which("setpriv") or "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
            "--clear-groups", "--no-new-privs", f"--bounding-set={caps}",
            f"--inh-caps={caps}", f"--ambient-caps={caps}",
            sys.executable, SANDBOX, str(UNIT), LOADMESH, "agent", "--config", str(config)]


@pytest.fixture
def nobody_can_run_the_checkout() -> None:
    """The sandboxed agent runs as nobody: a checkout under a private directory (root's
    home, say) is out of its reach, which says nothing about the unit."""
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            sys.executable, "-c", "import loadmesh.daemon.agent"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run this checkout: {probe.stderr.strip()[-200:]}")


class Sandboxed:
    """One sandboxed agent with its files where user nobody can reach them."""

    def __init__(self, home: Path, host_if: str, capabilities: list[str]) -> None:
        home.chmod(0o755)
        (home / "run").mkdir(exist_ok=True)
        os.chown(home / "run", NOBODY, NOBODY)
        self.sock = str(home / "run" / "loadmesh.sock")
        self.port = free_port()
        self.config = home / "loadmesh.toml"
        self.config.write_text(
            f'node_id = "sandboxed"\nstate_dir = "{home}/run/state"\n'
            f'[metrics]\n{metrics_config(self.port)}\n[api]\nsocket = "{self.sock}"\n[gossip]\nbind = "127.0.0.1:0"\n'
            f'[probes]\ninterfaces = ["{host_if}"]\nports = [8000]\nrequired = true\n')
        self.log = home / "agent.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(_sandboxed(capabilities, self.config), stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@needs_root
@pytest.mark.usefixtures("nobody_can_run_the_checkout")
def test_the_probes_run_with_the_units_capabilities_and_filter(run_dir: Path) -> None:
    with nettopo.veth_netns() as topo:
        agent = Sandboxed(run_dir, topo.host_if, _capabilities())
        try:
            wait_for(lambda: "ready" in agent.logs() or agent.proc.poll() is not None,
                     timeout=60, what="the sandboxed agent")
            assert "probes ok" in agent.logs(), agent.logs()
            assert "loadmesh_node_info" in scrape(agent.port)
            agent.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: "no change to apply" in agent.logs(), what="the reload")
            agent.proc.send_signal(signal.SIGTERM)
            assert agent.proc.wait(30) == 0, agent.logs()
        finally:
            agent.stop()
        assert nettopo.attached(topo.host_if) == []


@needs_root
@pytest.mark.usefixtures("nobody_can_run_the_checkout")
@pytest.mark.parametrize("missing", _capabilities())
def test_each_capability_is_needed(run_dir: Path, missing: str) -> None:
    with nettopo.veth_netns() as topo:
        agent = Sandboxed(run_dir, topo.host_if, [c for c in _capabilities() if c != missing])
        try:
            assert agent.proc.wait(60) == 78, agent.logs()  # EX_CONFIG: not restarted into
        finally:
            agent.stop()
        assert "cannot start probes" in agent.logs()
