"""One port in front of several rollout replicas.

The router is a small FastAPI app around a :class:`~polyrl.rollout.client.RolloutClient`:

* ``/generate``, ``/v1/completions`` and ``/v1/chat/completions`` are forwarded byte for byte
  (streams included) to the replica the client picks: least outstanding requests, sticky by
  ``session_id`` (a body field, or the ``X-Session-ID`` header), retried elsewhere when a replica
  dies before answering;
* ``/pause``, ``/resume``, ``/abort``, ``/sleep``, ``/wake_up`` and ``/update_weights`` are
  broadcast to every replica;
* ``/health`` reports every replica; ``/metrics`` concatenates theirs, each series labelled
  with ``replica="<i>"``; ``/v1/models`` is answered by any replica.

Bodies are capped in size and nesting (:class:`~polyrl.rollout.options.ServerLimits`) before
the router reads them; a malformed one gets 400 here, without reaching a replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from polyrl.core.http_guard import BodyLimit, json_request_body, parse_json
from polyrl.core.rollout_api import InvalidRequestError, RolloutError
from polyrl.rollout.client import RolloutClient, StreamedResponse
from polyrl.rollout.options import ServerLimits
from polyrl.rollout.routes.common import BearerAuth, error_response
from polyrl.rollout.schemas import (
    AbortBody,
    ChatCompletionBody,
    CompletionBody,
    GenerateBody,
    SleepBody,
    UpdateWeightsBody,
    WakeUpBody,
    check_body,
)

__all__ = ["create_router_app"]

_FORWARDED = {
    "/generate": GenerateBody,
    "/v1/completions": CompletionBody,
    "/v1/chat/completions": ChatCompletionBody,
}
_BROADCAST = {
    "/pause": None,
    "/resume": None,
    "/abort": AbortBody,
    "/sleep": SleepBody,
    "/wake_up": WakeUpBody,
    "/update_weights": UpdateWeightsBody,
}
_SERIES = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(.*)$")


def _label_metrics(text: str, replica: int, seen_meta: set[str]) -> list[str]:
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            if line not in seen_meta:
                seen_meta.add(line)
                out.append(line)
            continue
        m = _SERIES.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        inner = labels[1:-1] if labels else ""
        inner = f'replica="{replica}"' + (f",{inner}" if inner else "")
        out.append(f"{name}{{{inner}}} {value}")
    return out


def _session_of(request: Request, raw: bytes, max_depth: int) -> tuple[str | None, bool]:
    """Session id and stream flag of a forwarded body (the body itself is passed on as is).

    Raises:
        InvalidRequestError: the body is malformed or nested too deep.
    """
    session = request.headers.get("x-session-id")
    stream = False
    body = parse_json(raw, max_depth) if raw.strip() else None
    if isinstance(body, dict):
        sid = body.get("session_id")
        if isinstance(sid, str):
            session = sid
        stream = body.get("stream") is True
    return session, stream


def create_router_app(
    client: RolloutClient, api_key: str | None = None, limits: ServerLimits | None = None
) -> FastAPI:
    """Build the router app over ``client`` (started and closed with the app).

    Args:
        client: the replica manager (its ``api_key`` is what replicas expect).
        api_key: bearer token the router itself wants on every endpoint but ``/health``.
        limits: body size and nesting caps (the replicas apply the others).
    """
    limits = limits or ServerLimits()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await client.start()
        try:
            yield
        finally:
            await client.close()

    app = FastAPI(title="polyrl rollout router", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(RolloutError)
    async def _rollout_error(request: Request, exc: RolloutError) -> JSONResponse:
        return error_response(exc)

    if api_key is not None:
        # A plain ASGI middleware (not @app.middleware): no task group per request.
        app.add_middleware(BearerAuth, api_key=api_key)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)

    async def forward(request: Request) -> Response:
        raw = await request.body()
        session, stream = _session_of(request, raw, limits.max_json_depth)
        response, replica = await client.send(
            "POST", request.url.path, content=raw, session_id=session, stream=stream
        )
        headers = {"x-polyrl-replica": replica.url}
        if isinstance(response, StreamedResponse):

            async def body() -> AsyncIterator[bytes]:
                try:
                    async for chunk in response.aiter_bytes():
                        yield chunk
                finally:
                    await response.aclose()

            return StreamingResponse(
                body(),
                status_code=response.status_code,
                media_type=response.headers.get("content-type"),
                headers=headers,
            )
        return Response(
            response.content,
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
            headers=headers,
        )

    for path, model in _FORWARDED.items():
        app.add_api_route(path, forward, methods=["POST"], openapi_extra=json_request_body(model))

    def broadcaster(path: str, model: Any) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            raw = await request.body()
            body = parse_json(raw, limits.max_json_depth) if raw.strip() else {}
            if not isinstance(body, dict):
                raise InvalidRequestError(f"the {path} body must be a JSON object")
            if model is not None:
                check_body(model, body, path)
            answers = await client.broadcast(path, body)
            merged: dict[str, Any] = {"replicas": answers}
            if path == "/abort":
                merged["aborted"] = sum(a.get("aborted", 0) for a in answers)
            if path == "/update_weights":
                merged["weight_version"] = answers[0]["weight_version"]
            if path in ("/pause", "/resume"):
                merged["paused"] = path == "/pause"
            return JSONResponse(merged)

        return run

    for path, model in _BROADCAST.items():
        extra = json_request_body(model, required=path == "/update_weights") if model else None
        app.add_api_route(path, broadcaster(path, model), methods=["POST"], openapi_extra=extra)

    @app.get("/health")
    async def health() -> JSONResponse:
        states = await client.check_health()
        ok = any(s["healthy"] for s in states)
        return JSONResponse(
            {"status": "ok" if ok else "unavailable", "replicas": states},
            status_code=200 if ok else 503,
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        http = client._client()
        seen: set[str] = set()
        lines: list[str] = []

        async def fetch(url: str) -> str | None:
            try:
                r = await http.get(f"{url}/metrics", timeout=client.connect_timeout)
            except Exception:  # a dead replica just has no series
                return None
            return r.text if r.status_code == 200 else None

        texts = await asyncio.gather(*(fetch(r.url) for r in client.replicas))
        for i, text in enumerate(texts):
            if text is not None:
                lines.extend(_label_metrics(text, i, seen))
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        response, _ = await client.send("GET", "/v1/models")
        return Response(
            response.content,
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
        )

    return app
