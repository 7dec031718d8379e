"""Hostile input against real agents over real sockets (issue 15). So far: what the CLI
prints to a terminal, from strings an attacker chooses on the serving port (a request's
"model") and on the gossip port (a node id)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

import nettopo
from conftest import LOADMESH, agent_config
from gossip_peer import RawPeer
from loadmesh.gossip import wire
from loadmesh.gossip.snapshot import Endpoint, HostLoad, LoadSnapshot, NodeState, encode
from loadmesh.gossip.wire import Kind
from metrics_helpers import free_port, metrics_config, samples, scrape, value, wait_for

SERVER = [sys.executable, str(Path(__file__).with_name("probe_servers.py"))]
PORT = 8000
# Clears the screen, sets the terminal's title, turns text red, and reverses what follows.
EVIL = "evil\x1b[2J\x1b]0;owned\x07\x1b[31m\u202ered"
SHOWN = "evil\\x1b[2J\\x1b]0;owned\\x07\\x1b[31m\\u202ered"


def loadmesh(*args: str) -> str:
    return subprocess.run([LOADMESH, *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout


def until(check: Callable[[], bool], what: str, seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.3)
    pytest.fail(f"not within {seconds:g} s: {what}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for BPF and netns")
def test_dump_escapes_model_names_taken_from_the_serving_port(make_agent, run_dir: Path) -> None:
    with nettopo.veth_netns() as topo, topo.ns.popen(SERVER + ["--port", str(PORT)], ready="ready"):
        sock = str(run_dir / "loadmesh.sock")
        agent = make_agent(agent_config(sock, extra=f'advertise = "{topo.host_v4}"',
                                        probes=f'interfaces = ["{topo.host_if}"]\n'
                                               f'ports = [{PORT}]\nrequired = true'))
        agent.start()
        agent.wait_ready(sock)
        # Raw control bytes inside the JSON string: not valid JSON, but on the wire.
        body = f'{{"model": "{EVIL}", "messages": []}}'.encode()
        with socket.create_connection((topo.ns_v4, PORT), timeout=10) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\nConnection: close\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            while conn.recv(65536):
                pass
        until(lambda: any(m["model"] == EVIL for m in json.loads(
            loadmesh("dump", "--socket", sock, "--json"))["models"]), "the model in the maps")
        shown = loadmesh("dump", "--socket", sock)
        assert SHOWN in shown
        assert not any(c in shown for c in "\x1b\x07\u202e")


def test_peers_escapes_node_ids_taken_from_gossip(make_agent, run_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = str(run_dir / "loadmesh.sock")
    agent = make_agent(agent_config(sock, gossip=f'bind = "127.0.0.1:{port}"')).start()
    agent.wait_ready(sock)
    forged = LoadSnapshot(node_id=EVIL, endpoints=(Endpoint("127.0.0.1", 8000),), version=1,
                          timestamp_ms=int(time.time() * 1000), state=NodeState.OK, score=0.5,
                          host=HostLoad(0.5, 1000, 2000, 1.5, None), gpus=(), models=())
    with RawPeer(EVIL) as attacker:
        to = ("127.0.0.1", port)
        attacker.prove(to)
        content = wire.pack_content([wire.pack_full(0, 0, attacker.addr, encode(forged))], 1400)[0]
        attacker.send(attacker.seal(Kind.CONTENT, content, to), to)
        until(lambda: any(p["node_id"] == EVIL for p in json.loads(
            loadmesh("peers", "--socket", sock, "--json"))), "the forged peer in the table")
    shown = loadmesh("peers", "--socket", sock)
    assert SHOWN in shown
    assert not any(c in shown for c in "\x1b\x07\u202e")


def state_dir(run_dir: Path) -> Path:
    path = run_dir / "state-test-node"  # agent_config's, beside the socket
    path.mkdir(mode=0o750)
    return path


@pytest.mark.parametrize("name, content", [("version", f"{2**63 - 1}\n"),
                                           ("version", f"{2**64}\n"), ("version", "x\n")])
def test_a_state_file_no_agent_wrote_stops_the_agent_naming_it(
        make_agent, run_dir: Path, name: str, content: str) -> None:
    (state_dir(run_dir) / name).write_text(content)
    agent = make_agent(agent_config(str(run_dir / "loadmesh.sock"))).start()
    assert agent.wait_exit() == 78
    assert f"{run_dir / 'state-test-node' / name}: holds" in agent.logs()
    assert "Traceback" not in agent.logs()


def test_links_in_the_state_directory_are_never_followed(make_agent, run_dir: Path) -> None:
    victim = run_dir / "victim"
    victim.write_text("precious\n")
    state = state_dir(run_dir)
    # A link at the version file's temporary name: removed, the target untouched.
    (state / "version.tmp").symlink_to(victim)
    sock = str(run_dir / "loadmesh.sock")
    agent = make_agent(agent_config(sock)).start()
    agent.wait_ready(sock)
    assert (state / "version").read_text().strip().isdigit()
    # A dangling link planted where `loadmesh drain` keeps its flag: not created through.
    planted = run_dir / "planted"
    (state / "draining").symlink_to(planted)
    # In force, and said to be lost at a restart: in the answer and in the health.
    assert "not kept on disk" in loadmesh("drain", "--socket", sock)
    assert json.loads(loadmesh("drain", "--socket", sock, "--json")) == {"draining": True,
                                                                         "kept": False}
    assert not planted.exists() and victim.read_text() == "precious\n"
    snapshot = json.loads(loadmesh("status", "--socket", sock, "--json"))["components"]["snapshot"]
    assert snapshot["state"] == "degraded" and "symbolic link" in snapshot["reason"]
    # Kept again (the undrain removes the link itself): the health says so.
    assert json.loads(loadmesh("undrain", "--socket", sock, "--json"))["kept"] is True
    snapshot = json.loads(loadmesh("status", "--socket", sock, "--json"))["components"]["snapshot"]
    assert snapshot["state"] == "ok"
    (state / "draining").symlink_to(planted)
    agent.kill()
    # At the next start the link is a bad state file: exit 78, naming it.
    again = make_agent(agent_config(sock)).start()
    assert again.wait_exit() == 78
    assert f"{state / 'draining'}: not a regular file" in again.logs()
    assert not planted.exists()


def raw(path: str, data: bytes) -> bytes:
    """What the agent answers on its API socket to `data`, read until it closes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(data)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize("request_bytes, status", [
    # "²" passes str.isdigit(), then int() raised: a dead connection, an unretrieved task.
    (b"GET /v1/status HTTP/1.1\r\nContent-Length: \xb2\r\n\r\n", b"400"),
    # Two lengths: the last one was taken, where a proxy in front may take the first.
    (b"GET /v1/status HTTP/1.1\r\nConnection: close\r\nContent-Length: 0\r\n"
     b"Content-Length: 5\r\n\r\nhello", b"400"),
    # JSON 20,000 deep: a RecursionError, a 500 and a traceback in the log per request.
    (b"POST /v1/feedback HTTP/1.1\r\nConnection: close\r\nContent-Length: 40000\r\n\r\n"
     + b"[" * 20000 + b"]" * 20000, b"400"),
])
def test_malformed_requests_get_a_4xx_and_leave_no_traceback(
        make_agent, run_dir: Path, request_bytes: bytes, status: bytes) -> None:
    sock = str(run_dir / "loadmesh.sock")
    agent = make_agent(agent_config(sock)).start()
    agent.wait_ready(sock)
    answer = raw(sock, request_bytes)
    assert answer.startswith(b"HTTP/1.1 " + status), answer[:80]
    # The agent still serves, and said nothing alarming about it.
    assert json.loads(loadmesh("status", "--socket", sock, "--json"))["node_id"] == "test-node"
    assert "Traceback" not in agent.logs() and "exception" not in agent.logs().lower()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the probes' start is the wait")
