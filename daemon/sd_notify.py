"""systemd's notify protocol, spoken directly: one datagram per message to $NOTIFY_SOCKET.

Type=notify makes systemd wait for READY=1 (so `systemctl start` returns once the API
answers and the probes are attached), and WatchdogSec makes it kill an agent that stops
sending WATCHDOG=1. The protocol is a few lines of socket code, so no libsystemd binding:
outside systemd ($NOTIFY_SOCKET unset) every call does nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping

from loadmesh.daemon import logs

log = logs.get("sd_notify")


def _address(value: str) -> str | None:
    # "@name" is a socket in the abstract namespace, spelled with a leading NUL in sun_path.
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


class Notifier:
    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self._address = _address(environ.get("NOTIFY_SOCKET", ""))
        self._watchdog_s = _watchdog_interval(environ)
        self._failed = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to send WATCHDOG=1 (half the timeout systemd set), None without one."""
        return self._watchdog_s if self.enabled else None

    def send(self, *fields: str) -> bool:
        """Send "KEY=value" fields as one message; False when it could not be sent."""
        if self._address is None:
            return False
        message = "\n".join(fields).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto(message, self._address)
        except OSError as exc:
            # Logged once: a lost READY=1 shows as a start timeout in systemd anyway, and a
            # watchdog that cannot reach systemd would otherwise log twice a period.
            if not self._failed:
                log.warning("cannot notify systemd at %s: %s", self._address.lstrip("\0"),
                            exc.strerror or exc)
                self._failed = True
            return False
        return True

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets Type=notify-reload (systemd 253+) match this to its request.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self) -> None:
        self.send("STOPPING=1")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")


def _watchdog_interval(environ: Mapping[str, str]) -> float | None:
    """Half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises; None when the watchdog is
    off or meant for another process ($WATCHDOG_PID names a different pid)."""
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6
