"""The agent's own small files in its state directory, read and written as root.

Never through a symbolic link: a link planted in the state directory would make the agent
read, create or overwrite a file of the planter's choosing. A state file that the agent
did not write stops it with the file named (BadStateFile, exit 78) rather than being
guessed at.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class BadStateFile(Exception):
    """A state file the agent must not use; str() names it and says what is wrong."""


def _refuse_link(path: Path, exc: OSError) -> None:
    if exc.errno == errno.ELOOP:
        raise BadStateFile(f"{path}: a symbolic link, not a file the agent wrote") from None


def read_state_file(path: Path, limit: int = 64) -> str | None:
    """A small state file's text, None when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _refuse_link(path, exc)
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadStateFile(f"{path}: not a regular file")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise BadStateFile(f"{path}: longer than {limit} bytes")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise BadStateFile(f"{path}: not ASCII text") from None


def write_state_file(path: Path, text: str) -> None:
    """Replaces a state file whole: written to a temporary file, flushed to disk and
    renamed over the old one, so a crash leaves the old contents or the new, never a torn
    file. OSError when it cannot."""
    tmp = path.with_name(path.name + ".tmp")
    # Whatever is at the temporary name goes (unlinking a link removes the link, not its
    # target), and the file is created new: O_EXCL never follows a link.
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o640)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # The rename is durable only once the directory entry is on disk too.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def flag_set(path: Path) -> bool:
    """Whether a flag file (its presence is the flag, its contents do not matter) is set."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # no state directory: no flag either
        return False
    if not stat.S_ISREG(mode):
        raise BadStateFile(f"{path}: not a regular file (a flag is an empty file the agent "
                           f"creates)")
    return True


def set_flag(path: Path, on: bool) -> None:
    """Creates or removes a flag file; OSError when it cannot (a link at its name too)."""
    if not on:
        path.unlink(missing_ok=True)  # a link is removed, never its target
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | _NOFOLLOW, 0o640))
    except OSError as exc:
        _refuse_link(path, exc)
        raise
