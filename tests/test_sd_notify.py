"""systemd's notify protocol: the messages on the wire, and what a real agent sends when it
starts, pets the watchdog, reloads and stops."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import agent_config
from loadmesh.daemon.sd_notify import Notifier
from metrics_helpers import wait_for


@pytest.fixture
def listener(run_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    """What systemd listens on: a datagram socket in the abstract namespace, as
    $NOTIFY_SOCKET names it ("@name")."""
    name = f"lm-notify-test-{os.getpid()}-{run_dir.name}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    yield sock, "@" + name
    sock.close()


def received(sock: socket.socket) -> list[str]:
    """The messages waiting on a non-blocking socket."""
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_messages_reach_a_path_or_an_abstract_socket(listener, run_dir: Path) -> None:
    sock, abstract = listener
    Notifier({"NOTIFY_SOCKET": abstract}).ready("all good")
    assert received(sock) == ["READY=1\nSTATUS=all good"]

    path = run_dir / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as by_path:
        by_path.bind(str(path))
        by_path.setblocking(False)
        notifier = Notifier({"NOTIFY_SOCKET": str(path)})
        notifier.reloading()
        notifier.stopping()
        reloading, stopping = received(by_path)
    assert reloading.startswith("RELOADING=1\nMONOTONIC_USEC=")
    assert int(reloading.rpartition("=")[2]) > 0
    assert stopping == "STOPPING=1"


def test_outside_systemd_nothing_is_sent_and_no_watchdog() -> None:
    notifier = Notifier({"WATCHDOG_USEC": "2000000"})
    assert not notifier.enabled and notifier.watchdog_interval_s is None
    assert notifier.send("READY=1") is False


def test_watchdog_pings_at_half_the_timeout_for_this_process_only() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "30000000"}
    assert Notifier(env).watchdog_interval_s == 15.0
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid())}).watchdog_interval_s == 15.0
    assert Notifier({**env, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_interval_s is None
    assert Notifier({**env, "WATCHDOG_USEC": "0"}).watchdog_interval_s is None


def test_an_unreachable_socket_is_reported_once(run_dir: Path, caplog) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(run_dir / "nobody-listens")})
    with caplog.at_level(logging.WARNING):
        assert notifier.send("WATCHDOG=1") is False
        assert notifier.send("WATCHDOG=1") is False
    assert len([r for r in caplog.records if "cannot notify systemd" in r.message]) == 1


def test_the_agent_notifies_ready_watchdog_reloading_and_stopping(
        listener, make_agent, run_dir: Path, monkeypatch) -> None:
    sock, name = listener
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # a ping every 0.1 s
    socket_path = str(run_dir / "loadmesh.sock")
    agent = make_agent(agent_config(socket_path)).start()
    messages: list[str] = []

    def seen(text: str, count: int = 1) -> bool:
        messages.extend(received(sock))
        return sum(text in m for m in messages) >= count

    wait_for(lambda: seen("READY=1"), what="READY=1")
    ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
    # Progress first, one component at a time; READY=1 once all run, with a status line.
    assert messages[0] == "STATUS=starting api"
    assert "STATUS=starting metrics" in messages[:ready]
    assert "ok" in messages[ready] and "STATUS=" in messages[ready]
    assert "ready" in agent.logs()
    wait_for(lambda: seen("WATCHDOG=1", 3), what="three watchdog pings")

    agent.signal(signal.SIGHUP)
    wait_for(lambda: seen("READY=1", 2), what="READY=1 after the reload")
    reloading = next(i for i, m in enumerate(messages) if m.startswith("RELOADING=1"))
    assert reloading < max(i for i, m in enumerate(messages) if "READY=1" in m)

    agent.signal(signal.SIGTERM)
    assert agent.wait_exit() == 0
    assert seen("STOPPING=1")


def test_the_watchdog_is_petted_only_while_snapshots_are_built(run_dir: Path) -> None:
    # A loop that still answers while the node's snapshot has stopped moving (a stuck
    # call in the tick) is not alive: systemd must restart it after WatchdogSec.
    from loadmesh.daemon.agent import Agent
    from loadmesh.daemon.config import Config

    agent = Agent(Config(node_id="n0", state_dir=str(run_dir)))
    pings: list[str] = []
    agent.notifier = SimpleNamespace(watchdog=lambda: pings.append("WATCHDOG=1"))  # type: ignore[assignment]
    agent.snapshot = SimpleNamespace(stalled_s=0.0)  # type: ignore[assignment]

    async def run_for(seconds: float) -> int:
        before = len(pings)
        task = asyncio.create_task(agent._watchdog(0.01))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return len(pings) - before

    async def scenario() -> None:
        assert await run_for(0.1) > 3
        agent.snapshot.stalled_s = 12.0  # type: ignore[misc]
        assert await run_for(0.1) == 0

    asyncio.run(scenario())