def test_healthz_says_starting_until_every_component_has_started(make_agent, run_dir: Path) -> None:
    # The API answers first; while the probes attach (seconds, compiling the C) the agent
    # is not yet what /healthz would call ok. Caught in between by asking from the start.
    sock = str(run_dir / "loadmesh.sock")
    agent = make_agent(agent_config(sock, probes='interfaces = ["lo"]\nports = [8000]')).start()
    seen: list[bytes] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "ready" not in agent.logs():
        try:
            seen.append(raw(sock, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"))
        except OSError:
            time.sleep(0.02)
    assert "ready" in agent.logs()
    early = [a for a in seen if a.startswith(b"HTTP/1.1 503")]
    assert early and all(b'"status":"starting"' in a for a in early)
    assert all(a.startswith((b"HTTP/1.1 503", b"HTTP/1.1 200")) for a in seen)
    assert raw(sock, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n").startswith(
        b"HTTP/1.1 200")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for BPF and netns")
def test_distinct_model_names_fold_into_one_series_past_the_cap(make_agent, run_dir: Path) -> None:
    port = free_port()
    with nettopo.veth_netns() as topo, topo.ns.popen(SERVER + ["--port", str(PORT)], ready="ready"):
        sock = str(run_dir / "loadmesh.sock")
        agent = make_agent(agent_config(
            sock, probes=f'interfaces = ["{topo.host_if}"]\nports = [{PORT}]\nrequired = true',
            metrics=f'{metrics_config(port)}\nmodel_labels = 4'))
        agent.start().wait_ready(sock)
        names = [f"m-{i:02d}" for i in range(30)]
        url = f"http://{topo.ns_v4}:{PORT}/v1/chat/completions"
        for name in names:
            body = json.dumps({"model": name, "messages": []}).encode()
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as resp:
                resp.read()

        def counted() -> bool:
            s = samples(scrape(port))
            return sum(v for (name, _), v in s.items() if name == "loadmesh_requests_total") == 30

        wait_for(counted, what="the 30 requests in the exporter")
        s = samples(scrape(port))
        models = {dict(labels)["model"] for (name, labels) in s
                  if name == "loadmesh_requests_total"}
        assert len(models) == 5 and "(other)" in models, models
        assert value(s, "loadmesh_metrics_models_folded") == 26
        other = {"model": "(other)", "endpoint": "chat"}
        assert value(s, "loadmesh_requests_total", code="200", **other) == 26
        assert value(s, "loadmesh_time_to_first_byte_seconds_count", **other) == 26


def test_idle_connections_cannot_keep_real_clients_out(make_agent, run_dir: Path) -> None:
    # Every slot of both listeners held by connections that never send a byte: the next
    # client still gets its answer, and the longest-waiting idle one is closed for it.
    from loadmesh.daemon.api_server import MAX_CONNECTIONS as API_SLOTS
    from loadmesh.daemon.metrics_server import MAX_CONNECTIONS as METRICS_SLOTS

    port = free_port()
    sock = str(run_dir / "loadmesh.sock")
    agent = make_agent(agent_config(sock, metrics=metrics_config(port))).start()
    agent.wait_ready(sock)
    idle: list[socket.socket] = []
    try:
        for _ in range(API_SLOTS):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(sock)
            idle.append(conn)
        for _ in range(METRICS_SLOTS):
            idle.append(socket.create_connection(("127.0.0.1", port)))
        for _ in range(3):
            assert json.loads(loadmesh("status", "--socket", sock, "--json"))["node_id"] == "test-node"
            assert "loadmesh_node_info" in scrape(port)
        # The first idle ones were closed for them: they read the end of the stream.
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        for conn in idle:
            conn.close()
