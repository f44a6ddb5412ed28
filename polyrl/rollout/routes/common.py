"""What the rollout server's routers share: error bodies, JSON bodies, SSE, auth, in-flight ids.

:class:`RequestTable` is the one piece of state shared between routers: ``/generate`` and the
OpenAI endpoints record which engine requests a client-visible request id runs as, and
``/abort`` reads it back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyrl.core.http_guard import DEFAULT_MAX_JSON_DEPTH, parse_json
from polyrl.core.rollout_api import (
    GenerateRequest,
    InvalidRequestError,
    OverloadedError,
    RequestConflictError,
    RolloutBackend,
    RolloutError,
    SampleDelta,
    collect_outputs,
)
from polyrl.rollout.options import ServerLimits

__all__ = [
    "SSE_DONE",
    "BearerAuth",
    "RenderPool",
    "RequestTable",
    "add_error_handlers",
    "error_body",
    "error_response",
    "json_body",
    "json_object",
    "merge_streams",
    "sse",
    "until_disconnect",
]


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Build the JSON error object every endpoint answers with."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(exc: RolloutError) -> JSONResponse:
    """Answer ``exc`` with its status and :func:`error_body` (429 says when to retry)."""
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.param, exc.code),
        status_code=exc.status,
        headers=headers,
    )


def add_error_handlers(app: FastAPI) -> None:
    """Make ``app`` answer a :class:`RolloutError` or an HTTP error (404, 405...) with a body."""

    @app.exception_handler(RolloutError)
    async def _rollout_error(request: Request, exc: RolloutError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        # Starlette puts ``Allow`` on its 405s: keep it (and any other header it set).
        return JSONResponse(
            error_body(f"{exc.detail}: {request.method} {request.url.path}", kind),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )


#: Bodies at least this large are parsed in a worker thread, off the event loop.
THREADED_PARSE_BYTES = 256 << 10


async def json_body(request: Request, required: bool = True) -> Any:
    """Parse the request's JSON body (an empty body is ``{}`` unless ``required``).

    Nesting is capped (``app.state.limits.max_json_depth``, else 64) before parsing; a
    large body is parsed in a worker thread.

    Raises:
        InvalidRequestError: empty (when required), malformed or too deeply nested body.
    """
    raw = await request.body()
    if not raw.strip():
        if required:
            raise InvalidRequestError("the request body is empty; expected a JSON object")
        return {}
    limits = getattr(request.app.state, "limits", None)
    depth = limits.max_json_depth if limits is not None else DEFAULT_MAX_JSON_DEPTH
    if len(raw) >= THREADED_PARSE_BYTES:
        return await asyncio.to_thread(parse_json, raw, depth)
    return parse_json(raw, depth)


def json_object(body: Any, what: str) -> dict[str, Any]:
    """Return ``body`` if it is a JSON object; ``what`` names the endpoint in the error.

    Raises:
        InvalidRequestError: ``body`` is not an object.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError(
            f"the {what} body must be a JSON object, got {type(body).__name__}"
        )
    return body


