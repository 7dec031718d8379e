"""Exact bytes (tests/crafted.py) through the real programs and maps by BPF_PROG_TEST_RUN:
the token counts of `usage` objects as the servers write them (one model per layout, so
each layout's counts stand alone in its row of the model figures), the rows themselves
(one per status, and what comes past their number), a 5-tuple that a new SYN
reuses while its old connection still has a state, and the segments that the entry sends
straight to lm_sse because they start like a chunk of events."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

import nettopo
from crafted import CLIENT, SERVER, Connection, frame, test_run
from loadmesh.probes import MapSizes, ProbeSet, abi
from loadmesh.model_id import NO_MODEL, model_id

PORT = 8080
CHAT = abi.endpoint_names().index("chat")
TTFB, TTFT, ITL, E2E = (abi.const(f"LM_HK_{k}") for k in ("TTFB", "TTFT", "ITL", "E2E"))
CONTENT = "Paris is the capital of France."

# name -> (answer body, completion tokens or None, prompt tokens)
LAYOUTS: dict[str, tuple[bytes, int | None, int]] = {
    # the OpenAI API: pretty-printed, usage before system_fingerprint
    "openai-pretty": (json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": CONTENT},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29,
                  "prompt_tokens_details": {"cached_tokens": 0}},
        "system_fingerprint": "fp_1"}, indent=2).encode(), 10, 19),
    # vLLM (pydantic, compact): total before completion, then three more keys
    "vllm-compact": (b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m",'
                     b'"choices":[{"index":0,"message":{"role":"assistant","content":"Paris."'
                     b'},"logprobs":null,"finish_reason":"stop","stop_reason":null}],'
                     b'"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":'
                     b'9,"total_tokens":25,"completion_tokens":16,"prompt_tokens_details":null'
                     b'},"prompt_logprobs":null,"prompt_token_ids":null,'
                     b'"kv_transfer_params":null}', 16, 9),
    # the Responses API's names, with their _details objects
    "responses-api": (json.dumps({
        "id": "resp_1", "object": "response", "status": "completed",
        "output": [{"type": "message", "content": [{"type": "output_text", "text": CONTENT}]}],
        "usage": {"input_tokens": 36, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": 87, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": 123}}).encode(), 87, 36),
    # an embedding: prompt tokens only
    "embedding": (json.dumps({
        "object": "list", "data": [{"object": "embedding", "index": 0,
                                    "embedding": [0.25] * 16}],
        "model": "e5", "usage": {"prompt_tokens": 8, "total_tokens": 8}}).encode(), None, 8),
    # a content string that quotes a usage object: its quotes are escaped, so only the
    # real one counts
    "quoted-usage": (json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion",
        "choices": [{"index": 0, "message": {
            "role": "assistant",
            "content": 'it reads "usage": {"completion_tokens": 999} back'}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, separators=(",", ":")).encode(),
        2, 1),
    # longer than the head's window (its last 512 bytes are copied for the usage), and a
    # count of seven digits, the most a count may have
    "long-answer": (json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": CONTENT * 40}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1234567}},
        separators=(",", ":")).encode(), 1234567, 5),
}


def request(model: str) -> bytes:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "?"}]})
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode()


def answer(body: bytes, status: bytes = b"200 OK") -> bytes:
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (status, len(body))) + body


@pytest.fixture(scope="module")
def probes() -> Iterator[ProbeSet]:
    with nettopo.veth_netns("lmu") as topo, nettopo.probes_on(topo.host_if, [PORT]) as p:
        yield p


def test_usage_objects_as_the_servers_write_them(probes: ProbeSet) -> None:
    fd = probes.program_fd("lm_tc_eth")
    for i, (name, (body, _, _)) in enumerate(LAYOUTS.items()):
        conn = Connection(41000 + i, PORT)
        for _ in range(3):  # the second answer on a connection has its copy widened
            test_run(fd, conn.request(request(name)))
            test_run(fd, conn.answer(answer(body)))
    snap = probes.read_maps(with_flows=False)
    assert snap.errors == {k: 0 for k in snap.errors}
    for name, (_, out, prompt) in LAYOUTS.items():
        stats = snap.requests[(model_id(name), PORT, CHAT)]
        assert stats.complete == 3, name
        assert stats.prompt_tokens == 3 * prompt, name
        if out is None:
            assert stats.usage_answers == 0 and stats.output_tokens == 0, name
        else:
            assert (stats.usage_answers, stats.output_tokens) == (3, 3 * out), name


def test_a_syn_on_a_5_tuple_with_a_state_ends_its_requests_as_aborted(
        probes: ProbeSet) -> None:
    """The old connection's end was missed (its FIN and RST lost, say): a new SYN on its
    5-tuple starts afresh, and the request it still had outstanding counts as aborted,
    under its model, not silently gone."""
    fd = probes.program_fd("lm_tc_eth")
    conn = Connection(42000, PORT)
    test_run(fd, conn.request(request("syn-reused")))
    test_run(fd, frame(CLIENT, SERVER, conn.client_port, PORT, 77, b"", 0x02))  # SYN
    fresh = Connection(42000, PORT)  # the new connection: a request, then its answer
    test_run(fd, fresh.request(request("syn-reused")))
    test_run(fd, fresh.answer(answer(LAYOUTS["vllm-compact"][0])))
    stats = probes.read_maps(with_flows=False).requests[(model_id("syn-reused"), PORT, CHAT)]
    assert (stats.aborted, stats.complete) == (1, 1)


def test_the_model_figures_are_a_row_per_status_and_go_to_the_model_less_rows_past_them(
        ) -> None:
    """A row per model, port, endpoint and status: each status's latencies apart, the
    outcomes summed over them. Once every row is taken, a new row's figures go to the
    model-less row ("-") of its port, endpoint and status, made from the spare rows; past
    those they are dropped. Both are counted as rows_full, and the rows made before stay
    exact."""
    spare = abi.const("LM_SPARE_ROWS")
    statuses = [200, 404, 200, 503, 429, 200, 404]  # 429: the first past the 3 rows
    flood = list(range(520, 520 + spare + 2))  # a new model: into "-", the spares, then none
    body = LAYOUTS["vllm-compact"][0]
    with nettopo.veth_netns("lmr") as topo, \
            nettopo.probes_on(topo.host_if, [PORT], MapSizes(rows=3)) as probes:
        fd = probes.program_fd("lm_tc_eth")
        conn = Connection(43000, PORT)
        for model, status in [("rows", s) for s in statuses] + [("flood", s) for s in flood]:
            test_run(fd, conn.request(request(model)))
            test_run(fd, conn.answer(answer(body, b"%d Status" % status)))
        snap = probes.read_maps(with_flows=False)

    def per_status(mid: int, kind: int) -> dict[int, int]:
        out: dict[int, int] = {}
        for key, n in snap.histograms.items():
            if key[:4] == (mid, PORT, CHAT, kind):
                out[key[4]] = out.get(key[4], 0) + n
        return out

    for kind in (TTFB, E2E):
        assert per_status(model_id("rows"), kind) == {200: 3, 404: 2, 503: 1}, kind
        assert per_status(model_id("flood"), kind) == {}, kind
        # 429 took one spare row, the flood the others; its last two statuses found none
        assert per_status(NO_MODEL, kind) == {s: 1 for s in [429, *flood[:spare - 1]]}, kind
    assert snap.requests[(model_id("rows"), PORT, CHAT)].complete == 6
    assert snap.requests[(NO_MODEL, PORT, CHAT)].complete == spare
    assert {k: v for k, v in snap.errors.items() if v} == {"rows_full": 1 + len(flood)}


def sse_chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def samples(probes: ProbeSet, model: str, kind: int) -> int:
    mid = model_id(model)
    return sum(n for key, n in probes.read_maps(with_flows=False).histograms.items()
               if key[0] == mid and key[3] == kind)


def test_segments_that_start_like_a_chunk_of_events_go_by_the_connection_state(
        probes: ProbeSet) -> None:
    """The entry sends a segment that starts with a chunk line and `data:` to lm_sse
    straight. In a chunked stream its events count as they would through lm_resp; in a
    chunked JSON answer whose body happens to start so, lm_resp frames it: no events, one
    complete answer."""
    fd = probes.program_fd("lm_tc_eth")
    stream = Connection(43000, PORT)
    test_run(fd, stream.request(request("direct-stream")))
    test_run(fd, stream.answer(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                               b"transfer-encoding: chunked\r\n\r\n"))
    for i in range(3):
        test_run(fd, stream.answer(sse_chunk(b'data: {"choices":[{"delta":{"content":"t%d"}'
                                             b'}]}\n\n' % i)))
    test_run(fd, stream.answer(sse_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"))
    json_answer = Connection(43001, PORT)
    test_run(fd, json_answer.request(request("direct-json")))
    test_run(fd, json_answer.answer(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                    b"Transfer-Encoding: chunked\r\n\r\n"))
    test_run(fd, json_answer.answer(sse_chunk(b"data: 1234567890")))
    test_run(fd, json_answer.answer(b"0\r\n\r\n"))
    snap = probes.read_maps(with_flows=False)
    assert snap.errors == {k: 0 for k in snap.errors}
    streamed = snap.requests[(model_id("direct-stream"), PORT, CHAT)]
    assert (streamed.complete, streamed.e2e_tokens) == (1, 3)
    assert (samples(probes, "direct-stream", TTFT), samples(probes, "direct-stream", ITL)) == (1, 2)
    plain = snap.requests[(model_id("direct-json"), PORT, CHAT)]
    assert (plain.complete, plain.e2e_tokens) == (1, 0)
    assert samples(probes, "direct-json", TTFT) + samples(probes, "direct-json", ITL) == 0
