"""The rollout HTTP server: one process per replica, any :class:`RolloutBackend` behind it.

Run ``python -m polyrl.rollout.server MODEL_DIR --port 8000`` (or ``polyrl serve``). It binds
127.0.0.1 unless told otherwise; with ``POLYRL_API_KEY`` set, every endpoint but ``/health``
wants ``Authorization: Bearer <key>``.

Endpoints
---------
``POST /generate``
    Token-in/token-out. Body: ``{"input_ids": [ids] | [[ids], ...], "sampling_params": {...},
    "request_id": str?, "stream": bool?}``; sampling params are the fields of
    :class:`~polyrl.rollout.base.SamplingParams`. One prompt answers
    ``{"request_id", "outputs": [{"index", "output_ids", "logprobs", "top_logprobs",
    "finish_reason", "stop_reason", "weight_version", "first_weight_version",
    "cached_prompt_tokens"}], "weight_version", "usage"}``; a list of prompts answers
    ``{"results": [...], "weight_version"}``. With ``stream`` (one prompt), server-sent events
    ``data: {"request_id", "index", "token_ids", "logprobs", "finish_reason", ...}`` end with
    ``data: [DONE]``.
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
    OpenAI-compatible; see :mod:`polyrl.rollout.openai_compat`.
``GET /health``
    ``{"status": "ok", "model", "backend", "weight_version", "paused", "sleeping", "running",
    "waiting", "max_model_len", "vocab_size", "eos_token_ids"}``.
``GET /metrics``
    Prometheus text format (running/waiting requests, tokens/s, KV-cache use, weight version...).
``POST /pause``, ``POST /resume``
    Stop and restart stepping; in-flight requests stay.
``POST /abort``
    ``{"request_ids": [...]}`` or ``{}`` for all: in-flight requests end with
    ``finish_reason: "abort"`` and the tokens they had.
``POST /sleep`` ``{"level": 1|2}``, ``POST /wake_up`` ``{"tags": ["weights", "kv_cache"]}``
    Release and restore KV-cache (and weight) memory.
``POST /update_weights``
    ``{"path": DIR, "version": int?}``: load a safetensors directory and switch to it between two
    decode steps; answers ``{"weight_version": v}``.

Errors
------
Every error body is ``{"error": {"message", "type", "param", "code"}}``:

* 400 ``invalid_request_error``: malformed JSON, missing/unknown field, wrong type, invalid
  sampling parameter, unknown token id (``code: invalid_token_id``), prompt plus
  ``max_new_tokens`` longer than the context (``code: context_length_exceeded``), duplicate
  in-flight ``request_id``;
* 401 ``authentication_error``: missing or wrong bearer token;
* 404: unknown path; 405: wrong method;
* 503 ``service_unavailable``: the engine is asleep or its weights were discarded.

A rejected request never reaches the engine, so it holds no slot or KV block.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyrl.core.http import serve_app
from polyrl.core.rollout_api import (
    BackendStats,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    RolloutBackend,
    RolloutError,
    SampleDelta,
    SampleOutput,
    SamplingParams,
    collect_outputs,
)
from polyrl.rollout import openai_compat as oai
from polyrl.rollout.base import create_backend
from polyrl.rollout.options import (
    PARENT_FD_ENV,
    add_backend_arguments,
    add_listen_arguments,
    api_key_from_env,
    backend_options,
)

__all__ = ["BearerAuth", "create_app", "error_body", "main", "render_metrics", "serve"]

logger = logging.getLogger(__name__)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Build the JSON error object every endpoint answers with."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _error(exc: RolloutError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.param, exc.code), status_code=exc.status
    )


async def _json_body(request: Request, required: bool = True) -> Any:
    raw = await request.body()
    if not raw.strip():
        if required:
            raise InvalidRequestError("the request body is empty; expected a JSON object")
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc}", code="malformed_json") from exc


def _object(body: Any, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"the {what} body must be a JSON object, got {type(body).__name__}"
        )
    return body


def _sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


_SSE_DONE = b"data: [DONE]\n\n"


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once the ASGI server reports that the client went away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``, cancelling it if the client disconnects first (then return ``None``).

    The handler has read the whole body, so the next ASGI ``receive`` only returns when the
    client disconnects: one task waits on it. Polling ``request.is_disconnected()`` instead
    cost every in-flight request a wake-up (and a task group) twice a second, all of it on the
    event loop thread, which holds the GIL the engine thread needs between its torch calls.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


async def _merge(
    streams: list[AsyncIterator[SampleDelta]],
) -> AsyncIterator[tuple[int, SampleDelta]]:
    """Interleave several delta streams, tagging each delta with its stream's index."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, SampleDelta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[SampleDelta]) -> None:
        try:
            async with contextlib.aclosing(stream) as s:
                async for delta in s:
                    await queue.put((i, delta))
            await queue.put((i, None))
        except BaseException as exc:  # forwarded to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class BearerAuth:
    """ASGI middleware: every HTTP endpoint but ``/health`` wants ``Bearer <api_key>``.

    A plain ASGI middleware rather than ``@app.middleware("http")``: Starlette's
    ``BaseHTTPMiddleware`` wraps every request in a task group and routes ``receive`` through
    extra tasks, which costs event-loop time (and so GIL time taken from the engine thread).
    """

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on when it may go through; answer 401 otherwise."""
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body(
                "missing or invalid bearer token (send 'Authorization: Bearer <key>')",
                "authentication_error",
            ),
            status_code=401,
        )
        await response(scope, receive, send)


def render_metrics(stats: BackendStats, info: ModelInfo) -> str:
    """Prometheus text exposition of a backend's stats."""
    label = f'model="{info.model}",backend="{info.backend}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float, extra: str = "") -> None:
        full = f"polyrl_rollout_{name}"
        if not any(line.startswith(f"# HELP {full} ") for line in lines):
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
        labels = label + (f",{extra}" if extra else "")
        lines.append(f"{full}{{{labels}}} {value}")

    metric("requests_running", "gauge", "Sequences admitted to the running batch.", stats.running)
    metric("requests_waiting", "gauge", "Sequences queued for admission.", stats.waiting)
    metric("paused", "gauge", "1 while stepping is paused.", int(stats.paused))
    metric("sleeping", "gauge", "1 while KV cache or weights are released.", int(stats.sleeping))
    metric("weight_version", "gauge", "Version of the weights in use.", stats.weight_version)
    metric("prompt_tokens_total", "counter", "Prompt tokens received.", stats.prompt_tokens_total)
    metric("generated_tokens_total", "counter", "Tokens generated.", stats.generated_tokens_total)
    metric(
        "generation_tokens_per_second",
        "gauge",
        "Generated tokens per second over the last few seconds.",
        round(stats.generated_tokens_per_s, 3),
    )
    metric("kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.", stats.kv_cache_usage)
    metric("kv_cache_blocks_total", "gauge", "KV-cache blocks.", stats.kv_cache_blocks_total)
    metric("kv_cache_blocks_used", "gauge", "KV-cache blocks held.", stats.kv_cache_blocks_used)
    metric("kv_cache_bytes", "gauge", "Bytes of KV-cache memory held.", stats.kv_cache_bytes)
    metric("weight_bytes", "gauge", "Bytes of weights on the device.", stats.weight_bytes)
    metric(
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        stats.prefix_cache_hit_tokens_total,
    )
    metric("preemptions_total", "counter", "Sequences preempted.", stats.preemptions_total)
    metric("engine_steps_total", "counter", "Engine steps run.", stats.steps_total)
    for reason in ("stop", "length", "abort"):
        metric(
            "requests_finished_total",
            "counter",
            "Samples finished, by reason.",
            stats.finished_total.get(reason, 0),
            f'finish_reason="{reason}"',
        )
    metric(
        "time_to_first_token_seconds_sum",
        "counter",
        "Sum of times from arrival to first token.",
        round(stats.ttft_seconds_sum, 6),
    )
    metric(
        "time_to_first_token_seconds_count",
        "counter",
        "Requests that produced a first token.",
        stats.ttft_count,
    )
    return "\n".join(lines) + "\n"


