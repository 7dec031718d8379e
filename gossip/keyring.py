"""The shared keys that authenticate gossip datagrams (HMAC-SHA256).

The first key is the primary: it signs everything this node sends. Every key verifies,
so a key can be rotated without a moment where two nodes reject each other: add the new
key everywhere, then make it primary everywhere, then remove the old one.

Key file format (gossip.key_file): one key per line, 16 to 64 bytes, written either as
hex (`openssl rand -hex 32`) or as base64 (`openssl rand -base64 32`); a line of hex
digits only is read as hex. Blank lines and lines starting with `#` are ignored. The
first key is the primary.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import os
import stat
import string
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 64
# HMAC-SHA256 truncated to 128 bits, as RFC 4868 does for IPsec: forging it still takes
# 2**128 tries, and the 16 bytes saved are paid on every datagram.
TAG_BYTES = 16
_HEX = frozenset(string.hexdigits)


class Keyring:
    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("a keyring needs at least one key")
        for i, key in enumerate(keys):
            if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
                raise ValueError(f"key {i + 1}: {len(key)} bytes, need {MIN_KEY_BYTES}..{MAX_KEY_BYTES}")
        # Duplicates would only cost a second HMAC on every bad datagram.
        self.keys: tuple[bytes, ...] = tuple(dict.fromkeys(bytes(k) for k in keys))

    @property
    def primary(self) -> bytes:
        return self.keys[0]

    def sign(self, data: bytes) -> bytes:
        return hmac.digest(self.primary, data, "sha256")[:TAG_BYTES]

    def verify(self, data: bytes, tag: bytes) -> bool:
        # Primary first: in a mesh that is not mid-rotation it is the only one that matches.
        for key in self.keys:
            if hmac.compare_digest(hmac.digest(key, data, "sha256")[:TAG_BYTES], tag):
                return True
        return False


def parse_key(text: str) -> bytes:
    """One key as written in a key file; ValueError with the reason."""
    if text and len(text) % 2 == 0 and set(text) <= _HEX:
        key = bytes.fromhex(text)
    else:
        try:
            key = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError("neither hex nor base64") from e
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"{len(key)} bytes, a key must have {MIN_KEY_BYTES}..{MAX_KEY_BYTES}")
    return key


def load_keyring(path: str | os.PathLike[str]) -> Keyring:
    """The keyring in the key file at `path`; ValueError naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not ASCII text (byte {e.start})") from e
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from e
    keys = []
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            keys.append(parse_key(line))
        except ValueError as e:
            raise ValueError(f"{path}:{number}: {e}") from None
    if not keys:
        raise ValueError(f"{path}: no key in the file")
    try:
        mode = path.stat().st_mode
    except OSError:
        mode = 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("key file %s is readable by others (mode %o); it should be 0600",
                    path, stat.S_IMODE(mode))
    return Keyring(keys)
