"""The request bodies of the rollout server and router, as pydantic models.

They serve two purposes: the OpenAPI schema (``/openapi.json``) describes every POST body
through them, and every body is checked against them (strict types, unknown fields refused)
before the hand-written parsers of :mod:`~polyrl.rollout.routes.generation` and
:mod:`~polyrl.rollout.openai_compat` read it. Those parsers keep the precise error messages
("did you mean 'top_k'"); the models make sure nothing of an unexpected type reaches them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from polyrl.core.rollout_api import InvalidRequestError

__all__ = [
    "AbortBody",
    "ChatCompletionBody",
    "CompletionBody",
    "GenerateBody",
    "SamplingParamsBody",
    "SleepBody",
    "UpdateWeightsBody",
    "WakeUpBody",
    "check_body",
]

_STRICT = ConfigDict(strict=True, extra="forbid")

Stop = str | list[str] | None


class SamplingParamsBody(BaseModel):
    """``sampling_params`` of ``/generate``: the fields of ``SamplingParams``."""

    model_config = _STRICT

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    stop: Stop = None
    ignore_eos: bool | None = None
    n: int | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    return_routed_experts: bool | None = None
    prompt_logprobs: int | None = None


class GenerateBody(BaseModel):
    """``POST /generate``: one prompt of token ids, or a list of them."""

    model_config = _STRICT

    input_ids: list[int] | list[list[int]]
    sampling_params: SamplingParamsBody | None = None
    request_id: str | None = None
    stream: bool | None = None
    session_id: str | None = None
    images: list[Any] | None = None
    videos: list[list[Any]] | None = None
    mm_processor_kwargs: dict[str, int] | None = None


class AbortBody(BaseModel):
    """``POST /abort``: the request ids to end (all in flight when left out)."""

    model_config = _STRICT

    request_ids: list[str] | None = None


class SleepBody(BaseModel):
    """``POST /sleep``."""

    model_config = _STRICT

    level: int | None = None


class WakeUpBody(BaseModel):
    """``POST /wake_up``."""

    model_config = _STRICT

    tags: list[str] | None = None


class UpdateWeightsBody(BaseModel):
    """``POST /update_weights``: a safetensors directory and the version it becomes."""

    model_config = _STRICT

    path: str
    version: int | None = None


class _OpenAICommon(BaseModel):
    """Fields shared by both OpenAI endpoints (those without effect here included)."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    stop: Stop = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    skip_special_tokens: bool | None = None
    session_id: str | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None


class CompletionBody(_OpenAICommon):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """One chat message (extra fields such as ``tool_calls`` or ``name`` pass through)."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionBody(_OpenAICommon):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


def _where(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def check_body(model: type[BaseModel], body: Any, what: str, parse: Any = None) -> None:
    """Check ``body`` against ``model``; a mismatch is an :class:`InvalidRequestError`.

    Args:
        model: the endpoint's body model.
        body: the parsed JSON.
        what: the endpoint, for the message.
        parse: the endpoint's own parser, called on a mismatch first: where it sees the
            problem its message is the better one (it names the closest field, the range).

    Raises:
        InvalidRequestError: the body does not fit ``model``.
    """
    try:
        model.model_validate(body)
    except ValidationError as exc:
        if parse is not None:
            try:
                parse(body)
            except InvalidRequestError:
                raise
            except Exception:  # noqa: BLE001 - the schema's message below says what is wrong
                pass
        err = exc.errors()[0]
        loc = tuple(p for p in err["loc"] if not isinstance(p, str) or "[" not in p)
        where = _where(loc)
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field"
        elif err["type"] == "missing":
            message = "missing required field"
        raise InvalidRequestError(
            f"invalid {what} body: {where or 'body'}: {message}",
            param=str(loc[0]) if loc else None,
        ) from None
