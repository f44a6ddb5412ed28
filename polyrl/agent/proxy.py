"""An OpenAI-compatible recording proxy: train agents written for the OpenAI API without drift.

Point an unmodified agent (``openai.OpenAI(base_url=PROXY + "/v1")``) at the proxy. Each
``/v1/chat/completions`` call names its session with the ``X-Session-Id`` header or the ``user``
field. The proxy forwards the call token-in/token-out to the rollout servers' ``/generate`` and
records, per session, the exact prompt and completion token ids:

* the first call renders the messages with the chat template (``tools`` included);
* a later call whose messages extend the conversation the proxy already answered (same earlier
  messages, its own reply echoed back, then new tool/user messages) reuses the recorded ids and
  appends only the chat template's delta for the new messages, so the model's tokens are never
  re-tokenised (decode-then-encode is not reversible);
* a call that rewrites the history starts a new segment (rendered afresh).

Images: a message's content may hold OpenAI ``image_url`` parts with ``data:`` URLs (remote
URLs are refused with 400: the proxy fetches nothing). With the served model's vision processor
(``serve_proxy`` loads it for a vision model) the proxy renders their placeholders, expands
them as the server does, forwards the images of the whole context with each ``/generate``
(``multi_modal``) and records them with the session: the recorded trajectory's
``multi_modal`` (JSON: kinds, digests, token counts and the base64 images) holds one item per
placeholder run, in token order.

``GET /sessions/{id}/trajectory`` assembles the recorded ids into a training trajectory
(``prompt_ids``, ``response_ids``, ``response_mask``: 1 on model tokens, ``rollout_log_probs``),
``DELETE /sessions/{id}`` ends a session. Run it with ``polyrl agent-proxy --rollout URL``;
it binds 127.0.0.1 by default.

Access: with API keys set (``create_proxy_app(..., api_keys=...)``; ``polyrl agent-proxy``
takes ``--api-key`` or ``POLYRL_PROXY_API_KEY``, several comma-separated, and falls back to
the rollout server's own key), every endpoint but ``/health`` wants
``Authorization: Bearer <key>``, and sessions are scoped per key: a caller with one key can
neither continue, read nor end a session created with another. Generated session ids are
random (128 bits). Templates are rendered and text tokenized in a worker thread, so a long
conversation never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from polyrl.agent.base import (
    Trajectory,
    chat_delta_ids,
    render_prompt_ids,
    split_messages_media,
)
from polyrl.agent.tool_loop import HermesToolParser
from polyrl.core.http_guard import (
    DEFAULT_MAX_BODY_BYTES,
    BodyLimit,
    bearer_token,
    json_request_body,
    key_matches,
    parse_json,
)
from polyrl.core.multimodal import MultiModalInputError, MultiModalInputs
from polyrl.core.prompts import check_template_kwargs
from polyrl.core.rollout_api import InvalidRequestError, RolloutError, SamplingParams

__all__ = [
    "PROXY_API_KEY_ENV",
    "RecordingProxy",
    "create_proxy_app",
    "serve_proxy",
    "tokenizer_dir_from_server",
]

#: Environment variable with the proxy's own key(s), comma-separated.
PROXY_API_KEY_ENV = "POLYRL_PROXY_API_KEY"

SESSION_HEADER = "X-Session-Id"
_FIELDS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "n",
    "stream",
    "user",
    "parallel_tool_calls",
    "frequency_penalty",
    "presence_penalty",
    "logprobs",
    "top_logprobs",
}


class _ChatBody(BaseModel):
    """``POST /v1/chat/completions`` of the proxy (the OpenAI fields it reads or tolerates)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = None
    stream: bool | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def _image_url(part: Mapping[str, Any], where: str) -> str:
    """Return the ``data:`` URL of an ``image_url`` part (anything else is a 400)."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(
            f"{where}: an image_url part needs image_url.url (a data: URL)", param="messages"
        )
    if not url[:5].lower() == "data:":
        raise InvalidRequestError(
            f"{where}: only data: URLs are accepted (data:image/png;base64,...); the proxy "
            "does not fetch remote images",
            param="messages",
        )
    return url


def _content(content: Any, index: int) -> str | list[dict[str, Any]]:
    """Return a message's content for the chat template.

    Text (a string or text parts) becomes one string, as before images; content with
    ``image_url`` parts becomes parts: text parts and ``{"type": "image", "image": <data URL>}``
    (the form :func:`~polyrl.agent.base.split_media` reads).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image_url":
                url = _image_url(part, f"messages[{index}].content[{k}]")
                parts.append({"type": "image", "image": url})
            else:
                raise InvalidRequestError(
                    f"messages[{index}].content[{k}]: only text and image_url parts are supported",
                    param="messages",
                )
        if all(p["type"] == "text" for p in parts):
            return "".join(p["text"] for p in parts)
        return parts
    raise InvalidRequestError(
        f"messages[{index}].content must be a string, null or a list of text and image_url parts",
        param="messages",
    )


