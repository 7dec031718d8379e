"""The servers' model listings (GET /v1/models): parsing within bounds, and fetching from
a real server on vLLM's HTTP stack, one that is down and one that never answers."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadmesh.daemon.model_list import (MAX_NAME, ListingError, ModelLister, _body, fetch_models,
                               parse_models)
from loadmesh.gossip.snapshot import MAX_MODELS
from metrics_helpers import free_port
from loadmesh.model_id import model_id
from nettopo import stop_process

LLM_SERVER = str(Path(__file__).with_name("llm_server.py"))


def listing(*names: object) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": n, "object": "model"} for n in names]}).encode()


def test_parses_an_openai_listing() -> None:
    assert parse_models(listing("meta-llama/Llama-3.1-8B", "lora-a")) == ["meta-llama/Llama-3.1-8B", "lora-a"]


@pytest.mark.parametrize("body", [b"", b"<html>", b"[]", b'{"data": {}}', b"[" * 100_000])
def test_what_is_not_a_listing_is_refused(body: bytes) -> None:
    with pytest.raises(ListingError):
        parse_models(body)


def test_entries_that_name_no_model_are_skipped_and_the_count_bounded() -> None:
    body = listing("a", "a", "", 7, None, "x" * (MAX_NAME + 1), *(f"m{i}" for i in range(200)))
    names = parse_models(body.replace(b'{"id": 7, "object": "model"}', b"42"))
    assert names[0] == "a" and len(names) == MAX_MODELS and len(set(names)) == len(names)


def test_answer_bodies_plain_and_chunked() -> None:
    assert _body(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}") == b"{}"
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"d\r\n4;x=y\r\n\": 1\r\n1\r\n}\r\n0\r\n\r\n"
    assert _body(chunked) == b'{"d": 1}'
    for bad in (b"HTTP/1.1 404 Not Found\r\n\r\n{}", b"HTTP/1.1 200 OK\r\n",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\nshort"):
        with pytest.raises(ListingError):
            _body(bad)


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, LLM_SERVER, "--host", "127.0.0.1", "--port", str(port),
                             "--model", "llama", "--model", "qwen"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # stop_process signals the group
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if "ready" in line:
                break
        yield port
    finally:
        stop_process(proc)


def test_fetches_from_a_server_on_vllms_stack(server: int) -> None:
    assert asyncio.run(fetch_models("127.0.0.1", server)) == ["llama", "qwen"]


def test_a_server_down_or_silent_is_an_error_not_a_hang(server: int) -> None:
    with pytest.raises(ListingError):
        asyncio.run(fetch_models("127.0.0.1", free_port()))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        with pytest.raises(ListingError, match="no answer within"):
            asyncio.run(fetch_models("127.0.0.1", silent.getsockname()[1]))


def test_a_server_on_loopback_alone_is_asked_there(server: int) -> None:
    # The advertised address refuses (the server listens on 127.0.0.1 only): loopback answers.
    lister = ModelLister("127.0.0.2", [server], 30.0)
    asyncio.run(lister.refresh())
    assert lister.listed() == {server: {model_id("llama"): "llama", model_id("qwen"): "qwen"}}


def test_a_port_keeps_its_last_listing_while_its_server_is_away(server: int) -> None:
    down = free_port()
    lister = ModelLister("127.0.0.1", [server, down], 30.0)
    asyncio.run(lister.refresh())
    assert lister.listed() == {server: {model_id("llama"): "llama", model_id("qwen"): "qwen"}}
    lister.ports = (down,)
    asyncio.run(lister.refresh())
    assert lister.listed() == {}  # a port no longer served is not listed
