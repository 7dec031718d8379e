"""An OpenAI-compatible LLM server on vLLM's own HTTP stack (uvicorn with httptools and
uvloop, Starlette's StreamingResponse), with a fake engine that batches like vLLM's: so the
probes see on the wire what they would see from vLLM (a stream's head sent before any
token, one chunk per SSE event, usage objects, [DONE]) while a test knows, from the
engine, every request's queueing and each token's time.

The engine runs `--slots` sequences at once (vLLM's max-num-seqs); the rest wait in FIFO
order. Every `--step-ms` it emits one token for each running sequence (a newly admitted
one gets its first token at the next step, after `--prefill-ms`). Past `--max-waiting`
queued requests, new ones get 429, as a saturated server answers.

Endpoints: POST /v1/chat/completions, /v1/completions (stream or not,
stream_options.include_usage honoured), /v1/embeddings; GET /v1/models, /health, /metrics
(a few Prometheus lines: a scrape), /stats (the engine's waiting and running, how many of
the running have a token out, and when the next step comes, for tests to sample at a quiet
moment; also its batch size and step), POST /engine
{"step_ms": x, "max_waiting": n}, either key optional (the engine slows down or speeds up
from its next step, a GPU throttling; with max_waiting 0 it answers 429 to every request:
for scripts/bench_fleet.py and the fleet tests). `--name` goes into every answer's id
("chatcmpl-NAME-..."), so a client behind a router can tell which server answered.
`--model` (repeatable) names what /v1/models lists; any name is served. A request may add
"fail_after": k (a stream sends an error event after k tokens, as vLLM does for a failure
inside a stream). Run inside a namespace:

    python3 tests/llm_server.py --port 8000      # prints "ready" once listening
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class Sequence:
    max_tokens: int
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    emitted: int = 0
    cancelled: bool = False


class Engine:
    """Continuous batching: `slots` sequences decode together, one token each per step."""

    def __init__(self, slots: int, step_ms: float, prefill_ms: float, max_waiting: int):
        self.slots = slots
        self.step_s = step_ms / 1000
        self.prefill_s = prefill_ms / 1000
        self.max_waiting = max_waiting
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.next_step = time.monotonic()
        self.steps = 0

    def submit(self, max_tokens: int) -> Sequence | None:
        if len(self.waiting) >= self.max_waiting:
            return None
        seq = Sequence(max_tokens)
        self.waiting.append(seq)
        return seq

    async def run(self) -> None:
        while True:
            self.next_step = time.monotonic() + self.step_s
            await asyncio.sleep(self.step_s)
            self.steps += 1
            for seq in list(self.running):
                if seq.cancelled:
                    self.running.remove(seq)
                    continue
                seq.emitted += 1
                seq.tokens.put_nowait(seq.emitted)
                if seq.emitted >= seq.max_tokens:
                    seq.tokens.put_nowait(None)
                    self.running.remove(seq)
            admitted = []
            while self.waiting and len(self.running) + len(admitted) < self.slots:
                seq = self.waiting.popleft()
                if not seq.cancelled:
                    admitted.append(seq)
            if admitted and self.prefill_s:
                await asyncio.sleep(self.prefill_s)
            self.running.extend(admitted)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion}


def _prompt_tokens(body: dict[str, Any]) -> int:
    text = json.dumps(body.get("messages", body.get("prompt", "")))
    return max(1, len(text) // 4)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Server:
    def __init__(self, engine: Engine, name: str = "", models: tuple[str, ...] = ("fake",)) -> None:
        self.engine = engine
        self.id_prefix = f"{name}-" if name else ""
        self.listed = models
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", lambda _: Response(status_code=200), methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/engine", self.tune, methods=["POST"]),
        ], lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _: Starlette) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(self.engine.run())
        yield
        task.cancel()

    async def stats(self, _: Request) -> JSONResponse:
        e = self.engine
        return JSONResponse({"waiting": len(e.waiting), "running": len(e.running),
                             "started": sum(1 for s in e.running if s.emitted),
                             "steps": e.steps, "slots": e.slots, "step_ms": e.step_s * 1000,
                             "next_step_ms": max(0.0, (e.next_step - time.monotonic()) * 1000)})

    async def tune(self, request: Request) -> JSONResponse:
        body = await request.json()
        step_ms = body.get("step_ms", self.engine.step_s * 1000)
        max_waiting = body.get("max_waiting", self.engine.max_waiting)
        if not isinstance(step_ms, (int, float)) or not 0 < step_ms <= 10_000:
            return JSONResponse({"error": "step_ms: a number of milliseconds in (0, 10000]"},
                                status_code=400)
        if not isinstance(max_waiting, int) or max_waiting < 0:
            return JSONResponse({"error": "max_waiting: a count, at least 0"}, status_code=400)
        self.engine.step_s = step_ms / 1000
        self.engine.max_waiting = max_waiting
        return JSONResponse({"step_ms": step_ms, "max_waiting": max_waiting})

    async def metrics(self, _: Request) -> PlainTextResponse:
        e = self.engine
        return PlainTextResponse(f"fake:num_requests_running {len(e.running)}\n"
                                 f"fake:num_requests_waiting {len(e.waiting)}\n")

    async def models(self, _: Request) -> JSONResponse:
        return JSONResponse({"object": "list",
                             "data": [{"id": m, "object": "model"} for m in self.listed]})

    async def embeddings(self, request: Request) -> JSONResponse:
        body = await request.json()
        n = _prompt_tokens({"prompt": body.get("input", "")})
        return JSONResponse({"object": "list", "model": body.get("model"),
                             "data": [{"object": "embedding", "index": 0,
                                       "embedding": [0.0] * 8}],
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        body = await request.json()
        model = body.get("model")
        # max_completion_tokens: OpenAI's newer name, which vLLM also takes (and which
        # sglang-router writes when it forwards a max_tokens)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        seq = self.engine.submit(max_tokens)
        if seq is None:
            return JSONResponse({"error": {"message": "too many requests waiting",
                                           "type": "RateLimitError", "code": 429}},
                                status_code=429)
        prompt = _prompt_tokens(body)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.id_prefix}{uuid.uuid4().hex[:16]}"
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            n = await self._drain(seq, request)
            if n is None:
                return Response(status_code=499)
            text = " tok" * n
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            return JSONResponse({"id": rid, "object": obj, "created": int(time.time()),
                                 "model": model, "choices": [choice],
                                 "usage": _usage(prompt, n)})
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        fail_after = body.get("fail_after")
        return StreamingResponse(
            self._stream(seq, rid, f"{obj}.chunk" if chat else obj, model, chat, prompt,
                         usage, fail_after),
            media_type="text/event-stream")

    async def _drain(self, seq: Sequence, request: Request) -> int | None:
        """Waits for a non-streamed answer's tokens; None when the client left."""
        n = 0
        while True:
            try:
                token = await asyncio.wait_for(seq.tokens.get(), 0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    seq.cancelled = True
                    return None
                continue
            if token is None:
                return n
            n = token

    async def _stream(self, seq: Sequence, rid: str, obj: str, model: str, chat: bool,
                      prompt: int, usage: bool, fail_after: int | None) -> AsyncIterator[str]:
        def chunk(text: str, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            delta = {"role": "assistant", "content": text} if role else {"content": text}
            choice = ({"index": 0, "delta": delta, "finish_reason": finish} if chat else
                      {"index": 0, "text": text, "finish_reason": finish})
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
                    "choices": [choice]}

        n = 0
        try:
            while (token := await seq.tokens.get()) is not None:
                n = token
                if fail_after is not None and n > fail_after:
                    seq.cancelled = True
                    yield "data: " + json.dumps({"error": {
                        "message": "generation failed", "type": "InternalServerError",
                        "param": None, "code": 500}}) + "\n\n"
                    break
                if n == 1 and chat:
                    # vLLM's first event carries the role, sent with the first output
                    yield _sse(chunk("", role=True))
                yield _sse(chunk(" tok", "length" if n == seq.max_tokens else None))
            else:
                if usage:
                    yield _sse({"id": rid, "object": obj, "created": int(time.time()),
                                "model": model, "choices": [], "usage": _usage(prompt, n)})
            yield "data: [DONE]\n\n"
        finally:
            seq.cancelled = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=20)
    parser.add_argument("--prefill-ms", type=float, default=0)
    parser.add_argument("--max-waiting", type=int, default=1 << 20)
    parser.add_argument("--name", default="", help="put into every answer's id")
    parser.add_argument("--model", action="append", help="listed on /v1/models (any name "
                        "is served; default: fake)")
    args = parser.parse_args()
    engine = Engine(args.slots, args.step_ms, args.prefill_ms, args.max_waiting)
    app = Server(engine, args.name, tuple(args.model or ("fake",))).app
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level="warning", http="httptools", loop="uvloop",
                            timeout_keep_alive=60)
    serve(uvicorn.Server(config))


def serve(server: uvicorn.Server) -> None:
    """uvicorn.Server.run, with a "ready" line once it listens; SIGTERM ends it."""
    import uvloop

    async def run() -> None:
        config = server.config
        config.load()
        server.lifespan = config.lifespan_class(config)
        await server.startup()
        print("ready", flush=True)
        await server.main_loop()
        await server.shutdown()

    uvloop.run(run())


if __name__ == "__main__":
    main()
