"""Runs a command under the seccomp rules a systemd unit asks for, where systemd itself is
not there to apply them (systemd is not PID 1 on the test machines):

    python3 tests/unit_sandbox.py UNIT_FILE COMMAND...

It reads the unit's SystemCallFilter= lines (groups expanded by `systemd-analyze
syscall-filter`), SystemCallErrorNumber=, MemoryDenyWriteExecute= and
RestrictAddressFamilies=, installs the same filter with libseccomp (as systemd's
seccomp-util.c builds it), and execs COMMAND. The caller drops the user and the
capabilities first (setpriv), with no_new_privs set, which seccomp requires.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
from pathlib import Path

import seccomp

PROT_WRITE, PROT_EXEC = 0x2, 0x4
SHM_EXEC = 0o100000
MAX_FAMILY = 64


def unit_settings(path: str | Path) -> dict[str, list[str]]:
    """Every Key=value of a unit file, values of repeated keys in order."""
    out: dict[str, list[str]] = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")) and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def syscall_groups() -> dict[str, list[str]]:
    text = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager"], check=True,
                          capture_output=True, text=True).stdout
    groups: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        item = line.strip()
        if not item or item.startswith("#"):
            continue
        if not line[0].isspace():
            current = groups.setdefault(item, [])
        else:
            current.append(item)
    return groups


def expand(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    out: set[str] = set()
    for name in names:
        out |= expand(groups[name], groups) if name.startswith("@") else {name}
    return out


def allowed_syscalls(filters: list[str], groups: dict[str, list[str]]) -> set[str]:
    """An allow list (the first line) minus the `~` lines, plus later allow lines."""
    allowed: set[str] = set()
    for line in filters:
        if line.startswith("~"):
            allowed -= expand(line[1:].split(), groups)
        else:
            allowed |= expand(line.split(), groups)
    return allowed


def build_filter(settings: dict[str, list[str]]) -> seccomp.SyscallFilter:
    number = settings.get("SystemCallErrorNumber", ["EPERM"])[-1]
    refuse = seccomp.ERRNO(getattr(errno, number))
    f = seccomp.SyscallFilter(refuse)
    mdwe = settings.get("MemoryDenyWriteExecute", ["no"])[-1] == "yes"
    special = {"socket"} | ({"mmap", "mprotect", "pkey_mprotect", "shmat"} if mdwe else set())
    for name in sorted(allowed_syscalls(settings["SystemCallFilter"], syscall_groups()) - special):
        try:
            f.add_rule(seccomp.ALLOW, name)
        except (RuntimeError, ValueError):
            pass  # a name this architecture does not have
    if mdwe:
        wx = PROT_WRITE | PROT_EXEC
        for prot in (0, PROT_WRITE, PROT_EXEC):
            f.add_rule(seccomp.ALLOW, "mmap", seccomp.Arg(2, seccomp.MASKED_EQ, wx, prot))
        for name in ("mprotect", "pkey_mprotect"):
            f.add_rule(seccomp.ALLOW, name, seccomp.Arg(2, seccomp.MASKED_EQ, PROT_EXEC, 0))
        f.add_rule(seccomp.ALLOW, "shmat", seccomp.Arg(2, seccomp.MASKED_EQ, SHM_EXEC, 0))
    families = {getattr(socket, name) for line in settings["RestrictAddressFamilies"]
                for name in line.split()}
    for family in range(MAX_FAMILY):
        action = seccomp.ALLOW if family in families else seccomp.ERRNO(errno.EAFNOSUPPORT)
        f.add_rule(action, "socket", seccomp.Arg(0, seccomp.EQ, family))
    return f


def main() -> None:
    unit, *command = sys.argv[1:]
    build_filter(unit_settings(unit)).load()
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
