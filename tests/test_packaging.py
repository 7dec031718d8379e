"""The wheel: one top-level package, `loadmesh`, whatever else shares its site-packages.

probes/, daemon/ and gossip/ sit at the root of the tree but install as loadmesh.probes,
loadmesh.daemon and loadmesh.gossip (pyproject.toml's package-dir): `daemon` is also
python-daemon's import name, and a top-level `daemon` of ours would shadow it or be
shadowed by it. The wheel is built from a copy of the tree (no build/ or egg-info left in
the checkout, nothing stale from an earlier build in the wheel), with this venv's
setuptools (--no-build-isolation: no index needed).

The last test installs the wheel into a fresh venv beside python-daemon itself, installed
from the package index when that answers within 60 s; where it does not (a host without
network), a stand-in `daemon/__init__.py` with a marker takes its place in that venv's
site-packages, which is all the collision needs. The venv reaches loadmesh's dependencies
through a .pth file naming this venv's site-packages, appended after its own, so neither
this checkout nor its editable install is visible there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import warnings
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The folders at the root and the package each installs as.
PARTS = {"probes": "loadmesh/probes", "daemon": "loadmesh/daemon", "gossip": "loadmesh/gossip"}
DIST_INFO = re.compile(r"loadmesh-[^/]+\.dist-info/")
STAND_IN_MARKER = "LOADMESH_TEST_STAND_IN"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"
    shutil.copytree(REPO, tree, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        ".hypothesis"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                          "--no-build-isolation", "--disable-pip-version-check",
                          "-w", str(work / "dist"), str(tree)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    [built] = (work / "dist").glob("loadmesh-*.whl")
    return built


def names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def test_only_loadmesh_at_top_level(wheel: Path) -> None:
    outside = [n for n in names(wheel) if not n.startswith("loadmesh/") and not DIST_INFO.match(n)]
    assert outside == []
    with zipfile.ZipFile(wheel) as z:
        [top_level] = [n for n in z.namelist() if n.endswith(".dist-info/top_level.txt")]
        assert z.read(top_level).decode().split() == ["loadmesh"]
        [entry_points] = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        assert "loadmesh = loadmesh.daemon.cli:main" in z.read(entry_points).decode()


def test_every_module_and_probe_source_ships(wheel: Path) -> None:
    """Each folder's Python files (subpackages too: the packages list is explicit) and the
    probes' C sources and headers, which BCC compiles at run time."""
    wanted = {"loadmesh/__init__.py"}
    for folder, package in PARTS.items():
        for path in (REPO / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix == ".py" or (folder == "probes" and path.name.endswith((".bpf.c", ".h"))):
                wanted.add(f"{package}/{path.relative_to(REPO / folder).as_posix()}")
    assert any(n.endswith(".bpf.c") for n in wanted) and any(n.endswith(".h") for n in wanted)
    assert sorted(wanted - set(names(wheel))) == []


def _python_daemon(venv_python: Path, site: Path) -> str:
    """python-daemon into the venv if the index answers within 60 s, else a stand-in."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv_python), "install",
                              "-q", "--disable-pip-version-check", "--timeout", "15",
                              "--retries", "1", "python-daemon"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return "python-daemon"
    except subprocess.TimeoutExpired:
        pass
    shutil.rmtree(site / "daemon", ignore_errors=True)
    (site / "daemon").mkdir()
    (site / "daemon" / "__init__.py").write_text(f"{STAND_IN_MARKER} = True\n")
    warnings.warn("python-daemon could not be installed: a stand-in `daemon` took its place")
    return "stand-in"


def test_installs_beside_python_daemon(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    # loadmesh's dependencies (msgpack, psutil, ...) from this venv, after the new venv's own.
    (site / "loadmesh-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    other = _python_daemon(python, site)
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                          "--disable-pip-version-check", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr

    check = (
        "import daemon, loadmesh, loadmesh.daemon.cli, loadmesh.daemon.agent, "
        "loadmesh.probes.maps, loadmesh.gossip.protocol\n"
        f"assert hasattr(daemon, 'DaemonContext') or hasattr(daemon, {STAND_IN_MARKER!r}), daemon\n"
        "for m in (daemon, loadmesh, loadmesh.daemon.cli, loadmesh.probes.maps, loadmesh.gossip.protocol):\n"
        "    print(m.__file__)\n"
    )
    # -I and a directory outside the checkout: nothing but the venv's site-packages counts.
    out = subprocess.run([str(python), "-I", "-c", check], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, f"with {other}: {out.stdout}{out.stderr}"
    files = out.stdout.split()
    assert len(files) == 5 and all(f.startswith(str(site) + "/") for f in files), files
    assert files[0] == str(site / "daemon" / "__init__.py")
    assert files[2] == str(site / "loadmesh" / "daemon" / "cli.py")

    cli = subprocess.run([str(venv / "bin" / "loadmesh"), "--help"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and cli.stdout.startswith("usage: loadmesh"), cli.stdout + cli.stderr
