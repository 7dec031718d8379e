"""Log lines: one per event, with journald priorities when stderr is the journal."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = """
from loadmesh.daemon import logs
logs.setup("info")
logs.get("agent").info("node %s ready", "n1")
logs.get("gossip").warning("two\\nlines")
logs.get("probes").debug("hidden below info")
"""


def run(stderr_path: Path, journal: bool) -> list[str]:
    with open(stderr_path, "wb") as err:
        env = dict(os.environ)
        env.pop("JOURNAL_STREAM", None)
        if journal:
            st = os.fstat(err.fileno())
            env["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        subprocess.run([sys.executable, "-c", SCRIPT], stderr=err, env=env, check=True)
    return stderr_path.read_text().splitlines()


def test_journal_lines_carry_syslog_priority_and_no_timestamp(tmp_path: Path) -> None:
    assert run(tmp_path / "err", journal=True) == [
        "<6>agent: node n1 ready",
        "<4>gossip: two | lines",
    ]


def test_terminal_lines_carry_utc_time_and_level(tmp_path: Path) -> None:
    lines = run(tmp_path / "err", journal=False)
    assert len(lines) == 2
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z info    agent: node n1 ready", lines[0])
    assert lines[1].endswith("warning gossip: two | lines")