def _canonical_args(args: Any) -> str:
    if isinstance(args, str):
        try:
            args = parse_json(args) if args.strip() else {}
        except ValueError:  # not JSON (or too deep, huge numbers): compared as text
            return args
    return json.dumps(args, sort_keys=True)


def _clean_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate request messages and reduce them to what the chat template reads."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(
                f"messages[{i}] must be an object with a string 'role'", param="messages"
            )
        msg: dict[str, Any] = {"role": m["role"], "content": _content(m.get("content"), i)}
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls must be a list", param="messages"
                )
            msg["tool_calls"] = []
            for c in calls:
                fn = c.get("function", c) if isinstance(c, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                    raise InvalidRequestError(
                        f"messages[{i}].tool_calls entries need function.name", param="messages"
                    )
                msg["tool_calls"].append(
                    {
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": fn.get("arguments", {})},
                    }
                )
        out.append(msg)
    return out


def _key(msg: Mapping[str, Any]) -> tuple[Any, ...]:
    """Return what must match for two messages to be the same (ids, outer spaces aside)."""
    calls = tuple(
        (c["function"]["name"], _canonical_args(c["function"]["arguments"]))
        for c in msg.get("tool_calls") or ()
    )
    content = msg.get("content") or ""
    if isinstance(content, list):
        # An image is the same when its URL is: a re-encoded image starts a new segment.
        content = tuple(
            ("text", p["text"].strip())
            if p["type"] == "text"
            else ("image", hashlib.sha256(p["image"].encode()).hexdigest())
            for p in content
        )
    else:
        content = content.strip()
    return (msg["role"], content, calls)


@dataclasses.dataclass
class _Segment:
    """One contiguous token history of a session."""

    tools: Any
    messages: list[dict[str, Any]]
    traj: Trajectory
    last_eos: bool = True

    def to_json(self) -> dict[str, Any]:
        t = self.traj
        media = None
        if t.multi_modal is not None:
            media = {
                "kinds": list(t.multi_modal.kinds),
                "digests": list(t.multi_modal.digests),
                "token_counts": list(t.multi_modal.token_counts),
                **t.multi_modal.media_payload(),
            }
        messages, _ = split_messages_media(self.messages, require_data=False)
        return {
            "prompt_ids": t.prompt_ids,
            "response_ids": t.response_ids,
            "response_mask": t.response_mask,
            "rollout_log_probs": t.rollout_log_probs,
            "num_turns": t.num_turns,
            "finish_reason": t.finish_reason,
            "weight_versions": t.weight_versions,
            # The images are in multi_modal once; the messages keep their places.
            "messages": messages,
            "multi_modal": media,
        }


class RecordingProxy:
    """The proxy's state and logic (the HTTP layer is :func:`create_proxy_app`).

    Args:
        client: a started-on-demand :class:`~polyrl.rollout.client.RolloutClient` (or any
            object with its ``generate``, ``start`` and ``close``).
        tokenizer: the served model's tokenizer (chat template, eos).
        model_name: the ``model`` reported in responses.
        max_sessions: oldest sessions are forgotten beyond this many.
        apply_chat_template_kwargs: extra chat-template arguments for every prompt and delta
            the proxy renders (e.g. ``{"enable_thinking": False}``), as the trainer's dataset
            and agent loops use (``data.apply_chat_template_kwargs``).
        processor: the served model's vision processor (a
            :class:`~polyrl.models.processor.VisionProcessor`, or any object with its
            ``process_media`` and ``expand``); ``None``: ``image_url`` parts get 400.
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        *,
        model_name: str = "polyrl",
        max_sessions: int = 10000,
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        processor: Any = None,
    ):
        self.client = client
        self.tokenizer = tokenizer
        self.processor = processor
        self.apply_chat_template_kwargs = check_template_kwargs(apply_chat_template_kwargs)
        self.model_name = model_name
        self.max_sessions = max_sessions
        # (owner, session id) -> segments; the owner is who created it (see owner_of).
        self.sessions: OrderedDict[tuple[str, str], list[_Segment]] = OrderedDict()
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._parser = HermesToolParser()
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list | tuple) else [eos])

    def _params(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if body.get("stream"):
            raise InvalidRequestError("the recording proxy does not stream; set stream=false")
        if body.get("n", 1) != 1:
            raise InvalidRequestError("the recording proxy samples n=1 per call", param="n")
        stop = body.get("stop")
        params: dict[str, Any] = {"logprobs": True}
        for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")):
            if body.get(src) is not None:
                params[dst] = body[src]
        max_new = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_new is not None:
            params["max_new_tokens"] = max_new
        if stop is not None:
            params["stop"] = [stop] if isinstance(stop, str) else stop
        return SamplingParams.from_dict(params).to_dict()

    def _find_segment(
        self, segments: list[_Segment], messages: list[dict[str, Any]], tools: Any
    ) -> _Segment | None:
        keys = [_key(m) for m in messages]
        for seg in reversed(segments):
            n = len(seg.messages)
            if (
                seg.tools == tools
                and n < len(messages)
                and [_key(m) for m in seg.messages] == keys[:n]
            ):
                return seg
        return None

    def _media(
        self, ids: list[int], items: list[tuple[str, Any]]
    ) -> tuple[list[int], MultiModalInputs | None]:
        """Process a request's new images and expand their placeholders in ``ids``."""
        if not items:
            return ids, None
        if self.processor is None:
            raise InvalidRequestError(
                "this proxy serves a model without a vision processor; image_url parts are "
                "not accepted",
                param="messages",
            )
        images = [item for kind, item in items if kind == "image"]
        try:
            media = self.processor.process_media(images=images, what="messages")
            return list(self.processor.expand(ids, media)), media
        except MultiModalInputError as exc:
            raise InvalidRequestError(str(exc), param="messages") from None

    def _render(
        self, segments: list[_Segment], messages: list[dict[str, Any]], tools: Any
    ) -> tuple[_Segment, list[int], MultiModalInputs | None, bool]:
        """Find (or start) the segment ``messages`` continue.

        Returns ``(segment, new ids, their new media, is new)``; a new segment's prompt and
        media are in its trajectory. Runs in a worker thread: chat templates, the tokenizer
        and image processing are CPU work.
        """
        seg = self._find_segment(segments, messages, tools)
        # The template sees bare image parts; the data URLs are processed here, in order.
        template, _ = split_messages_media(messages)
        num_new = len(messages) - len(seg.messages) if seg is not None else len(messages)
        _, items = split_messages_media(messages[len(messages) - num_new :])
        try:
            if seg is not None:
                delta = chat_delta_ids(
                    self.tokenizer,
                    template,
                    num_new,
                    tools=tools,
                    last_ended_with_eos=seg.last_eos,
                    apply_chat_template_kwargs=self.apply_chat_template_kwargs,
                )
            else:
                prompt = render_prompt_ids(
                    self.tokenizer,
                    template,
                    tools=tools,
                    apply_chat_template_kwargs=self.apply_chat_template_kwargs,
                )
        except RolloutError:
            raise
        except Exception as exc:  # template errors are the request's fault
            raise InvalidRequestError(
                f"the chat template failed on these messages: {exc}", param="messages"
            ) from exc
        if seg is not None:
            delta, media = self._media(delta, items)
            return seg, delta, media, False
        prompt, media = self._media(prompt, items)
        # Not appended to the session yet: that waits until the rollout server answers.
        traj = Trajectory(prompt_ids=prompt, multi_modal=media)
        return _Segment(tools, [], traj), [], None, True

    async def chat(
        self, body: Any, session_id: str | None, owner: str = ""
    ) -> tuple[dict[str, Any], str]:
        """Answer one ``/v1/chat/completions`` body; return ``(response, session_id)``.

        Args:
            body: the request body.
            session_id: from the ``X-Session-Id`` header (else ``user``, else a new one).
            owner: who calls (:func:`owner_of` their key); sessions are per owner.

        Raises:
            InvalidRequestError: malformed request (HTTP 400).
        """
        if not isinstance(body, Mapping):
            raise InvalidRequestError("the request body must be a JSON object")
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise InvalidRequestError(
                f"unsupported fields {unknown} for the recording proxy", param=unknown[0]
            )
        try:
            _ChatBody.model_validate(body)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise InvalidRequestError(
                f"invalid /v1/chat/completions body: {where}: {err['msg']}",
                param=str(err["loc"][0]) if err["loc"] else None,
            ) from None
        sid = session_id or body.get("user") or f"session-{uuid.uuid4().hex}"
        if not isinstance(sid, str):
            raise InvalidRequestError(
                "the session id ('user' or X-Session-Id) must be a string", param="user"
            )
        key = (owner, sid)
        messages = _clean_messages(body.get("messages"))
        tools = body.get("tools") or None
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, Mapping) for t in tools)
        ):
            raise InvalidRequestError("tools must be a list of objects", param="tools")
        params = self._params(body)
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            segments = self.sessions.setdefault(key, [])
            self.sessions.move_to_end(key)
            while len(self.sessions) > self.max_sessions:
                old, _ = self.sessions.popitem(last=False)
                self._locks.pop(old, None)
            try:
                traj, out, result, reply = await self._call(sid, segments, messages, tools, params)
            except BaseException:
                if not segments and self.sessions.get(key) is segments:
                    del self.sessions[key]  # a session whose only call failed never was
                raise
        return self._response(
            reply, out, result, len(traj.prompt_ids) + len(traj.response_ids)
        ), sid

    async def _call(
        self,
        sid: str,
        segments: list[_Segment],
        messages: list[dict[str, Any]],
        tools: Any,
        params: dict[str, Any],
    ) -> tuple[Trajectory, Any, Any, dict[str, Any]]:
        """Generate the reply to ``messages`` and record it in ``segments``.

        Nothing is recorded unless the rollout server answers: a failed call leaves the session
        as it was (no new segment, no partial turn).
        """
        seg, delta, media, new_segment = await asyncio.to_thread(
            self._render, segments, messages, tools
        )
        traj = seg.traj
        # The server is sent the images of the whole context, in token order; a text-only
        # context sends none (text-only clients need not take the keyword).
        context = [m for m in (traj.multi_modal, media) if m is not None]
        extra = {"multi_modal": MultiModalInputs.concat(context)} if context else {}
        result = await self.client.generate(
            traj.prompt_ids + traj.response_ids + delta, params, session_id=sid, **extra
        )
        out = result.outputs[0]
        if new_segment:
            segments.append(seg)
        traj.append_env(delta, media)
        traj.append_model(out.output_ids, out.logprobs)
        traj.num_turns += 1
        traj.finish_reason = str(out.finish_reason or "")
        traj.weight_versions.append(int(out.weight_version or 0))
        seg.last_eos = bool(out.output_ids) and int(out.output_ids[-1]) in self.eos_ids
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        reply = self._reply(text, tools is not None)
        seg.messages = messages + [reply]
        return traj, out, result, reply

    def _reply(self, text: str, with_tools: bool) -> dict[str, Any]:
        calls = [c for c in self._parser.parse(text) if c.error is None] if with_tools else []
        if not calls:
            return {"role": "assistant", "content": text}
        content = text[: text.find("<tool_call>")].strip()
        return {
            "role": "assistant",
            "content": content or None,
            "tool_calls": [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in calls
            ],
        }

    def _response(self, reply: dict[str, Any], out: Any, result: Any, total: int) -> dict[str, Any]:
        finish = "tool_calls" if reply.get("tool_calls") else out.finish_reason
        completion = len(out.output_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}],
            "usage": {
                "prompt_tokens": total - completion,
                "completion_tokens": completion,
                "total_tokens": total,
            },
            "token_ids": list(out.output_ids),
            "weight_version": int(result.weight_version or 0),
        }

    def trajectory(self, session_id: str, owner: str = "") -> dict[str, Any]:
        """Return the assembled session: the latest segment's fields plus every segment.

        Raises:
            KeyError: unknown session (or one of another owner).
        """
        segments = self.sessions.get((owner, session_id))
        if not segments:
            raise KeyError(session_id)
        return {
            "session_id": session_id,
            **segments[-1].to_json(),
            "num_segments": len(segments),
            "segments": [s.to_json() for s in segments],
        }

    def trajectories(self, session_id: str, owner: str = "") -> list[Trajectory]:
        """Return the session's segments as :class:`Trajectory` objects (in-process use)."""
        return [s.traj for s in self.sessions.get((owner, session_id), [])]

    def end(self, session_id: str, owner: str = "") -> bool:
        """Forget a session of ``owner``; return whether it existed."""
        self._locks.pop((owner, session_id), None)
        return self.sessions.pop((owner, session_id), None) is not None