def create_app(
    backend: RolloutBackend,
    tokenizer: Any,
    api_key: str | None = None,
    manage_backend: bool = True,
) -> FastAPI:
    """Build the FastAPI app serving ``backend``.

    Args:
        backend: the engine (started and stopped with the app when ``manage_backend``).
        tokenizer: the model's tokenizer (chat templates, text in and out).
        api_key: bearer token wanted on every endpoint but ``/health``; ``None`` = open.
        manage_backend: start the backend on app start-up and shut it down on exit.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_backend:
            await backend.start()
        try:
            yield
        finally:
            if manage_backend:
                await backend.shutdown()

    app = FastAPI(title="polyrl rollout server", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(RolloutError)
    async def _rollout_error(request: Request, exc: RolloutError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(f"{exc.detail}: {request.method} {request.url.path}", kind),
            status_code=exc.status_code,
        )

    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)

    def info() -> ModelInfo:
        return backend.info

    @app.get("/health")
    async def health() -> dict[str, Any]:
        s = backend.stats()
        i = info()
        return {
            "status": "ok",
            "model": i.model,
            "backend": i.backend,
            "weight_version": s.weight_version,
            "paused": s.paused,
            "sleeping": s.sleeping,
            "running": s.running,
            "waiting": s.waiting,
            "max_model_len": i.max_model_len,
            "vocab_size": i.vocab_size,
            "eos_token_ids": list(i.eos_token_ids),
            "pid": os.getpid(),
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            render_metrics(backend.stats(), info()), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        i = info()
        return {
            "object": "list",
            "data": [
                {
                    "id": i.model,
                    "object": "model",
                    "owned_by": "polyrl",
                    "max_model_len": i.max_model_len,
                }
            ],
        }

    # ------------------------------------------------------------------- /generate

    def parse_generate(
        body: dict[str, Any],
    ) -> tuple[list[GenerateRequest], bool, bool, str]:
        allowed = {"input_ids", "sampling_params", "request_id", "stream", "session_id"}
        for key in body:
            if key not in allowed:
                hint = ""
                if key in SamplingParams.field_names():
                    hint = "; sampling parameters go inside 'sampling_params'"
                raise InvalidRequestError(
                    f"unknown field {key!r} for /generate{hint} (accepted: {sorted(allowed)})",
                    param=key,
                )
        if "input_ids" not in body:
            raise InvalidRequestError("missing required field 'input_ids'", param="input_ids")
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise InvalidRequestError(
                "input_ids must be a non-empty list of token ids or of token-id lists",
                param="input_ids",
            )
        batched = all(isinstance(x, list) for x in ids)
        prompts = ids if batched else [ids]
        params = SamplingParams.from_dict(body.get("sampling_params"))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidRequestError("stream must be true or false", param="stream")
        if stream and batched and len(prompts) > 1:
            raise InvalidRequestError(
                "stream=true takes a single prompt; send one request per prompt", param="stream"
            )
        rid = body.get("request_id") or f"gen-{uuid.uuid4().hex}"
        if not isinstance(rid, str):
            raise InvalidRequestError("request_id must be a string", param="request_id")
        requests = []
        for i, prompt in enumerate(prompts):
            for pos, tok in enumerate(prompt):
                if not isinstance(tok, int) or isinstance(tok, bool):
                    raise InvalidRequestError(
                        f"input_ids: token at position {pos} is {tok!r}; expected an int id",
                        param="input_ids",
                    )
            req_id = rid if not batched else f"{rid}-{i}"
            requests.append(GenerateRequest(req_id, tuple(prompt), params))
        return requests, batched, stream, rid

    # Client-visible request id -> engine request ids (a batch runs one per prompt).
    inflight: dict[str, list[str]] = {}

    async def open_streams(
        key: str, reqs: list[GenerateRequest], stream: bool
    ) -> list[AsyncIterator[SampleDelta]]:
        if key in inflight:
            raise InvalidRequestError(f"request_id {key!r} is already in flight", "request_id")
        streams: list[AsyncIterator[SampleDelta]] = []
        try:
            for r in reqs:
                streams.append(await backend.generate(r, stream=stream))
        except BaseException:
            await close_streams(streams)
            raise
        inflight[key] = [r.request_id for r in reqs]
        return streams

    async def close_streams(
        streams: list[AsyncIterator[SampleDelta]], key: str | None = None
    ) -> None:
        if key is not None:
            inflight.pop(key, None)
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]

    async def run_requests(
        request: Request, key: str, reqs: list[GenerateRequest]
    ) -> list[Any] | None:
        """Run requests to completion (``None`` if the client went away first)."""
        streams = await open_streams(key, reqs, stream=False)
        try:
            work = asyncio.gather(
                *(collect_outputs(r, s) for r, s in zip(reqs, streams, strict=True))
            )
            return await _until_disconnect(request, work)
        finally:
            await close_streams(streams, key)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = _object(await _json_body(request), "/generate")
        reqs, batched, stream, key = parse_generate(body)
        if stream:
            streams = await open_streams(key, reqs, stream=True)

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for d in streams[0]:
                        yield _sse(
                            {
                                "request_id": key,
                                "index": d.index,
                                "token_ids": d.token_ids,
                                "logprobs": d.logprobs,
                                "top_logprobs": d.top_logprobs,
                                "finish_reason": d.finish_reason,
                                "stop_reason": d.stop_reason,
                                "weight_version": d.weight_version,
                            }
                        )
                    yield _SSE_DONE
                finally:
                    await close_streams(streams, key)

            return StreamingResponse(events(), media_type="text/event-stream")

        outs = await run_requests(request, key, reqs)
        if outs is None:
            return Response(status_code=499)
        results = [o.to_dict() for o in outs]
        if batched:
            return JSONResponse(
                {"results": results, "weight_version": max(r["weight_version"] for r in results)}
            )
        return JSONResponse(results[0])

    # ------------------------------------------------------------------ OpenAI API

    def job_requests(job: oai.OpenAIJob) -> list[GenerateRequest]:
        return [
            GenerateRequest(f"{job.request_id}-{i}", tuple(p), job.params)
            for i, p in enumerate(job.prompts)
        ]

    async def stream_job(job: oai.OpenAIJob) -> StreamingResponse:
        streams = await open_streams(job.request_id, job_requests(job), stream=True)
        n = job.params.n
        chat = job.kind == "chat.completion"

        async def events() -> AsyncIterator[bytes]:
            asms: dict[int, oai.TextAssembler] = {}
            samples: dict[int, SampleOutput] = {}
            try:
                async with contextlib.aclosing(_merge(streams)) as merged:
                    async for p, d in merged:
                        idx = p * n + d.index
                        asm = asms.get(idx)
                        if asm is None:
                            asm = asms[idx] = oai.TextAssembler(
                                tokenizer, job.params.stop, job.skip_special_tokens
                            )
                            samples[idx] = SampleOutput(index=idx)
                            if chat:
                                yield _sse(
                                    oai.chat_chunk(
                                        job, idx, {"role": "assistant", "content": ""}, [], None, 0
                                    )
                                )
                        offset = len(asm.sent)
                        finished = d.finish_reason is not None
                        text = asm.push(d.token_ids, finished, d.stop_reason)
                        samples[idx].add(d)
                        if not text and not finished and not d.token_ids:
                            continue
                        if chat:
                            lp = oai.chat_logprobs_delta(
                                asm, d.token_ids, d.logprobs, d.top_logprobs
                            )
                            delta = {"content": text} if text or not finished else {}
                            yield _sse(
                                oai.chat_chunk(
                                    job,
                                    idx,
                                    delta,
                                    d.token_ids,
                                    d.finish_reason,
                                    d.weight_version,
                                    lp,
                                )
                            )
                        else:
                            lp = oai.completion_logprobs_delta(
                                asm,
                                d.token_ids,
                                d.logprobs,
                                d.top_logprobs,
                                job.top_logprobs,
                                offset,
                            )
                            yield _sse(
                                oai.completion_chunk(
                                    job,
                                    idx,
                                    text,
                                    d.token_ids,
                                    d.finish_reason,
                                    d.weight_version,
                                    lp,
                                )
                            )
                if job.include_usage:
                    yield _sse(oai.usage_chunk(job, list(samples.values())))
                yield _SSE_DONE
            finally:
                await close_streams(streams, job.request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        job = oai.parse_completion_request(await _json_body(request), tokenizer, info())
        if job.stream:
            return await stream_job(job)
        outs = await run_requests(request, job.request_id, job_requests(job))
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(oai.completion_response(job, tokenizer, [o.outputs for o in outs]))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        job = oai.parse_chat_request(await _json_body(request), tokenizer, info())
        if job.stream:
            return await stream_job(job)
        outs = await run_requests(request, job.request_id, job_requests(job))
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(oai.chat_response(job, tokenizer, outs[0].outputs))

    # -------------------------------------------------------------------- control

    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        await backend.pause()
        return {"paused": True}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        await backend.resume()
        return {"paused": False}

    @app.post("/abort")
    async def abort(request: Request) -> dict[str, Any]:
        body = _object(await _json_body(request, required=False), "/abort")
        ids = body.get("request_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise InvalidRequestError("request_ids must be a list of strings", param="request_ids")
        if ids is not None:
            # A batched /generate or OpenAI request runs as several engine requests.
            ids = [e for i in ids for e in inflight.get(i, [i])]
        return {"aborted": await backend.abort(ids)}

    @app.post("/sleep")
    async def sleep(request: Request) -> dict[str, Any]:
        body = _object(await _json_body(request, required=False), "/sleep")
        level = body.get("level", 1)
        if level not in (1, 2) or isinstance(level, bool):
            raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level")
        return await backend.sleep(level)

    @app.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        body = _object(await _json_body(request, required=False), "/wake_up")
        tags = body.get("tags")
        if tags is not None and not (
            isinstance(tags, list) and all(isinstance(t, str) for t in tags)
        ):
            raise InvalidRequestError("tags must be a list of strings", param="tags")
        return await backend.wake_up(tags)

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        body = _object(await _json_body(request), "/update_weights")
        unknown = set(body) - {"path", "version"}
        if unknown:
            raise InvalidRequestError(
                f"unknown field(s) {sorted(unknown)} for /update_weights; expected path, version",
                param=sorted(unknown)[0],
            )
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("path must name a weights directory", param="path")
        version = body.get("version")
        if version is not None and (
            not isinstance(version, int) or isinstance(version, bool) or version < 0
        ):
            raise InvalidRequestError(f"version must be an int >= 0, got {version!r}", "version")
        return {"weight_version": await backend.update_weights(path, version)}

    # Deferred import: polyrl.weights builds on this module's backends, not the reverse.
    from polyrl.weights.server_routes import register_weight_routes

    register_weight_routes(app, backend)
    return app


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: str = "native",
    api_key: str | None = None,
    ready_file: str | None = None,
    log_level: str = "warning",
    on_ready: Callable[[str], None] | None = None,
    **options: Any,
) -> None:
    """Serve ``model_dir`` until interrupted (SIGINT/SIGTERM shut down gracefully).

    Args:
        model_dir: local HF model directory.
        host: address to bind.
        port: port to bind (0 picks a free one; see ``ready_file``).
        backend: registered backend name.
        api_key: bearer token required on every endpoint but ``/health``.
        ready_file: where to write ``{"url", "pid"}`` once requests are accepted.
        log_level: uvicorn log level.
        on_ready: called with the URL once requests are accepted.
        **options: backend options (for ``native``: :class:`EngineConfig` fields).
    """
    from polyrl.models.loader import load_tokenizer

    engine = create_backend(backend, model_dir, **options)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=bool(options.get("trust_remote_code")))
    app = create_app(engine, tokenizer, api_key=api_key)
    asyncio.run(serve_app(app, host, port, ready_file, log_level, on_ready))


def build_parser() -> argparse.ArgumentParser:
    """Build the parser of ``python -m polyrl.rollout.server``."""
    parser = argparse.ArgumentParser(
        prog="python -m polyrl.rollout.server",
        description="Serve one rollout replica over HTTP (see polyrl.rollout.server).",
    )
    add_listen_arguments(parser)
    add_backend_arguments(parser)
    return parser


def watch_parent(fd: int) -> threading.Thread:
    """Shut this process down gracefully (SIGTERM to itself) once ``fd`` reads end-of-file.

    ``fd`` is the read end of a pipe whose write end only the parent holds: when the parent
    dies, however it dies, the kernel closes that end. (``PR_SET_PDEATHSIG`` would fire when
    the *thread* that spawned the child exits, which kills replicas started from worker threads.)
    """

    def wait() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        logger.warning("parent process is gone: shutting down")
        os.kill(os.getpid(), signal.SIGTERM)
        # A signal that lands before the server installs its handlers is ignored (see
        # serve_app): do not outlive the parent by more than a grace period regardless.
        threading.Event().wait(30.0)
        os._exit(0)

    thread = threading.Thread(target=wait, name="polyrl-parent-watch", daemon=True)
    thread.start()
    return thread


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m polyrl.rollout.server``; returns the exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    parent_fd = os.environ.pop(PARENT_FD_ENV, None)
    if parent_fd:
        watch_parent(int(parent_fd))
    try:
        serve(
            args.model_dir,
            host=args.host,
            port=args.port,
            backend=args.backend,
            api_key=api_key_from_env(),
            ready_file=args.ready_file,
            log_level=args.log_level,
            **backend_options(args),
        )
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, OSError) as exc:
        print(f"polyrl serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
