"""Scraping an agent's /metrics in tests: a free port for it, the scrape, its samples."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick, released at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_config(port: int) -> str:
    return f'listen = "127.0.0.1:{port}"'


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return resp.read().decode()


def samples(text: str) -> Samples:
    """(sample name, labels) -> value, for every sample of a scrape."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(found: Samples, sample: str, /, **labels: str) -> float | None:
    return found.get((sample, frozenset(labels.items())))


def declared(text: str) -> set[str]:
    """Every sample name a scrape declares (# TYPE), histogram series included, whether
    or not it has samples now."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return names


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting {timeout:g}s for {what or predicate}")
        time.sleep(0.1)
