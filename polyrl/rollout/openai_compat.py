"""OpenAI-compatible request parsing and response building for the rollout server.

``/v1/completions`` and ``/v1/chat/completions`` follow the OpenAI wire format, so the official
``openai`` client works unchanged. Extra request fields (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``,
``chat_template_kwargs``, ``add_generation_prompt``, ``session_id``) pass through
``extra_body``; every choice also carries ``token_ids`` (the completion's token ids),
``prompt_token_ids`` and ``weight_version``, reachable from the client as ``model_extra``.
Unknown request fields are rejected (a typo such as ``temprature`` must not pass silently).

Chat templates come from the model, or from an allow-list the server was started with
(:class:`PromptPolicy`): a request may *name* one in ``chat_template_kwargs.chat_template``,
and brings a template of its own only where the server allows it explicitly (a template is
code the server runs). Text longer than any prompt that could fit the context
(:attr:`PromptPolicy.max_prompt_chars`) is refused before it is tokenized.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from polyrl.core.registry import did_you_mean
from polyrl.core.rollout_api import (
    MAX_TOP_LOGPROBS,
    InvalidRequestError,
    ModelInfo,
    SampleOutput,
    SamplingParams,
)

__all__ = [
    "OpenAIJob",
    "PromptPolicy",
    "TextAssembler",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "parse_chat_request",
    "parse_completion_request",
    "usage_chunk",
]

# Fields of the OpenAI APIs accepted but without effect here (their values are checked below
# where a non-default value would change the meaning of the request).
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "tool_choice"}
_EXTRA_SAMPLING = ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos")
_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "skip_special_tokens",
    "session_id",
    "request_id",
    "return_token_ids",
    *_EXTRA_SAMPLING,
}
_COMPLETION_FIELDS = _COMMON | _IGNORED | {"prompt", "logprobs", "echo", "best_of", "suffix"}
_CHAT_FIELDS = (
    _COMMON
    | _IGNORED
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "response_format",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
    }
)


@dataclasses.dataclass
class OpenAIJob:
    """A parsed OpenAI request: prompts as token ids and how to sample them."""

    kind: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    skip_special_tokens: bool
    top_logprobs: int | None
    request_id: str
    created: int
    model: str
    #: The prompt's processed images (vision models; one prompt), else ``None``.
    multi_modal: Any = None


def _fail(message: str, param: str | None = None, code: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


@dataclasses.dataclass(frozen=True)
class PromptPolicy:
    """Which chat templates a request may use, and how much text it may send.

    Attributes:
        templates: name -> Jinja template, the allow-list a request may name (besides the
            model's own named templates).
        allow_request_templates: accept a template text from the request itself.
        max_prompt_chars: longest text (a prompt string, a rendered chat) that is tokenized;
            ``None`` = no limit. :meth:`for_model` derives it from the context length.
    """

    templates: Mapping[str, str] = dataclasses.field(default_factory=dict)
    allow_request_templates: bool = False
    max_prompt_chars: int | None = None

    @staticmethod
    def longest_token_chars(tokenizer: Any) -> int:
        """Characters of the longest entry of the tokenizer's vocabulary (at least 1)."""
        try:
            return max(1, max(map(len, tokenizer.get_vocab())))
        except (AttributeError, TypeError, ValueError):
            return 64

    @classmethod
    def for_model(
        cls,
        tokenizer: Any,
        max_model_len: int,
        templates: Mapping[str, str] | None = None,
        allow_request_templates: bool = False,
    ) -> PromptPolicy:
        """Return the policy of a server of ``max_model_len`` tokens.

        A text longer than ``max_model_len`` times the longest vocabulary entry cannot fit the
        context whatever its tokens, so it is refused before tokenizing.
        """
        return cls(
            templates=dict(templates or {}),
            allow_request_templates=allow_request_templates,
            max_prompt_chars=max_model_len * cls.longest_token_chars(tokenizer),
        )

    def check_text(self, text: str, param: str) -> None:
        """Refuse ``text`` when it is longer than any prompt that fits the context."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise _fail(
                f"the {param} text has {len(text)} characters; no prompt longer than "
                f"{self.max_prompt_chars} fits this model's context",
                param=param,
                code="context_length_exceeded",
            )

    def template_kwargs(self, tokenizer: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Check ``chat_template_kwargs``; resolve an allow-listed template name to its text.

        Raises:
            InvalidRequestError: a template the policy does not allow, or a keyword that is a
                parameter of ``apply_chat_template`` itself rather than a template variable.
        """
        out = dict(kwargs)
        reserved = _reserved_template_kwargs(tokenizer)
        bad = sorted(k for k in out if k in reserved)
        if bad:
            raise _fail(
                f"chat_template_kwargs may not set {bad} (they are not template variables)",
                param="chat_template_kwargs",
            )
        name = out.pop("chat_template", None)
        if name is None:
            return out
        if not isinstance(name, str) or not name:
            raise _fail(
                "chat_template_kwargs.chat_template must be a template name",
                param="chat_template_kwargs",
            )
        own = getattr(tokenizer, "chat_template", None)
        if name in self.templates:
            out["chat_template"] = self.templates[name]
        elif isinstance(own, Mapping) and name in own:
            out["chat_template"] = name  # one of the model's own named templates
        elif self.allow_request_templates:
            out["chat_template"] = name
        else:
            names = sorted(self.templates) + (sorted(own) if isinstance(own, Mapping) else [])
            raise _fail(
                "this server takes no chat template from requests; chat_template may name "
                f"one of {names} (the server's --chat-template allow-list)",
                param="chat_template_kwargs",
                code="chat_template_not_allowed",
            )
        return out


def _reserved_template_kwargs(tokenizer: Any) -> set[str]:
    """``apply_chat_template``'s own parameters (``chat_template`` aside)."""
    try:
        params = inspect.signature(tokenizer.apply_chat_template).parameters
    except (TypeError, ValueError, AttributeError):
        return set()
    return {
        n
        for n, p in params.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and n not in ("chat_template", "documents")
    }


def _check_fields(body: Mapping[str, Any], allowed: set[str], endpoint: str) -> None:
    for key in body:
        if key not in allowed:
            hint = did_you_mean(key, sorted(allowed))
            raise _fail(f"unknown field {key!r} for {endpoint}{hint}", param=key)


def _check_model(body: Mapping[str, Any], info: ModelInfo) -> str:
    model = body.get("model")
    if model is None:
        return info.model
    if not isinstance(model, str):
        raise _fail(f"model must be a string, got {type(model).__name__}", param="model")
    return model


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _fail(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _unsupported_zero(body: Mapping[str, Any], name: str) -> None:
    value = body.get(name)
    if value not in (None, 0, 0.0, {}):
        raise _fail(
            f"{name}={value!r} is not supported by this server; use repetition_penalty instead"
            if name.endswith("penalty")
            else f"{name}={value!r} is not supported by this server",
            param=name,
        )


def _sampling(body: Mapping[str, Any], max_new: Any, logprobs: bool, top: int) -> SamplingParams:
    raw: dict[str, Any] = {
        "max_new_tokens": max_new,
        "logprobs": logprobs,
        "top_logprobs": top,
    }
    for name in ("temperature", "top_p", "n", "seed", "stop", *_EXTRA_SAMPLING):
        if body.get(name) is not None:
            raw[name] = body[name]
    for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
        _unsupported_zero(body, name)
    if raw.get("max_new_tokens") is not None and not isinstance(raw["max_new_tokens"], int):
        raise _fail(f"max_tokens must be an int >= 1, got {max_new!r}", param="max_tokens")
    try:
        return SamplingParams.from_dict(raw)
    except InvalidRequestError as exc:
        if exc.param == "max_new_tokens":
            raise _fail(
                exc.message.replace("max_new_tokens", "max_tokens"), param="max_tokens"
            ) from exc
        raise


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, Mapping):
        raise _fail("stream_options must be an object", param="stream_options")
    if not stream:
        raise _fail("stream_options is only allowed with stream=true", param="stream_options")
    return bool(opts.get("include_usage", False))


def _check_token_list(values: Sequence[Any], param: str) -> list[int]:
    for pos, tok in enumerate(values):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise _fail(f"{param}[{pos}] is {tok!r}; expected an int token id", param=param)
    return list(values)


def _request_id(body: Mapping[str, Any], prefix: str) -> str:
    rid = body.get("request_id")
    if rid is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(rid, str) or not rid:
        raise _fail("request_id must be a non-empty string", param="request_id")
    return rid


def parse_completion_request(
    body: Any, tokenizer: Any, info: ModelInfo, policy: PromptPolicy | None = None
) -> OpenAIJob:
    """Parse a ``/v1/completions`` body.

    ``prompt`` may be a string, a list of strings, a list of token ids or a list of such lists.
    ``policy`` bounds the text tokenized (default: no bound).

    Raises:
        InvalidRequestError: on any malformed or unsupported field.
    """
    if not isinstance(body, Mapping):
        raise _fail("the request body must be a JSON object")
    _check_fields(body, _COMPLETION_FIELDS, "/v1/completions")
    model = _check_model(body, info)
    if body.get("echo"):
        raise _fail("echo=true is not supported", param="echo")
    if body.get("suffix") is not None:
        raise _fail("suffix is not supported", param="suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise _fail("best_of must equal n (or be left out)", param="best_of")
    prompt = body.get("prompt")
    if prompt is None:
        raise _fail("missing required field 'prompt'", param="prompt")
    policy = policy or PromptPolicy()
    prompts: list[list[int]]
    if isinstance(prompt, str):
        policy.check_text(prompt, "prompt")
        prompts = [tokenizer(prompt).input_ids]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        for p in prompt:
            policy.check_text(p, "prompt")
        prompts = [tokenizer(p).input_ids for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [_check_token_list(p, "prompt") for p in prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = [_check_token_list(prompt, "prompt")]
    else:
        raise _fail(
            "prompt must be a non-empty string, list of strings, list of token ids or list of "
            "token-id lists",
            param="prompt",
        )
    if any(not p for p in prompts):
        raise _fail("prompt must not be empty", param="prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs
    ):
        raise _fail(f"logprobs must be an int in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    if logprobs is not None and logprobs > MAX_TOP_LOGPROBS:
        raise _fail(f"logprobs must be an int in [0, {MAX_TOP_LOGPROBS}]", param="logprobs")
    max_tokens = body.get("max_tokens", 16)
    params = _sampling(body, max_tokens, logprobs is not None, logprobs or 0)
    stream = _flag(body, "stream", False)
    return OpenAIJob(
        kind="text_completion",
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=_stream_options(body, stream),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
        top_logprobs=logprobs,
        request_id=_request_id(body, "cmpl"),
        created=int(time.time()),
        model=model,
    )


def _image_part_url(part: Mapping[str, Any], index: int) -> str:
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    if not isinstance(url, str):
        raise _fail(
            f"messages[{index}].content: an image_url part needs image_url.url", param="messages"
        )
    if not url[:5].lower() == "data:":
        # The server fetches nothing: a remote URL would let a client make it connect anywhere.
        raise _fail(
            f"messages[{index}].content: only data: image URLs are accepted (remote URLs are "
            "not fetched); send data:image/png;base64,...",
            param="messages",
            code="remote_url_not_allowed",
        )
    return url


def _message_content(
    content: Any, index: int, images: list[str] | None
) -> str | list[dict[str, Any]] | None:
    """Return a message's content for the template: text, or text and image parts.

    ``images`` collects the ``data:`` URLs of image parts (``None``: the model takes none).
    """
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        has_image = False
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image_url" and images is not None:
                images.append(_image_part_url(part, index))
                parts.append({"type": "image"})
                has_image = True
            elif kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            else:
                what = "text and image_url" if images is not None else "text"
                if kind == "image_url":
                    what += " (the served model takes no images)"
                raise _fail(
                    f"messages[{index}].content: only {what} parts are supported, got "
                    f"{str(part)[:200]!r}",
                    param="messages",
                    code="images_not_supported" if kind == "image_url" else None,
                )
        if has_image:
            return parts
        return "".join(p["text"] for p in parts)
    raise _fail(
        f"messages[{index}].content must be a string or a list of text parts", param="messages"
    )


def parse_chat_request(
    body: Any,
    tokenizer: Any,
    info: ModelInfo,
    policy: PromptPolicy | None = None,
    vision: Any = None,
) -> OpenAIJob:
    """Parse a ``/v1/chat/completions`` body; the prompt is rendered by the chat template.

    ``tools`` are handed to the template (which lists them in the system turn). ``policy``
    says which templates ``chat_template_kwargs`` may name (default: the model's only).
    With ``vision`` (the model's :class:`~polyrl.models.processor.VisionProcessor`),
    ``image_url`` content parts holding ``data:`` URLs are decoded and placed at the
    template's image placeholders (no paths, no remote URLs).

    Raises:
        InvalidRequestError: malformed messages or fields, or a template that fails on them.
    """
    if not isinstance(body, Mapping):
        raise _fail("the request body must be a JSON object")
    _check_fields(body, _CHAT_FIELDS, "/v1/chat/completions")
    model = _check_model(body, info)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages must be a non-empty list", param="messages")
    rendered: list[dict[str, Any]] = []
    images: list[str] | None = [] if vision is not None else None
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise _fail(f"messages[{i}] must be an object with a string 'role'", param="messages")
        item = dict(msg)
        item["content"] = _message_content(msg.get("content"), i, images)
        rendered.append(item)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
    ):
        raise _fail("tools must be a list of objects", param="tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, Mapping) or fmt.get("type") != "text"):
        raise _fail("only response_format {'type': 'text'} is supported", param="response_format")
    policy = policy or PromptPolicy()
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise _fail("chat_template_kwargs must be an object", param="chat_template_kwargs")
    kwargs = policy.template_kwargs(tokenizer, kwargs)
    add_gen = _flag(body, "add_generation_prompt", True)
    cont = _flag(body, "continue_final_message", False)
    if add_gen and cont and "add_generation_prompt" in body:
        raise _fail(
            "add_generation_prompt and continue_final_message cannot both be true",
            param="continue_final_message",
        )
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            tools=tools,
            add_generation_prompt=add_gen and not cont,
            continue_final_message=cont,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # jinja errors of any kind are the request's fault
        raise _fail(f"the chat template failed on these messages: {exc}", param="messages") from exc
    if not isinstance(text, str):
        raise _fail("the chat template did not render to text", param="messages")
    policy.check_text(text, "messages")
    prompt_ids = tokenizer(text, add_special_tokens=False).input_ids
    multi_modal = None
    if images:
        from polyrl.core.multimodal import MultiModalInputError

        try:
            prompt_ids, multi_modal = vision.encode(prompt_ids, images, what="messages")
        except MultiModalInputError as exc:
            raise _fail(str(exc), param="messages") from None
    logprobs = _flag(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise _fail(
                f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs"
            )
        if not logprobs and top:
            raise _fail("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = _sampling(body, max_tokens, logprobs, top or 0)
    stream = _flag(body, "stream", False)
    return OpenAIJob(
        kind="chat.completion",
        prompts=[prompt_ids],
        params=params,
        stream=stream,
        include_usage=_stream_options(body, stream),
        skip_special_tokens=_flag(body, "skip_special_tokens", True),
        top_logprobs=top if logprobs else None,
        request_id=_request_id(body, "chatcmpl"),
        created=int(time.time()),
        model=model,
        multi_modal=multi_modal,
    )


class TextAssembler:
    """Incremental detokenisation of one choice, honouring stop strings.

    Text that could still turn into a stop string, or that ends in an incomplete UTF-8
    sequence, is held back until it can no longer change.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.sent = ""
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)

    def final_text(self, stop_reason: Any = None) -> str:
        """Return the whole text, cut before the stop string that ended it."""
        text = self._decode()
        if isinstance(stop_reason, str):
            cut = text.find(stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text

    def push(self, token_ids: Sequence[int], finished: bool, stop_reason: Any = None) -> str:
        """Add tokens; return the text that is now safe to send."""
        self.ids.extend(token_ids)
        if finished:
            text = self.final_text(stop_reason)
        else:
            text = self._decode()
            if text.endswith("\ufffd"):
                return ""
            if self.stop and self._holdback:
                text = text[: max(len(self.sent), len(text) - self._holdback)]
        if not text.startswith(self.sent):
            # A later token changed how earlier bytes decode; never resend, only append.
            return ""
        delta = text[len(self.sent) :]
        self.sent = text
        return delta

    def token_text(self, token_id: int) -> str:
        """Decode one token, as logprob entries show it."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(
    asm: TextAssembler, sample: SampleOutput, k: int | None, offset: int = 0
) -> dict[str, Any]:
    tokens = [asm.token_text(t) for t in sample.output_ids]
    offsets = []
    pos = offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top = None
    if k:
        top = [
            {asm.token_text(tid): lp for tid, lp in alts}
            for alts in (sample.top_logprobs or [[] for _ in tokens])
        ]
    return {
        "tokens": tokens,
        "token_logprobs": list(sample.logprobs or []),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(
    asm: TextAssembler, ids: Sequence[int], lps: Sequence[float], tops: Any
) -> dict[str, Any]:
    content = []
    for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
        text = asm.token_text(tid)
        alts = tops[i] if tops else []
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": asm.token_text(a),
                        "logprob": v,
                        "bytes": list(asm.token_text(a).encode("utf-8")),
                    }
                    for a, v in alts
                ],
            }
        )
    return {"content": content}


def _usage(prompts: list[list[int]], samples: list[SampleOutput], n: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(s.output_ids) for s in samples)
    cached = max((s.cached_prompt_tokens for s in samples), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def completion_response(
    job: OpenAIJob, tokenizer: Any, samples: list[list[SampleOutput]]
) -> dict[str, Any]:
    """Build the ``text_completion`` body; ``samples[p]`` are the ``n`` samples of prompt ``p``."""
    choices = []
    flat: list[SampleOutput] = []
    n = job.params.n
    for p, per_prompt in enumerate(samples):
        for s in per_prompt:
            asm = TextAssembler(tokenizer, job.params.stop, job.skip_special_tokens)
            asm.ids = list(s.output_ids)
            choices.append(
                {
                    "index": p * n + s.index,
                    "text": asm.final_text(s.stop_reason),
                    "logprobs": _completion_logprobs(asm, s, job.top_logprobs)
                    if job.top_logprobs is not None
                    else None,
                    "finish_reason": s.finish_reason,
                    "stop_reason": s.stop_reason,
                    "prompt_token_ids": job.prompts[p],
                    "token_ids": s.output_ids,
                    "weight_version": s.weight_version,
                }
            )
            flat.append(s)
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": _usage(job.prompts, flat, n),
        "weight_version": max((s.weight_version for s in flat), default=0),
    }


def chat_response(job: OpenAIJob, tokenizer: Any, samples: list[SampleOutput]) -> dict[str, Any]:
    """Build the ``chat.completion`` body for the ``n`` samples of the one prompt."""
    choices = []
    for s in samples:
        asm = TextAssembler(tokenizer, job.params.stop, job.skip_special_tokens)
        asm.ids = list(s.output_ids)
        choices.append(
            {
                "index": s.index,
                "message": {"role": "assistant", "content": asm.final_text(s.stop_reason)},
                "logprobs": _chat_logprobs(asm, s.output_ids, s.logprobs or [], s.top_logprobs)
                if job.params.logprobs
                else None,
                "finish_reason": s.finish_reason,
                "stop_reason": s.stop_reason,
                "token_ids": s.output_ids,
                "weight_version": s.weight_version,
            }
        )
    return {
        "id": job.request_id,
        "object": "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "prompt_token_ids": job.prompts[0],
        "usage": _usage(job.prompts, samples, job.params.n),
        "weight_version": max((s.weight_version for s in samples), default=0),
    }


def usage_chunk(job: OpenAIJob, samples: list[SampleOutput]) -> dict[str, Any]:
    """Build the final streamed chunk carrying ``usage`` (``stream_options.include_usage``)."""
    return {
        "id": job.request_id,
        "object": "chat.completion.chunk" if job.kind == "chat.completion" else job.kind,
        "created": job.created,
        "model": job.model,
        "choices": [],
        "usage": _usage(job.prompts, samples, job.params.n),
    }


def completion_chunk(
    job: OpenAIJob,
    index: int,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    weight_version: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk."""
    return {
        "id": job.request_id,
        "object": "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "token_ids": token_ids,
                "weight_version": weight_version,
            }
        ],
    }


def chat_chunk(
    job: OpenAIJob,
    index: int,
    delta: dict[str, Any],
    token_ids: list[int],
    finish_reason: str | None,
    weight_version: int,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``."""
    return {
        "id": job.request_id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": job.model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "token_ids": token_ids,
                "weight_version": weight_version,
            }
        ],
    }


def chat_logprobs_delta(
    asm: TextAssembler, ids: Sequence[int], lps: Sequence[float] | None, tops: Any
) -> dict[str, Any] | None:
    """Chat ``logprobs`` object for the tokens of one streamed delta."""
    if lps is None:
        return None
    return _chat_logprobs(asm, ids, lps, tops)


def completion_logprobs_delta(
    asm: TextAssembler,
    ids: Sequence[int],
    lps: Sequence[float] | None,
    tops: Any,
    k: int | None,
    offset: int,
) -> dict[str, Any] | None:
    """Completions ``logprobs`` object for the tokens of one streamed delta."""
    if lps is None or k is None:
        return None
    sample = SampleOutput(index=0, output_ids=list(ids), logprobs=list(lps), top_logprobs=tops)
    return _completion_logprobs(asm, sample, k, offset)