def sse(data: Any) -> bytes:
    """Encode one server-sent event carrying ``data`` as compact JSON."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
"""The event that ends every stream."""


async def _wait_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Return once the ASGI server reports that the client went away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
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


async def merge_streams(
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


class RequestTable:
    """Runs requests on ``backend`` and remembers which are in flight under which client id.

    A batched ``/generate`` or an OpenAI request with several prompts runs as several engine
    requests under one client-visible id; ``/abort`` maps that id back to them.
    """

    def __init__(self, backend: RolloutBackend, limits: ServerLimits | None = None):
        self.backend = backend
        self.limits = limits or ServerLimits()
        # Client-visible request id -> engine request ids (a batch runs one per prompt).
        self.inflight: dict[str, list[str]] = {}
        # Client-visible request id -> the prompt tokens (x n) it holds; and their sum.
        self.tokens: dict[str, int] = {}
        self.queued_tokens = 0

    def _admit(self, key: str, reqs: list[GenerateRequest]) -> None:
        """Check ``reqs`` against the limits and count their tokens as queued."""
        if key in self.inflight:
            raise RequestConflictError(
                f"request_id {key!r} is already in flight; pick another or leave it out",
                param="request_id",
                code="duplicate_request_id",
            )
        lim = self.limits
        sequences = sum(r.params.n for r in reqs)
        if sequences > lim.max_sequences:
            raise InvalidRequestError(
                f"this request asks for {sequences} sequences (prompts x n); this server takes "
                f"at most {lim.max_sequences} per request",
                param="n",
                code="too_many_sequences",
            )
        tokens = sum(len(r.prompt_ids) * r.params.n for r in reqs)
        if tokens > lim.max_queued_tokens:
            raise InvalidRequestError(
                f"this request holds {tokens} prompt tokens (x n); this server queues at most "
                f"{lim.max_queued_tokens}",
                code="too_many_tokens",
            )
        if self.queued_tokens + tokens > lim.max_queued_tokens:
            raise OverloadedError(
                f"the server is full ({self.queued_tokens} prompt tokens queued, limit "
                f"{lim.max_queued_tokens}); retry later",
                code="queue_full",
            )
        self.tokens[key] = tokens
        self.queued_tokens += tokens

    def _release(self, key: str) -> None:
        self.queued_tokens -= self.tokens.pop(key, 0)

    async def open_streams(
        self, key: str, reqs: list[GenerateRequest], stream: bool
    ) -> list[AsyncIterator[SampleDelta]]:
        """Submit ``reqs`` under client id ``key``; return one delta stream per request.

        Raises:
            RequestConflictError: ``key`` is already in flight (409).
            InvalidRequestError: more sequences or tokens than one request may hold.
            OverloadedError: the queued-token budget is spent (429).
        """
        self._admit(key, reqs)
        streams: list[AsyncIterator[SampleDelta]] = []
        try:
            for r in reqs:
                streams.append(await self.backend.generate(r, stream=stream))
        except BaseException:
            self._release(key)
            await self.close_streams(streams)
            raise
        self.inflight[key] = [r.request_id for r in reqs]
        return streams

    async def close_streams(
        self, streams: list[AsyncIterator[SampleDelta]], key: str | None = None
    ) -> None:
        """Close ``streams`` (ending their requests) and forget ``key``."""
        if key is not None:
            self.inflight.pop(key, None)
            self._release(key)
        for s in streams:
            await s.aclose()  # type: ignore[attr-defined]

    async def run_requests(
        self, request: Request, key: str, reqs: list[GenerateRequest]
    ) -> list[Any] | None:
        """Run requests to completion (``None`` if the client went away first)."""
        streams = await self.open_streams(key, reqs, stream=False)
        try:
            work = asyncio.gather(
                *(collect_outputs(r, s) for r, s in zip(reqs, streams, strict=True))
            )
            return await until_disconnect(request, work)
        finally:
            await self.close_streams(streams, key)

    def engine_ids(self, ids: list[str]) -> list[str]:
        """Map client-visible request ids to the engine request ids they run as."""
        return [e for i in ids for e in self.inflight.get(i, [i])]


_T = TypeVar("_T")


class RenderPool:
    """Threads that render chat templates and tokenize text, off the event loop.

    A prompt of megabytes (or a slow template) then delays its own request only: the event
    loop keeps answering ``/health`` and streaming tokens. A request waits at most
    ``timeout`` seconds (queueing included) before it is answered 400 ``render_timeout``;
    at most ``max_pending`` jobs may be queued or running, more get 429.
    """

    def __init__(self, threads: int = 2, timeout: float = 10.0, max_pending: int = 256):
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, "polyrl-render")
        self.timeout = timeout
        self.max_pending = max_pending
        self.pending = 0

    async def run(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run ``fn(*args)`` in the pool and return its result.

        Raises:
            OverloadedError: ``max_pending`` jobs are queued or running already.
            InvalidRequestError: ``fn`` did not finish within the timeout.
        """
        if self.pending >= self.max_pending:
            raise OverloadedError(
                "too many prompts are being rendered now; retry later", code="render_queue_full"
            )
        loop = asyncio.get_running_loop()
        self.pending += 1
        job = self.pool.submit(fn, *args)
        # Counted until the thread is done with it, not until this request stops waiting.
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._done))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), self.timeout)
        except TimeoutError:
            raise InvalidRequestError(
                f"rendering and tokenizing this prompt took longer than {self.timeout:g} s; "
                "send a shorter one",
                code="render_timeout",
            ) from None

    def _done(self) -> None:
        self.pending -= 1

    def close(self) -> None:
        """Stop the threads (jobs still running finish first, queued ones are dropped)."""
        self.pool.shutdown(wait=False, cancel_futures=True)


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
