"""One line per event on stderr, in the form journald shows best.

Under systemd (stderr is the journal stream named by $JOURNAL_STREAM) each line starts with
the syslog priority in angle brackets, which journald turns into the entry's priority, and
carries no timestamp, since the journal adds its own. Anywhere else a line starts with a UTC
timestamp and the level, so a terminal or a log file reads the same way.
"""

from __future__ import annotations

import logging
import os
import sys
import time

_SYSLOG_PRIORITY = {
    logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6, logging.DEBUG: 7,
}


def _stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = stream.partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream != "" and f"{st.st_dev}:{st.st_ino}" == f"{device}:{inode}"


class _LineFormatter(logging.Formatter):
    def __init__(self, journal: bool) -> None:
        super().__init__()
        self._journal = journal

    def format(self, record: logging.LogRecord) -> str:
        # Newlines would split one event over several journal entries.
        message = record.getMessage().replace("\n", " | ")
        if record.exc_info:
            message += " | " + self.formatException(record.exc_info).replace("\n", " | ")
        source = record.name.removeprefix("loadmesh.")
        if self._journal:
            return f"<{_SYSLOG_PRIORITY.get(record.levelno, 6)}>{source}: {message}"
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        millis = int(record.msecs)
        return f"{stamp}.{millis:03d}Z {record.levelname.lower():<7} {source}: {message}"


# Loggers of loadmesh's own code, all under "loadmesh": the components' (loadmesh.<component>)
# and the modules of probes/ and gossip/, which log under their module names (such as
# loadmesh.probes.loader) since they must not depend on the daemon.
_OWN = ("loadmesh",)


def setup(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_LineFormatter(_stderr_is_journal()))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries (pyroute2, zeroconf) speak only when something is wrong.
    root.setLevel(logging.WARNING)
    for name in _OWN:
        logging.getLogger(name).setLevel(level.upper())


def get(component: str) -> logging.Logger:
    return logging.getLogger(f"loadmesh.{component}")
