"""Token-in/token-out generation: ``POST /generate`` (batched or streamed) and ``POST /abort``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polyrl.core.http_guard import json_request_body
from polyrl.core.rollout_api import (
    GenerateRequest,
    InvalidRequestError,
    RolloutBackend,
    SamplingParams,
)
from polyrl.rollout.routes.common import SSE_DONE, RequestTable, json_body, json_object, sse
from polyrl.rollout.schemas import AbortBody, GenerateBody, check_body

__all__ = ["generation_router", "parse_generate"]

_GENERATE_FIELDS = {"input_ids", "sampling_params", "request_id", "stream", "session_id"}


def parse_generate(body: dict[str, Any]) -> tuple[list[GenerateRequest], bool, bool, str]:
    """Validate a ``/generate`` body; return ``(requests, batched, stream, request_id)``.

    Raises:
        InvalidRequestError: unknown or missing field, bad ids, bad sampling parameters.
    """
    for key in body:
        if key not in _GENERATE_FIELDS:
            hint = ""
            if key in SamplingParams.field_names():
                hint = "; sampling parameters go inside 'sampling_params'"
            raise InvalidRequestError(
                f"unknown field {key!r} for /generate{hint} (accepted: {sorted(_GENERATE_FIELDS)})",
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


def generation_router(backend: RolloutBackend, table: RequestTable) -> APIRouter:
    """Build the router of ``/generate`` and ``/abort``.

    Args:
        backend: the engine (``abort`` is called on it directly).
        table: runs the requests and keeps the in-flight ids that ``/abort`` resolves (shared
            with the OpenAI router, whose requests ``/abort`` ends too).
    """
    router = APIRouter()

    @router.post("/generate", openapi_extra=json_request_body(GenerateBody))
    async def generate(request: Request) -> Response:
        body = json_object(await json_body(request), "/generate")
        check_body(GenerateBody, body, "/generate", parse_generate)
        reqs, batched, stream, key = parse_generate(body)
        if stream:
            streams = await table.open_streams(key, reqs, stream=True)

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for d in streams[0]:
                        yield sse(
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
                    yield SSE_DONE
                finally:
                    await table.close_streams(streams, key)

            return StreamingResponse(events(), media_type="text/event-stream")

        outs = await table.run_requests(request, key, reqs)
        if outs is None:
            return Response(status_code=499)
        results = [o.to_dict() for o in outs]
        if batched:
            return JSONResponse(
                {"results": results, "weight_version": max(r["weight_version"] for r in results)}
            )
        return JSONResponse(results[0])

    @router.post("/abort", openapi_extra=json_request_body(AbortBody, required=False))
    async def abort(request: Request) -> dict[str, Any]:
        body = json_object(await json_body(request, required=False), "/abort")
        check_body(AbortBody, body, "/abort")
        ids = body.get("request_ids")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
            raise InvalidRequestError("request_ids must be a list of strings", param="request_ids")
        if ids is not None:
            # A batched /generate or OpenAI request runs as several engine requests.
            ids = table.engine_ids(ids)
        return {"aborted": await backend.abort(ids)}

    return router
