"""What the rollout server's routers share: error bodies, JSON bodies, SSE, auth, in-flight ids.

:class:`RequestTable` is the one piece of state shared between routers: ``/generate`` and the
OpenAI endpoints record which engine requests a client-visible request id runs as, and
``/abort`` reads it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from polyrl.core.rollout_api import (
    GenerateRequest,
    InvalidRequestError,
    RolloutBackend,
    RolloutError,
    SampleDelta,
    collect_outputs,
)

__all__ = [
    "SSE_DONE",
    "BearerAuth",
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
    """Answer ``exc`` with its status and :func:`error_body`."""
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.param, exc.code), status_code=exc.status
    )


def add_error_handlers(app: FastAPI) -> None:
    """Make ``app`` answer a :class:`RolloutError` or an HTTP error (404, 405...) with a body."""

    @app.exception_handler(RolloutError)
    async def _rollout_error(request: Request, exc: RolloutError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(f"{exc.detail}: {request.method} {request.url.path}", kind),
            status_code=exc.status_code,
        )


async def json_body(request: Request, required: bool = True) -> Any:
    """Parse the request's JSON body (an empty body is ``{}`` unless ``required``).

    Raises:
        InvalidRequestError: empty (when required) or malformed body.
    """
    raw = await request.body()
    if not raw.strip():
        if required:
            raise InvalidRequestError("the request body is empty; expected a JSON object")
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"malformed JSON body: {exc}", code="malformed_json") from exc


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

    def __init__(self, backend: RolloutBackend):
        self.backend = backend
        # Client-visible request id -> engine request ids (a batch runs one per prompt).
        self.inflight: dict[str, list[str]] = {}

    async def open_streams(
        self, key: str, reqs: list[GenerateRequest], stream: bool
    ) -> list[AsyncIterator[SampleDelta]]:
        """Submit ``reqs`` under client id ``key``; return one delta stream per request.

        Raises:
            InvalidRequestError: ``key`` is already in flight.
        """
        if key in self.inflight:
            raise InvalidRequestError(f"request_id {key!r} is already in flight", "request_id")
        streams: list[AsyncIterator[SampleDelta]] = []
        try:
            for r in reqs:
                streams.append(await self.backend.generate(r, stream=stream))
        except BaseException:
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
