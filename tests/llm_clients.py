"""Real LLM clients with a stopwatch: openai-python or httpx sending chat completions one
after another, streamed or not, timing each request as its client sees it. One process per
client, so that clients running side by side do not delay each other's stopwatches through
one interpreter's lock. Used by the tests and by scripts/bench_vllm.py.

Each request is stamped when its head starts to go out (httpcore's trace of the send, the
last step before the bytes leave), each SSE event when the client library hands it over,
and the end when the answer is whole. The first request warms the client up (imports,
first-use paths of the libraries) under a model name of its own, and is not reported;
with --warmup-as-model (a server that serves one model, as vLLM) it asks for the model
and is reported with the rest. With --barrier, a warm client says "warm" on stderr and
waits for a line on stdin before its first measured request: clients started side by side
then measure together, none of them while another still imports its libraries (a second of
CPU each, on a small machine a delay in every stopwatch running meanwhile).

    python3 tests/llm_clients.py --url http://10.0.0.2:8000 --model m --requests 20 --stream
    -> one JSON line: [{"sent": s, "events": [s, ...], "done": s, "status": 200,
                        "completion_tokens": n}, ...]   (perf_counter seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai


def nearest_rank(values: list[float], q: float) -> float:
    """The q-quantile of a stopwatch's values by nearest rank, as the probes give theirs."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def measure(url: str, model: str, requests: int, *, stream: bool, max_tokens: int = 16,
            client: str = "openai", include_usage: bool = False, prompt: str = "hello",
            ignore_eos: bool = False, seconds: float | None = None,
            warmup_as_model: bool = False,
            warm: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """ignore_eos: ask vLLM for every max_tokens token (its random-weight test models emit
    their eos token early at random). seconds: start no request past this many seconds
    after the warm-up, however many of `requests` are left (a benchmark's phase). warm: called
between the warm-up and the first measured request."""
    out: list[dict[str, Any]] = []

    def trace(name: str, _info: dict[str, Any]) -> None:
        if name == "http11.send_request_headers.started":
            out[-1]["sent"] = time.perf_counter()

    def on_request(request: httpx.Request) -> None:
        out.append({"sent": time.perf_counter(), "events": [], "done": 0.0, "status": 0,
                    "completion_tokens": None})
        request.extensions["trace"] = trace

    http = httpx.Client(event_hooks={"request": [on_request]}, timeout=600)
    messages = [{"role": "user", "content": prompt}]
    options = {"include_usage": True} if include_usage and stream else None
    extra = {"ignore_eos": True} if ignore_eos else {}
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-bench", max_retries=0,
                        http_client=http)
    until = math.inf
    for i in range(requests + 1):
        if i == 1 and warm is not None:
            warm()
        if i == 1 and seconds is not None:
            until = time.perf_counter() + seconds
        if time.perf_counter() > until:
            break
        name = f"{model}-warmup" if i == 0 and not warmup_as_model else model
        if client == "openai":
            _openai_request(api, out, name, messages, max_tokens, stream, options, extra)
        else:
            _httpx_request(http, url, out, name, messages, max_tokens, stream, options, extra)
        out[-1]["done"] = time.perf_counter()
    http.close()
    return out if warmup_as_model else out[1:]


def _openai_request(api: openai.OpenAI, out: list[dict[str, Any]], model: str,
                    messages: list[dict[str, str]], max_tokens: int, stream: bool,
                    options: dict[str, bool] | None, extra: dict[str, Any]) -> None:
    if not stream:
        r = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                        extra_body=extra)
        out[-1].update(status=200, completion_tokens=r.usage.completion_tokens)
        return
    chunks = api.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                         stream=True, stream_options=options, extra_body=extra)
    for chunk in chunks:
        out[-1]["events"].append(time.perf_counter())
        if chunk.usage:
            out[-1]["completion_tokens"] = chunk.usage.completion_tokens
    out[-1]["status"] = 200


def _httpx_request(http: httpx.Client, url: str, out: list[dict[str, Any]], model: str,
                   messages: list[dict[str, str]], max_tokens: int, stream: bool,
                   options: dict[str, bool] | None, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "stream": stream, **extra}
    if options:
        body["stream_options"] = options
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        out[-1]["status"] = r.status_code
        if not stream:
            r.read()
            out[-1]["completion_tokens"] = r.json().get("usage", {}).get("completion_tokens")
            return
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                continue
            out[-1]["events"].append(time.perf_counter())
            usage = json.loads(data).get("usage")
            if usage:
                out[-1]["completion_tokens"] = usage["completion_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--client", choices=("openai", "httpx"), default="openai")
    parser.add_argument("--include-usage", action="store_true")
    parser.add_argument("--prompt", default="hello")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--warmup-as-model", action="store_true")
    parser.add_argument("--barrier", action="store_true")
    a = parser.parse_args()
    print(json.dumps(measure(a.url, a.model, a.requests, stream=a.stream,
                             max_tokens=a.max_tokens, client=a.client,
                             include_usage=a.include_usage, prompt=a.prompt,
                             ignore_eos=a.ignore_eos, seconds=a.seconds,
                             warmup_as_model=a.warmup_as_model,
                             warm=barrier if a.barrier else None)), flush=True)


def barrier() -> None:
    print("warm", file=sys.stderr, flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
