"""Token-in/token-out generation: ``POST /generate`` (batched or streamed) and ``POST /abort``.

A vision model's ``/generate`` also takes ``images`` (base64, ``data:`` URLs, or
``{"path": ...}`` inside the server's allowed media directory) and ``videos`` (lists of
frames), as :meth:`~polyrl.core.multimodal.MultiModalInputs.media_payload` gives them. The
prompt carries one placeholder token per item (or the fully expanded runs); the response then
holds the expanded ``prompt_ids``.
"""

from __future__ import annotations

import dataclasses
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
from polyrl.rollout.options import ServerLimits
from polyrl.rollout.routes.common import (
    SSE_DONE,
    RenderPool,
    RequestTable,
    json_body,
    json_object,
    sse,
)
from polyrl.rollout.schemas import AbortBody, GenerateBody, check_body

__all__ = ["generation_router", "parse_generate"]

_GENERATE_FIELDS = {
    "input_ids",
    "sampling_params",
    "request_id",
    "stream",
    "session_id",
    "images",
    "videos",
    "mm_processor_kwargs",
}

_PIXEL_BOUND_KEYS = ("min_pixels", "max_pixels")


def _media_fields(body: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    images, videos = body.get("images") or [], body.get("videos") or []
    if not isinstance(images, list):
        raise InvalidRequestError("images must be a list of images", param="images")
    if not isinstance(videos, list) or not all(isinstance(v, list) for v in videos):
        raise InvalidRequestError("videos must be a list of frame lists", param="videos")
    return images, videos


def _pixel_bounds(
    body: dict[str, Any], max_image_pixels: int
) -> tuple[int | None, int | None] | None:
    """Return the request's ``mm_processor_kwargs`` as ``(min_pixels, max_pixels)``, or None.

    A trainer whose data processor used other pixel bounds than the model's sends them, so
    the server makes the same number of tokens per image. Both are capped at what the server
    decodes at all: a larger bound would only upscale an image into a bigger tensor.
    """
    kwargs = body.get("mm_processor_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, dict) or set(kwargs) - set(_PIXEL_BOUND_KEYS):
        raise InvalidRequestError(
            f"mm_processor_kwargs takes only {', '.join(_PIXEL_BOUND_KEYS)}; got "
            f"{sorted(kwargs) if isinstance(kwargs, dict) else type(kwargs).__name__}",
            param="mm_processor_kwargs",
        )
    bounds = []
    for key in _PIXEL_BOUND_KEYS:
        value = kwargs.get(key)
        ok = value is None or (
            isinstance(value, int) and not isinstance(value, bool) and 0 < value <= max_image_pixels
        )
        if not ok:
            raise InvalidRequestError(
                f"mm_processor_kwargs.{key} must be a whole number of pixels from 1 to "
                f"{max_image_pixels}; got {value!r}",
                param="mm_processor_kwargs",
            )
        bounds.append(value)
    return bounds[0], bounds[1]


async def attach_media(
    requests: list[GenerateRequest],
    body: dict[str, Any],
    vision: Any,
    renderer: RenderPool | None,
    limits: ServerLimits,
) -> list[GenerateRequest]:
    """Decode and process a ``/generate`` body's ``images``/``videos`` into its request.

    Returns the requests with expanded prompt ids and ``multi_modal`` set (unchanged when the
    body has no media).

    Raises:
        InvalidRequestError: media for a text-only model, for several prompts, unreadable or
            over a limit, or not matching the prompt's placeholders.
    """
    from polyrl.core.multimodal import MultiModalInputError

    images, videos = _media_fields(body)
    if not images and not videos:
        return requests
    if vision is None:
        raise InvalidRequestError(
            "the served model takes no images or videos (it has no vision tower)",
            param="images" if images else "videos",
            code="images_not_supported",
        )
    if len(requests) != 1:
        raise InvalidRequestError(
            "images and videos go with a single prompt; send one request per prompt",
            param="images",
        )
    req = requests[0]
    bounds = _pixel_bounds(body, vision.limits.max_image_pixels)

    def encode() -> tuple[list[int], Any]:
        return vision.encode(
            list(req.prompt_ids),
            images,
            videos,
            what="request",
            allowed_dir=limits.allowed_media_dir,
            pixel_bounds=bounds,
        )

    try:
        if renderer is not None:
            ids, mm = await renderer.run(encode)
        else:
            ids, mm = encode()
    except MultiModalInputError as exc:
        raise InvalidRequestError(str(exc), param="images" if images else "videos") from None
    except ValueError as exc:  # pixel bounds the model family refuses
        raise InvalidRequestError(str(exc), param="mm_processor_kwargs") from None
    return [dataclasses.replace(req, prompt_ids=tuple(ids), multi_modal=mm)]


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


def generation_router(
    backend: RolloutBackend,
    table: RequestTable,
    vision: Any = None,
    renderer: RenderPool | None = None,
    limits: ServerLimits | None = None,
) -> APIRouter:
    """Build the router of ``/generate`` and ``/abort``.

    Args:
        backend: the engine (``abort`` is called on it directly).
        table: runs the requests and keeps the in-flight ids that ``/abort`` resolves (shared
            with the OpenAI router, whose requests ``/abort`` ends too).
        vision: the model's vision processor (``None``: a text model, media get 400).
        renderer: threads that decode and process media off the event loop.
        limits: the server's limits (the allowed media directory).
    """
    limits = limits or ServerLimits()
    router = APIRouter()

    @router.post("/generate", openapi_extra=json_request_body(GenerateBody))
    async def generate(request: Request) -> Response:
        body = json_object(await json_body(request), "/generate")
        check_body(GenerateBody, body, "/generate", parse_generate)
        reqs, batched, stream, key = parse_generate(body)
        reqs = await attach_media(reqs, body, vision, renderer, limits)
        if stream:
            streams = await table.open_streams(key, reqs, stream=True)

            async def events() -> AsyncIterator[bytes]:
                try:
                    async for d in streams[0]:
                        event = {
                            "request_id": key,
                            "index": d.index,
                            "token_ids": d.token_ids,
                            "logprobs": d.logprobs,
                            "top_logprobs": d.top_logprobs,
                            "finish_reason": d.finish_reason,
                            "stop_reason": d.stop_reason,
                            "weight_version": d.weight_version,
                        }
                        if d.prompt_logprobs is not None:  # once, on a delta of sample 0
                            event["prompt_logprobs"] = d.prompt_logprobs
                            event["prompt_top_logprobs"] = d.prompt_top_logprobs
                        yield sse(event)
                    yield SSE_DONE
                finally:
                    await table.close_streams(streams, key)

            return StreamingResponse(events(), media_type="text/event-stream")

        outs = await table.run_requests(request, key, reqs)
        if outs is None:
            return Response(status_code=499)
        results = [o.to_dict() for o in outs]
        for req, res in zip(reqs, results, strict=True):
            if req.multi_modal is not None:
                res["prompt_ids"] = list(req.prompt_ids)  # with the placeholders expanded
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
