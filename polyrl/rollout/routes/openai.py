"""The OpenAI-compatible endpoints (``/v1/models``, ``/v1/completions``, ``/v1/chat/...``).

``GET /v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed or
not). Request parsing and response building are in :mod:`polyrl.rollout.openai_compat`; this
module runs the parsed jobs on the backend and streams their text. Parsing (chat template,
tokenizer) runs in a :class:`~polyrl.rollout.routes.common.RenderPool`, off the event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from polyrl.core.http_guard import json_request_body
from polyrl.core.rollout_api import GenerateRequest, RolloutBackend, SampleOutput
from polyrl.rollout import openai_compat as oai
from polyrl.rollout.routes.common import (
    SSE_DONE,
    RenderPool,
    RequestTable,
    json_body,
    merge_streams,
    sse,
)
from polyrl.rollout.schemas import ChatCompletionBody, CompletionBody, check_body

__all__ = ["openai_router"]


def _job_requests(job: oai.OpenAIJob) -> list[GenerateRequest]:
    return [
        GenerateRequest(f"{job.request_id}-{i}", tuple(p), job.params, multi_modal=job.multi_modal)
        for i, p in enumerate(job.prompts)
    ]


def _checked(model: Any, what: str, parse: Any) -> Any:
    def run(
        body: Any, tokenizer: Any, info: Any, policy: oai.PromptPolicy | None, *extra: Any
    ) -> Any:
        check_body(model, body, what, lambda b: parse(b, tokenizer, info, policy, *extra))
        return parse(body, tokenizer, info, policy, *extra)

    return run


_parse_completion = _checked(CompletionBody, "/v1/completions", oai.parse_completion_request)
_parse_chat = _checked(ChatCompletionBody, "/v1/chat/completions", oai.parse_chat_request)


def openai_router(
    backend: RolloutBackend,
    tokenizer: Any,
    table: RequestTable,
    renderer: RenderPool | None = None,
    policy: oai.PromptPolicy | None = None,
    model_dir: str | None = None,
    vision: Any = None,
) -> APIRouter:
    """Build the router of the OpenAI-compatible ``/v1/...`` endpoints.

    Args:
        backend: the engine (its :class:`~polyrl.core.rollout_api.ModelInfo` names the model).
        tokenizer: the model's tokenizer (chat templates, text in and out).
        table: runs the requests and keeps them in flight for ``/abort``.
        renderer: where templates are rendered and text tokenized (default: a pool of its own).
        policy: which templates requests may use (default: the model's only); without a
            ``max_prompt_chars`` of its own, texts are bounded by the context length.
        model_dir: the served model's directory, reported as ``root`` by ``/v1/models`` (as
            vLLM does), so a client on the same host finds its tokenizer there.
        vision: the model's vision processor: chat messages may then carry ``image_url``
            parts with ``data:`` URLs (``None``: a text model, image parts get 400).
    """
    router = APIRouter()
    pool = renderer or RenderPool()
    base = policy or oai.PromptPolicy()
    policies: list[oai.PromptPolicy] = []

    def prompt_policy() -> oai.PromptPolicy:
        # The backend knows its context length once started, not when the app is built.
        if not policies:
            p = base
            if p.max_prompt_chars is None:
                chars = oai.PromptPolicy.longest_token_chars(tokenizer)
                p = dataclasses.replace(p, max_prompt_chars=backend.info.max_model_len * chars)
            policies.append(p)
        return policies[0]

    async def stream_job(job: oai.OpenAIJob) -> StreamingResponse:
        streams = await table.open_streams(job.request_id, _job_requests(job), stream=True)
        n = job.params.n
        chat = job.kind == "chat.completion"

        async def events() -> AsyncIterator[bytes]:
            asms: dict[int, oai.TextAssembler] = {}
            samples: dict[int, SampleOutput] = {}
            try:
                async with contextlib.aclosing(merge_streams(streams)) as merged:
                    async for p, d in merged:
                        idx = p * n + d.index
                        asm = asms.get(idx)
                        if asm is None:
                            asm = asms[idx] = oai.TextAssembler(
                                tokenizer, job.params.stop, job.skip_special_tokens
                            )
                            samples[idx] = SampleOutput(index=idx)
                            if chat:
                                yield sse(
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
                            yield sse(
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
                            yield sse(
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
                    yield sse(oai.usage_chunk(job, list(samples.values())))
                yield SSE_DONE
            finally:
                await table.close_streams(streams, job.request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        i = backend.info
        card: dict[str, Any] = {
            "id": i.model,
            "object": "model",
            "owned_by": "polyrl",
            "max_model_len": i.max_model_len,
        }
        if model_dir:
            card["root"] = model_dir
        return {"object": "list", "data": [card]}

    @router.post("/v1/completions", openapi_extra=json_request_body(CompletionBody))
    async def completions(request: Request) -> Response:
        body = await json_body(request)
        job = await pool.run(_parse_completion, body, tokenizer, backend.info, prompt_policy())
        if job.stream:
            return await stream_job(job)
        outs = await table.run_requests(request, job.request_id, _job_requests(job))
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(oai.completion_response(job, tokenizer, [o.outputs for o in outs]))

    @router.post("/v1/chat/completions", openapi_extra=json_request_body(ChatCompletionBody))
    async def chat_completions(request: Request) -> Response:
        body = await json_body(request)
        job = await pool.run(_parse_chat, body, tokenizer, backend.info, prompt_policy(), vision)
        if job.stream:
            return await stream_job(job)
        outs = await table.run_requests(request, job.request_id, _job_requests(job))
        if outs is None:
            return Response(status_code=499)
        return JSONResponse(oai.chat_response(job, tokenizer, outs[0].outputs))

    return router
