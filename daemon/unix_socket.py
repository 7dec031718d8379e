"""Claiming the local API's Unix socket path, and giving it back.

The path outlives a crashed agent (a stale socket file), so the claim must tell a dead
agent's socket from a live one: it connects to the file. Refused means nobody listens and
the file is replaced; accepted means another agent owns the path and this one must not
start. A path that is not a socket at all is never deleted.
"""

from __future__ import annotations

import errno
import os
import socket
import stat

# Owner and group may connect; others may not (the unit's group grants access to routers).
SOCKET_MODE = 0o660


class SocketInUse(Exception):
    pass


def claim(path: str, backlog: int = 128) -> tuple[socket.socket, int]:
    """Bind a listening, non-blocking Unix socket at `path`; return it and the file's inode."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    _remove_if_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            sock.bind(path)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                # Another agent bound the path between our check and our bind.
                raise SocketInUse(f"another agent is serving on {path}") from None
            raise
        os.chmod(path, SOCKET_MODE)
        sock.listen(backlog)
        sock.setblocking(False)
        return sock, os.stat(path).st_ino
    except BaseException:
        sock.close()
        raise


def release(path: str, inode: int) -> None:
    """Remove the socket file, unless it is no longer ours (a successor already replaced it)."""
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_if_stale(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUse(f"{path} exists and is not a socket; not replacing it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    except OSError as exc:
        raise SocketInUse(f"cannot tell whether {path} is in use: {exc.strerror}") from None
    finally:
        probe.close()
    raise SocketInUse(f"another agent is serving on {path}")
