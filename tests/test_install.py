"""scripts/install.sh and uninstall.sh into a staging tree (DESTDIR): the tree they make,
what a second install keeps, what uninstall leaves. Nothing outside the tree changes."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from loadmesh.gossip.keyring import load_keyring

REPO = Path(__file__).parents[1]
HOST_PATHS = [Path(p) for p in ("/opt/loadmesh", "/etc/loadmesh", "/etc/systemd/system/loadmesh.service",
                                "/etc/sysusers.d/loadmesh.conf")]


def run(script: str, destdir: Path) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(["bash", str(REPO / "scripts" / script)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "DESTDIR": str(destdir)})
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def loadmesh(destdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed package, run from the staging tree (its scripts name /opt)."""
    python = destdir / "opt/loadmesh/venv/bin/python"
    return subprocess.run([str(python), "-I", "-m", "loadmesh.daemon", *args], capture_output=True,
                          text=True, timeout=60)


def host_state() -> dict[Path, float | None]:
    return {p: p.stat().st_mtime if p.exists() else None for p in HOST_PATHS}


@pytest.fixture
def destdir(tmp_path: Path) -> Path:
    return tmp_path / "stage"


def test_install_upgrade_and_uninstall_in_a_staging_tree(destdir: Path) -> None:
    host_before = host_state()
    first = run("install.sh", destdir)
    assert "not enabling or starting the service" in first.stderr

    venv = destdir / "opt/loadmesh/venv"
    assert (venv / "bin/loadmesh").read_text().splitlines()[0] == "#!/opt/loadmesh/venv/bin/python"
    assert str(destdir) not in (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()  # bcc
    unit = destdir / "etc/systemd/system/loadmesh.service"
    assert unit.read_text() == (REPO / "systemd/loadmesh.service").read_text()
    assert (destdir / "opt/loadmesh/doc/operations.md").exists()
    assert (destdir / "etc/sysusers.d/loadmesh.conf").read_text().startswith("u loadmesh ")

    conf = destdir / "etc/loadmesh/loadmesh.toml"
    text = conf.read_text()
    # Every key is there with its documentation, commented out: defaults stay defaults.
    assert "# fanout = 3" in text and "# gossip round period" in text
    assert 'key_file = "/etc/loadmesh/gossip.key"' in text.splitlines()
    staged = conf.with_name("staged.toml")  # the same file, pointing at the staged key
    staged.write_text(text.replace("/etc/loadmesh/gossip.key", str(conf.with_name("gossip.key"))))
    assert loadmesh(destdir, "config", "check", str(staged)).returncode == 0
    key = destdir / "etc/loadmesh/gossip.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert len(load_keyring(key).primary) == 32

    # An upgrade: the operator's configuration and the fleet's key stay as they are.
    conf.write_text(text.replace("# fanout = 3", "fanout = 4"))
    key.write_text("00" * 32 + "\n")
    second = run("install.sh", destdir)
    assert "keeping the existing" in second.stderr
    assert "fanout = 4" in conf.read_text() and key.read_text() == "00" * 32 + "\n"
    assert loadmesh(destdir, "config", "defaults").returncode == 0

    run("uninstall.sh", destdir)
    assert not (destdir / "opt/loadmesh").exists() and not unit.exists()
    assert not (destdir / "etc/sysusers.d/loadmesh.conf").exists()
    assert conf.exists() and key.exists()
    assert host_state() == host_before


def test_install_refuses_a_configuration_the_new_version_rejects(destdir: Path) -> None:
    conf = destdir / "etc/loadmesh/loadmesh.toml"
    conf.parent.mkdir(parents=True)
    conf.write_text("[gossip]\nfanout = 0\n")
    out = subprocess.run(["bash", str(REPO / "scripts/install.sh")], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "DESTDIR": str(destdir)})
    assert out.returncode == 1
    assert "does not pass `loadmesh config check`" in out.stderr
    assert "gossip.fanout" in out.stderr + out.stdout
    assert not (destdir / "etc/systemd/system/loadmesh.service").exists()