def owner_of(key: bytes | None) -> str:
    """Return the owner name of sessions created with ``key`` (``""`` without keys)."""
    return "" if key is None else hashlib.sha256(key).hexdigest()[:16]


def _error(status: int, message: str, kind: str, param: Any = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def create_proxy_app(
    proxy: RecordingProxy,
    api_keys: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Build the FastAPI app serving ``proxy``.

    Args:
        proxy: the state and logic.
        api_keys: keys accepted as ``Authorization: Bearer <key>`` on every endpoint but
            ``/health``; sessions are scoped per key. Empty: open (loopback use).
        max_body_bytes: larger request bodies get 413.
    """
    keys = [k.encode() for k in api_keys if k]

    def caller(request: Request) -> str | JSONResponse:
        """Return the caller's owner name, or the 401 to answer."""
        if not keys:
            return ""
        key = key_matches(bearer_token(request.scope["headers"]), keys)
        if key is None:
            return _error(
                401,
                "missing or invalid bearer token (send 'Authorization: Bearer <key>')",
                "authentication_error",
            )
        return owner_of(key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.client.start()
        try:
            yield
        finally:
            await proxy.client.close()

    app = FastAPI(title="polyrl agent proxy", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "sessions": len(proxy.sessions)}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        owner = caller(request)
        if isinstance(owner, JSONResponse):
            return owner
        return {
            "object": "list",
            "data": [{"id": proxy.model_name, "object": "model", "owned_by": "polyrl"}],
        }

    @app.post("/v1/chat/completions", openapi_extra=json_request_body(_ChatBody))
    async def chat(request: Request) -> Any:
        owner = caller(request)
        if isinstance(owner, JSONResponse):
            return owner
        try:
            body = parse_json(await request.body())
        except InvalidRequestError as exc:
            return _error(400, exc.message, exc.error_type)
        try:
            answer, sid = await proxy.chat(body, request.headers.get(SESSION_HEADER), owner)
        except RolloutError as exc:
            status = int(getattr(exc, "status", 500))
            return _error(status, str(exc), getattr(exc, "error_type", "server_error"), exc.param)
        return JSONResponse(answer, headers={SESSION_HEADER: sid})

    @app.get("/sessions/{session_id}/trajectory")
    async def trajectory(session_id: str, request: Request) -> Any:
        owner = caller(request)
        if isinstance(owner, JSONResponse):
            return owner
        try:
            return proxy.trajectory(session_id, owner)
        except KeyError:
            return _error(404, f"unknown session {session_id!r}", "not_found_error")

    @app.delete("/sessions/{session_id}")
    async def end(session_id: str, request: Request) -> Any:
        owner = caller(request)
        if isinstance(owner, JSONResponse):
            return owner
        if not proxy.end(session_id, owner):
            return _error(404, f"unknown session {session_id!r}", "not_found_error")
        return {"session_id": session_id, "ended": True}

    return app


def serve_proxy(
    client: Any,
    tokenizer_dir: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8100,
    model_name: str = "polyrl",
    ready_file: str | None = None,
    log_level: str = "warning",
    api_keys: Sequence[str] = (),
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Serve the recording proxy in front of ``client`` until SIGINT/SIGTERM.

    Args:
        client: the rollout client the proxy forwards to, not started yet (the app starts and
            closes it): a :class:`~polyrl.rollout.client.RolloutClient` over the replica (or
            router) URLs, built by whoever launches the proxy (``polyrl agent-proxy``).
        tokenizer_dir: local directory of the served model's tokenizer.
        host: address to bind (default: this machine only).
        port: port (0 picks a free one; see ``ready_file``).
        model_name: the ``model`` reported in responses.
        ready_file: where to write ``{"url", "pid"}`` once requests are accepted.
        log_level: uvicorn log level.
        api_keys: the keys callers must present (see :func:`create_proxy_app`).
        apply_chat_template_kwargs: extra chat-template arguments (see
            :class:`RecordingProxy`).
    """
    from polyrl.core.http import serve_app
    from polyrl.models.loader import load_tokenizer
    from polyrl.models.processor import load_vision_processor

    tokenizer = load_tokenizer(tokenizer_dir)
    proxy = RecordingProxy(
        client,
        tokenizer,
        model_name=model_name,
        apply_chat_template_kwargs=apply_chat_template_kwargs,
        # A vision model's proxy takes image_url parts; a text model's refuses them.
        processor=load_vision_processor(tokenizer_dir, tokenizer=tokenizer),
    )
    app = create_proxy_app(proxy, api_keys=api_keys)
    asyncio.run(serve_app(app, host, port, ready_file, log_level))


def tokenizer_dir_from_server(url: str, api_key: str | None = None) -> str:
    """Return the directory of the model a rollout server serves, when it is one here.

    ``polyrl serve`` (like vLLM) reports the model's directory as ``root`` in ``/v1/models``;
    a server and proxy on one host share it. An ``id`` that is a local directory does too.

    Raises:
        ValueError: the server cannot be reached, reports no model, or its model directory
            is not a directory on this machine.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=10)
        r.raise_for_status()
        card = r.json()["data"][0]
        model = str(card["id"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(
            f"cannot ask {url} for its model ({exc}); pass --tokenizer DIR explicitly"
        ) from exc
    root = card.get("root") if isinstance(card, dict) else None
    for candidate in (root, model):
        if isinstance(candidate, str) and candidate and os.path.isdir(candidate):
            return candidate
    where = f" from {root!r}" if root else ""
    raise ValueError(
        f"{url} serves {model!r}{where}, which is not a directory on this machine; pass "
        "--tokenizer DIR (a local copy of the model's tokenizer)"
    )
