"""The backend-agnostic rollout interface: requests, sampling parameters, outputs, backends.

Everything above a backend (the HTTP server, the router, the client, the agent loop) speaks in
these types only. A backend is an object satisfying :class:`RolloutBackend`; our own engine
(``native``) is one, and an engine running in another process (a ``vllm serve`` subprocess
spoken to over HTTP) is another: it implements the same async methods by forwarding them.
The types live in the core so that the agent loop and the trainer can speak to a rollout
server without importing the rollout service; backends are registered in
:mod:`polyrl.rollout.base`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from polyrl.core.registry import did_you_mean

if TYPE_CHECKING:  # torch-free at import: the client and the router use these types
    from polyrl.core.multimodal import MultiModalInputs

__all__ = [
    "FINISH_REASONS",
    "WEIGHT_RECEIVE_PATHS",
    "BackendStats",
    "DeltaStream",
    "EngineUnavailableError",
    "GenerateRequest",
    "InvalidRequestError",
    "OverloadedError",
    "RequestConflictError",
    "ModelInfo",
    "RequestOutput",
    "RolloutBackend",
    "RolloutError",
    "SampleDelta",
    "SampleOutput",
    "SamplingParams",
    "WeightReceive",
    "check_request_fits",
    "collect_outputs",
]

FinishReason = Literal["stop", "length", "abort"]
#: ``stop``: a stop token or string ended the sample; ``length``: ``max_new_tokens`` or the
#: context length was reached; ``abort``: ``/abort`` (or a client disconnect) ended it early.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")

WeightReceive = Literal["stream", "shared_arena", "safetensors_dir", "load_fn", "none"]
#: How a backend takes the weights pushed to its replica's ``/weights/*`` routes
#: (:attr:`RolloutBackend.weight_receive`; the routes are
#: :func:`polyrl.weights.server_routes.register_weight_routes`):
#:
#: * ``stream`` -- every chunk lands in place in the backend's ``engine``, which has
#:   ``begin_weight_update``, ``weight_destination``, ``commit_weight_update`` and
#:   ``abort_weight_update`` (the native engine);
#: * ``shared_arena`` -- the set is received into a shared-memory arena laid out like the
#:   checkpoint in ``model_dir``, handed to ``load_weights(pairs, version)`` at commit (vLLM);
#: * ``safetensors_dir`` -- the set is staged as a safetensors directory and loaded once at
#:   commit with ``update_weights(path, version)`` (vLLM with ``weight_load="disk"``, SGLang);
#: * ``load_fn`` -- the whole set, in temporaries, goes to ``load_weights(pairs, version)`` at
#:   commit;
#: * ``none`` -- the replica takes no pushed weights (no ``/weights/*`` routes).
WEIGHT_RECEIVE_PATHS: tuple[str, ...] = (
    "stream",
    "shared_arena",
    "safetensors_dir",
    "load_fn",
    "none",
)

#: Upper bounds that keep one request from monopolising a server.
MAX_N = 128
MAX_TOP_LOGPROBS = 20
#: Prompt log-probs may ask for more alternatives: a teacher's top-k distribution for
#: distillation (``prompt_logprobs=k``) is read once per prompt position, not streamed.
MAX_PROMPT_LOGPROBS = 128
MAX_STOP_STRINGS = 16


class RolloutError(Exception):
    """Base class of rollout errors; ``status`` is the HTTP status the server answers with."""

    status: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(RolloutError, ValueError):
    """The request is malformed or asks for something impossible (HTTP 400)."""

    status = 400
    error_type = "invalid_request_error"


class RequestConflictError(InvalidRequestError):
    """The request collides with one in flight, e.g. a reused ``request_id`` (HTTP 409)."""

    status = 409


class OverloadedError(RolloutError):
    """The server holds as much work as it accepts; retry later (HTTP 429)."""

    status = 429
    error_type = "rate_limit_error"


class EngineUnavailableError(RolloutError):
    """The engine cannot take requests now: asleep, weights discarded or shutting down (503)."""

    status = 503
    error_type = "service_unavailable"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one prompt; every field is checked on construction.

    Attributes:
        max_new_tokens: most tokens to generate per sample; ``None`` lets the server pick (the
            room left in the context for ``/generate`` and chat, 16 for completions).
        temperature: ``0`` is greedy; otherwise logits are divided by it before sampling.
        top_p: nucleus sampling mass in ``(0, 1]``.
        top_k: keep the ``k`` most likely tokens; ``-1`` (or ``0``) keeps all.
        min_p: drop tokens less likely than ``min_p`` times the most likely one, in ``[0, 1]``.
        repetition_penalty: > 0; values above 1 discourage tokens already in prompt or output.
        stop_token_ids: extra token ids that end a sample (eos always does unless
            ``ignore_eos``); the stop token is kept in ``output_ids``.
        stop: strings that end a sample once the decoded output contains them.
        ignore_eos: keep generating through eos (benchmarks, fixed-length rollouts).
        n: samples per prompt.
        seed: per-request seed; the same seed gives the same tokens whatever else is batched.
        logprobs: return the log-probability of every sampled token.
        top_logprobs: also return the ``k`` most likely alternatives per position (0..20).
        return_routed_experts: MoE models: also return the experts each token was routed to
            (``SampleOutput.routed_experts``), for routing replay in the trainer.
        prompt_logprobs: ``None`` (off), or score the prompt: the log-probability of each
            prompt token given the tokens before it (``RequestOutput.prompt_logprobs``), and
            with ``k > 0`` also its ``k`` most likely alternatives (``prompt_top_logprobs``),
            under ``log_softmax(logits / T)`` like ``logprobs`` (0..128). A teacher scores a
            student's sample this way (the sample as the prompt, ``max_new_tokens=1``).
    """

    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    return_routed_experts: bool = False
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> InvalidRequestError:
            value = getattr(self, name)
            return InvalidRequestError(
                f"invalid sampling parameter {name}={value!r}: expected {expected}", param=name
            )

        if self.max_new_tokens is not None and (
            not _is_int(self.max_new_tokens) or self.max_new_tokens < 1
        ):
            raise bad("max_new_tokens", "an int >= 1 (or null for the server default)")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a number >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an int >= 1, or -1 / 0 to disable")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 disables it)")
        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of token ids (ints >= 0)")
        if (
            not isinstance(self.stop, tuple)
            or not all(isinstance(s, str) and s for s in self.stop)
            or len(self.stop) > MAX_STOP_STRINGS
        ):
            raise bad("stop", f"a list of at most {MAX_STOP_STRINGS} non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "true or false")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an int in [1, {MAX_N}]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad("seed", "an int in [0, 2**63) or null")
        if not isinstance(self.logprobs, bool):
            raise bad("logprobs", "true or false")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad("top_logprobs", f"an int in [0, {MAX_TOP_LOGPROBS}]")
        if not isinstance(self.return_routed_experts, bool):
            raise bad("return_routed_experts", "true or false")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs)
            or not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"null (off) or an int in [0, {MAX_PROMPT_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        """Whether sampling is greedy (temperature 0)."""
        return self.temperature == 0

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """Names accepted by :meth:`from_dict`."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> SamplingParams:
        """Build from a JSON object; bad keys or types raise :class:`InvalidRequestError`.

        Lists are accepted for ``stop_token_ids`` and ``stop`` (a single string is one stop
        string); ``None`` values mean "default".
        """
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise InvalidRequestError(
                f"sampling_params must be a JSON object, got {type(data).__name__}",
                param="sampling_params",
            )
        names = cls.field_names()
        unknown = [k for k in data if k not in names]
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter {unknown[0]!r}{did_you_mean(unknown[0], names)} "
                f"(accepted: {', '.join(names)})",
                param=str(unknown[0]),
            )
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if value is None and key not in ("max_new_tokens", "seed", "prompt_logprobs"):
                continue
            if key == "stop" and isinstance(value, str):
                value = (value,)
            if key in ("stop", "stop_token_ids"):
                if not isinstance(value, list | tuple):
                    raise InvalidRequestError(
                        f"invalid sampling parameter {key}={value!r}: expected a list",
                        param=key,
                    )
                value = tuple(value)
            kwargs[key] = value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["stop"] = list(self.stop)
        # The defaults of the newer fields stay out of the wire format (other backends' bodies).
        if not self.return_routed_experts:
            del out["return_routed_experts"]
        if self.prompt_logprobs is None:
            del out["prompt_logprobs"]
        return out


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """One prompt (as token ids) and how to sample it.

    Attributes:
        request_id: unique among in-flight requests of one backend; used by ``abort``.
        prompt_ids: the prompt's token ids.
        params: sampling parameters (``n`` samples come back under one request).
        multi_modal: the prompt's processed images and videos (vision models only); then
            ``prompt_ids`` hold the *expanded* placeholder runs, one token per image token.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    multi_modal: MultiModalInputs | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id must be a non-empty string", param="request_id")
        if not isinstance(self.prompt_ids, tuple) or not self.prompt_ids:
            raise InvalidRequestError(
                "prompt must hold at least one token id", param="input_ids", code="empty_prompt"
            )
        for pos, tok in enumerate(self.prompt_ids):
            if not _is_int(tok):
                raise InvalidRequestError(
                    f"prompt token at position {pos} is {tok!r}; expected an int token id",
                    param="input_ids",
                )


def check_request_fits(request: GenerateRequest, vocab_size: int, max_model_len: int) -> int:
    """Check a request's token ids and length against a model; return its ``max_new_tokens``.

    Shared by every backend so that the same bad input gets the same 400 everywhere.

    Raises:
        InvalidRequestError: unknown prompt or stop token id, or a prompt that leaves no room
            (or not ``max_new_tokens`` of room) in the context length.
    """
    prompt = request.prompt_ids
    for pos, tok in enumerate(prompt):
        if not 0 <= tok < vocab_size:
            raise InvalidRequestError(
                f"unknown token id {tok} at prompt position {pos}: "
                f"expected ids in [0, {vocab_size})",
                param="input_ids",
                code="invalid_token_id",
            )
    for tok in request.params.stop_token_ids:
        if tok >= vocab_size:
            raise InvalidRequestError(
                f"unknown stop token id {tok}: expected ids in [0, {vocab_size})",
                param="stop_token_ids",
                code="invalid_token_id",
            )
    n_prompt = len(prompt)
    room = max_model_len - n_prompt
    if room < 1:
        raise InvalidRequestError(
            f"prompt has {n_prompt} tokens; the context length (max_model_len) is "
            f"{max_model_len}, leaving no room to generate",
            param="input_ids",
            code="context_length_exceeded",
        )
    max_new = request.params.max_new_tokens
    if max_new is None:
        return room
    if max_new > room:
        raise InvalidRequestError(
            f"prompt has {n_prompt} tokens and max_new_tokens is {max_new}: "
            f"{n_prompt + max_new} exceeds the context length (max_model_len) "
            f"{max_model_len}",
            param="max_new_tokens",
            code="context_length_exceeded",
        )
    return max_new


@dataclasses.dataclass
class SampleDelta:
    """New tokens of one sample since the previous delta (what streaming delivers).

    ``finish_reason`` is set on the last delta of the sample, which may carry no tokens.
    ``top_logprobs`` holds, per new token, a list of ``(token_id, logprob)`` alternatives.
    ``routed_experts`` (on the last delta, when asked) is the whole sample's, as in
    :class:`SampleOutput`. ``prompt_logprobs`` / ``prompt_top_logprobs`` (when asked) are the
    request's, as in :class:`RequestOutput`, carried once, by a delta of sample 0.
    """

    index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_version: int = 0
    first_weight_version: int | None = None
    cached_prompt_tokens: int = 0
    routed_experts: list[list[list[int]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


class DeltaStream:
    """Async iterator over one request's deltas, fed through :attr:`inbox` by a backend.

    The backend puts lists of :class:`SampleDelta` (or an exception) into ``inbox``; the stream
    ends once all ``n`` samples have finished. Closing it early (or cancelling the reader)
    calls ``cancel`` when some sample is still running, so an abandoned request never keeps
    decoding.

    Args:
        n: number of samples of the request.
        cancel: aborts the request; whatever it returns is awaited when awaitable.
        wrap_error: turns an exception from the backend into the one the reader sees.
        inbox: the queue the backend feeds (default: a new one).
    """

    def __init__(
        self,
        n: int,
        cancel: Callable[[], Awaitable[Any] | Any],
        wrap_error: Callable[[BaseException], BaseException] = lambda exc: exc,
        inbox: asyncio.Queue[list[SampleDelta] | BaseException] | None = None,
    ):
        self.inbox: asyncio.Queue[list[SampleDelta] | BaseException] = (
            asyncio.Queue() if inbox is None else inbox
        )
        self.left = n
        self._cancel = cancel
        self._wrap_error = wrap_error
        self._pending: deque[SampleDelta] = deque()
        self._closed = False

    def __aiter__(self) -> DeltaStream:
        return self

    async def __anext__(self) -> SampleDelta:
        while not self._pending:
            if self.left == 0 or self._closed:
                raise StopAsyncIteration
            try:
                payload = await self.inbox.get()
            except asyncio.CancelledError:
                await self.aclose()
                raise
            if isinstance(payload, BaseException):
                self.left = 0
                raise self._wrap_error(payload)
            self._pending.extend(payload)
        delta = self._pending.popleft()
        if delta.finish_reason is not None:
            self.left -= 1
        return delta

    async def aclose(self) -> None:
        """Stop reading; cancel the request if some sample is still running."""
        if self._closed:
            return
        self._closed = True
        if self.left:
            result = self._cancel()
            if inspect.isawaitable(result):
                await result


@dataclasses.dataclass
class SampleOutput:
    """One finished sample.

    Attributes:
        index: sample number in ``[0, n)``.
        output_ids: generated token ids (a stop token that ended the sample is included).
        logprobs: log-probability of each output token under ``log_softmax(logits / T)`` in
            fp32 (``T`` = 1 for greedy), as the model engine computes it; ``None`` unless asked.
        top_logprobs: per output token, the most likely alternatives as ``(id, logprob)``.
        finish_reason: one of :data:`FINISH_REASONS`.
        stop_reason: the stop token id or stop string that matched, if any.
        weight_version: weight version that produced the last token.
        first_weight_version: weight version that produced the first token (differs from
            ``weight_version`` when an update landed mid-sample).
        cached_prompt_tokens: prompt tokens served from the prefix cache.
        routed_experts: MoE models, when asked (``return_routed_experts``): per token of prompt
            plus output, per MoE layer, the ``k`` expert ids the token was routed to as the
            model's input; ``-1`` rows for tokens not computed (prompt tokens from the prefix
            cache, the last output token). ``None`` otherwise (and left out of
            :meth:`to_dict`).
    """

    index: int
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_version: int = 0
    first_weight_version: int | None = None
    cached_prompt_tokens: int = 0
    routed_experts: list[list[list[int]]] | None = None

    def add(self, delta: SampleDelta) -> None:
        """Append a delta of the same sample."""
        if self.first_weight_version is None:
            self.first_weight_version = delta.first_weight_version
        self.output_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        if delta.top_logprobs is not None:
            if self.top_logprobs is None:
                self.top_logprobs = []
            self.top_logprobs.extend(delta.top_logprobs)
        self.weight_version = delta.weight_version
        self.cached_prompt_tokens = max(self.cached_prompt_tokens, delta.cached_prompt_tokens)
        if delta.routed_experts is not None:
            self.routed_experts = delta.routed_experts
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        out = dataclasses.asdict(self)
        if self.top_logprobs is not None:
            out["top_logprobs"] = [[list(p) for p in pos] for pos in self.top_logprobs]
        if self.routed_experts is None:
            del out["routed_experts"]
        return out


@dataclasses.dataclass
class RequestOutput:
    """All samples of one finished request.

    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` asked): per prompt position,
    the log-probability of that prompt token given the tokens before it; ``None`` at position 0
    (nothing predicts it). ``prompt_top_logprobs`` (with ``prompt_logprobs=k > 0``): per
    position, the ``k`` most likely tokens there as ``(id, logprob)``, best first (empty at 0).
    """

    request_id: str
    prompt_ids: list[int]
    outputs: list[SampleOutput]
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def weight_version(self) -> int:
        """The newest weight version among the samples."""
        return max((o.weight_version for o in self.outputs), default=0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (the ``/generate`` response body for one prompt)."""
        completion = sum(len(o.output_ids) for o in self.outputs)
        out: dict[str, Any] = {
            "request_id": self.request_id,
            "outputs": [o.to_dict() for o in self.outputs],
            "weight_version": self.weight_version,
            "usage": {
                "prompt_tokens": len(self.prompt_ids),
                "completion_tokens": completion,
                "cached_prompt_tokens": max(
                    (o.cached_prompt_tokens for o in self.outputs), default=0
                ),
            },
        }
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs
        if self.prompt_top_logprobs is not None:
            out["prompt_top_logprobs"] = [
                [list(p) for p in pos] for pos in self.prompt_top_logprobs
            ]
        return out


async def collect_outputs(
    request: GenerateRequest, deltas: AsyncIterator[SampleDelta]
) -> RequestOutput:
    """Drain a backend's delta stream into a :class:`RequestOutput`."""
    samples = [SampleOutput(index=i) for i in range(request.params.n)]
    out = RequestOutput(request.request_id, list(request.prompt_ids), samples)
    async for delta in deltas:
        samples[delta.index].add(delta)
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if delta.prompt_top_logprobs is not None:
            out.prompt_top_logprobs = delta.prompt_top_logprobs
    for s in samples:
        if request.params.logprobs and s.logprobs is None:
            s.logprobs = []
    return out


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What a client needs to know about the served model."""

    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    backend: str


@dataclasses.dataclass
class BackendStats:
    """A snapshot of a backend's counters and gauges (what ``/metrics`` exports)."""

    running: int = 0
    waiting: int = 0
    paused: bool = False
    sleeping: bool = False
    weight_version: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    generated_tokens_per_s: float = 0.0
    kv_cache_blocks_total: int = 0
    kv_cache_blocks_used: int = 0
    kv_cache_bytes: int = 0
    weight_bytes: int = 0
    prefix_cache_hit_tokens_total: int = 0
    preemptions_total: int = 0
    steps_total: int = 0
    finished_total: dict[str, int] = dataclasses.field(default_factory=dict)
    ttft_seconds_sum: float = 0.0
    ttft_count: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV-cache blocks held by requests, in ``[0, 1]``."""
        if not self.kv_cache_blocks_total:
            return 0.0
        return self.kv_cache_blocks_used / self.kv_cache_blocks_total


@runtime_checkable
class RolloutBackend(Protocol):
    """An inference engine the rollout server can front.

    All methods are called from the server's event loop. ``await generate(request)`` returns
    an iterator of :class:`SampleDelta` objects for the ``n`` samples of a request, until each
    has a ``finish_reason``; closing the iterator early aborts the request.
    """

    @property
    def info(self) -> ModelInfo:
        """The served model."""
        ...

    @property
    def weight_version(self) -> int:
        """Version of the weights now in use."""
        ...

    @property
    def weight_receive(self) -> WeightReceive:
        """How pushed weights reach this backend; one of :data:`WEIGHT_RECEIVE_PATHS`.

        A class attribute does; the replica's weight routes pick their receive path from it.
        """
        ...

    async def start(self) -> None:
        """Start the engine (load the model, spawn its loop)."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine; in-flight requests end with ``abort``."""
        ...

    async def generate(
        self, request: GenerateRequest, stream: bool = True
    ) -> AsyncIterator[SampleDelta]:
        """Submit ``request`` and return the stream of its deltas.

        Raises :class:`InvalidRequestError` (or :class:`EngineUnavailableError`) here, before
        anything runs. The returned iterator must be closed (``aclose``); closing it before
        every sample finished aborts the request. With ``stream=False`` a backend may deliver
        each sample in one piece when it finishes.
        """
        ...

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """End in-flight requests (all when ``None``) with ``abort``; returns how many."""
        ...

    async def pause(self) -> None:
        """Stop stepping after the current step; requests stay in flight."""
        ...

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        ...

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Release KV-cache memory (level 1) and also discard weights (level 2)."""
        ...

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Restore what :meth:`sleep` released (``tags`` picks ``weights``/``kv_cache``)."""
        ...

    async def update_weights(self, path: str, version: int | None = None) -> int:
        """Load weights from a safetensors directory, switch atomically, return the version."""
        ...

    def stats(self) -> BackendStats:
        """Return current counters and gauges."""
        ...
