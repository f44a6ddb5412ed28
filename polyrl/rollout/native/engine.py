"""The native rollout engine: a background thread stepping a continuous batch.

:class:`NativeEngine` ties the pieces together: the :class:`~.scheduler.Scheduler` picks what
runs, :meth:`_build_inputs` packs it (decode tokens first, then prefill chunks) for the paged
attention of :mod:`.attention`, the :class:`~.runner.ModelRunner` runs the HF model once, and the
:class:`~.sampler.Sampler` draws one token per finished chunk. Weight updates (versions,
staging, streamed begin/commit/abort) belong to the :class:`~.weight_update.WeightUpdater` the
engine holds; its weight methods delegate to it.

Threading: one engine thread owns the model, the KV cache and every sequence. Other threads talk
to it through a command queue that is drained *between* steps, which is what makes ``pause``,
``abort``, weight switches and sleep atomic with respect to decoding. Results leave through
``sink`` callbacks, batched per step (see :meth:`NativeEngine.submit`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from polyrl.core.dtypes import resolve_dtype
from polyrl.core.rollout_api import (
    BackendStats,
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    RequestConflictError,
    SampleDelta,
    check_request_fits,
)
from polyrl.models.loader import load_tokenizer
from polyrl.rollout.native import cpu_kernels
from polyrl.rollout.native.attention import AttentionGroup, StepMetadata
from polyrl.rollout.native.kv_cache import BlockAllocator, PagedKVCache
from polyrl.rollout.native.media import MediaItem, SeqMedia, build_seq_media
from polyrl.rollout.native.runner import ModelRunner, StepInputs
from polyrl.rollout.native.sampler import Sampler, SamplingRow
from polyrl.rollout.native.scheduler import Chunk, Scheduler, SeqStatus
from polyrl.rollout.native.scheduler import Sequence as Seq
from polyrl.rollout.native.weight_update import EngineHooks, WeightUpdater

__all__ = ["NativeEngine", "NativeEngineConfig", "Sink"]

logger = logging.getLogger(__name__)

Sink = Callable[["list[SampleDelta] | BaseException"], None]
"""Receives a request's deltas (a list per step) or the exception that ended it."""

Deliver = Callable[[list[tuple[Sink, Any]]], None]
"""Hands a step's ``(sink, payload)`` pairs over to whoever runs the sinks."""

_TPS_WINDOW_S = 5.0


def _deliver_inline(items: list[tuple[Sink, Any]]) -> None:
    for sink, payload in items:
        sink(payload)


def _in_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a new thread that ends with it; return its result or raise its error.

    Used for torch work off the engine thread (loading the model, allocating the cache).
    libgomp keeps a team of worker threads for every thread that ran a parallel region, until
    that thread exits, and once it manages more threads than there are CPUs its idle workers
    stop spinning after ~100 iterations instead of ~300000: each of a decode step's ~60
    parallel regions (every matmul) then waits for the engine thread's workers to be woken
    from a futex. A caller's team would outlive the call (the server builds the engine in a
    pooled asyncio worker thread); a fresh thread's team goes when the thread ends.
    """
    # Leaving the block joins the pool's one worker thread, so its team goes with it.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="polyrl-engine-setup") as pool:
        return pool.submit(fn, *args).result()


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


@dataclasses.dataclass
class NativeEngineConfig:
    """Settings of the native engine.

    Attributes:
        dtype: parameter and KV-cache dtype (``float32``, ``bfloat16``, ``float16``).
        device: ``cpu`` or ``cuda[:i]``.
        max_num_seqs: most sequences decoding at once.
        max_num_batched_tokens: most tokens per step (prefill chunks included).
        kv_cache_tokens: KV-cache token budget (rounded up to whole blocks).
        block_size: tokens per KV block.
        max_model_len: longest prompt + output; default: the model's
            ``max_position_embeddings``, capped by ``kv_cache_tokens``.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        seed: seed of the generator shared by requests without a seed.
        num_threads: torch intra-op threads (``None`` leaves torch's default).
        trust_remote_code: allow modelling code shipped with the model.
        served_model_name: model name reported to clients (default: the directory name).
        cpu_kernels: on CPU with float32, attend decode tokens with the compiled C kernel of
            :mod:`.cpu_kernels` (built with the system compiler on first use; the torch path
            is used when it cannot be built).
        fast_forward: run Llama/Qwen2/Qwen3-family models through the engine's own packed
            forward (:mod:`.fast_forward`, same weights, fewer ops); other models, and this
            flag off, use the HF module forward.
        matmul_dtype: dtype of the decoder layers' projection matmuls in the fast forward
            (``None``: ``dtype``). ``bfloat16`` over ``float32`` weights runs them on bf16
            copies refreshed at every weight change, while norms, attention, the KV cache and
            the LM head stay float32 (and keep the C kernels): faster decoding on CPUs with
            AVX512-BF16, at bf16 rounding of the projections. Ignored (with a warning) where the
            HF forward serves the model.
        vision_cache_bytes: bound on the image/video embeddings kept (vision models), so the
            samples of a prompt and repeated prompts run the vision tower once per item.
    """

    dtype: str = "float32"
    device: str = "cpu"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_cache_tokens: int = 131072
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None
    trust_remote_code: bool = False
    served_model_name: str | None = None
    cpu_kernels: bool = True
    fast_forward: bool = True
    matmul_dtype: str | None = None
    vision_cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("kv_cache_tokens", self.kv_cache_tokens, 1)
        _check_int("block_size", self.block_size, 1)
        _check_int("seed", self.seed, 0)
        _check_int("vision_cache_bytes", self.vision_cache_bytes, 0)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1)
        if self.matmul_dtype is not None:
            try:
                resolve_dtype(self.matmul_dtype)
            except ValueError as exc:
                raise ValueError(f"matmul_dtype: {exc}") from None
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode "
                "in each step"
            )


@dataclasses.dataclass(eq=False)
class _Group:
    """The sequences of one request."""

    request: GenerateRequest
    seqs: list[Seq]
    sink: Sink
    stream: bool
    arrival: float
    unfinished: int
    first_token_time: float | None = None


class NativeEngine:
    """Continuous-batching inference over a paged KV cache for any HF causal LM.

    Args:
        model_dir: local HF model directory.
        config: engine settings.
        deliver: how sink calls leave the engine thread; the default calls each sink directly
            on the engine thread. The async backend passes one that hops to its event loop
            once per step.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        config: NativeEngineConfig | None = None,
        deliver: Deliver | None = None,
    ):
        self.config = config = config or NativeEngineConfig()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        # Intra-op threads of the engine thread, which sets them itself (see _loop).
        self._num_threads = config.num_threads or torch.get_num_threads()
        _in_fresh_thread(self._setup, model_dir, deliver)

    def _setup(self, model_dir: str | os.PathLike[str], deliver: Deliver | None) -> None:
        config = self.config
        self.model_dir = str(model_dir)
        self.tokenizer = load_tokenizer(model_dir, trust_remote_code=config.trust_remote_code)
        self.runner = ModelRunner(model_dir, config.dtype, config.device, config.trust_remote_code)
        self.runner.embedding_cache.max_bytes = config.vision_cache_bytes
        fast = self.runner.enable_fast_forward(config.fast_forward, config.matmul_dtype)
        matmul = config.matmul_dtype
        if not fast and matmul is not None and resolve_dtype(matmul) != self.runner.dtype:
            logger.warning(
                "matmul_dtype=%s is ignored: the HF forward serves %s (fast_forward=%s)",
                config.matmul_dtype,
                getattr(self.runner.config, "model_type", "this model"),
                config.fast_forward,
            )
        bs = config.block_size
        num_blocks = -(-config.kv_cache_tokens // bs)
        self.kv_capacity = num_blocks * bs
        model_max = int(getattr(self.runner.config, "max_position_embeddings", 0) or 0)
        max_len = config.max_model_len or model_max or self.kv_capacity
        self.max_model_len = min(max_len, self.kv_capacity)
        self.allocator = BlockAllocator(num_blocks, bs, config.enable_prefix_caching)
        self.cache = PagedKVCache(
            self.runner.num_layers,
            num_blocks,
            bs,
            self.runner.num_kv_heads,
            self.runner.head_dim,
            self.runner.dtype,
            self.runner.device,
        )
        self.sampler = Sampler(
            self.runner.device,
            config.seed,
            use_kernels=config.cpu_kernels,
            suppressed_ids=self.runner.media_token_ids,
        )
        self._use_kernel = (
            config.cpu_kernels
            and self.runner.device.type == "cpu"
            and self.runner.dtype == torch.float32
            and cpu_kernels.available()
        )
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            on_preempt=self._on_preempt,
        )
        self.eos_token_ids = self._eos_ids()
        self.vocab_size = self.runner.vocab_size
        self.info = ModelInfo(
            model=config.served_model_name or os.path.basename(os.path.normpath(self.model_dir)),
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(sorted(self.eos_token_ids)),
            backend="native",
        )
        self._deliver: Deliver = deliver or _deliver_inline
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._active_ids: set[str] = set()
        self._groups: dict[str, _Group] = {}
        self._outbox: list[tuple[Sink, Any]] = []
        self._next_seq_id = 0
        self._paused = False
        self._kv_released = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.weight_updater = WeightUpdater(
            self.runner,
            EngineHooks(
                between_steps=self._command,
                is_paused=lambda: self._paused,
                set_paused=self._set_paused,
                abort_requests=lambda: self._abort_groups(self._groups.values()),
                reset_prefix_cache=self.allocator.reset_prefix_cache,
            ),
        )
        self._stats = BackendStats(kv_cache_blocks_total=num_blocks)
        self._tps_window: deque[tuple[float, int]] = deque()
        self._tps_lock = threading.Lock()

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.runner.config, getattr(self.runner.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list | tuple):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ------------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="polyrl-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Abort everything in flight and stop the engine thread."""
        if self._thread is None:
            return
        try:
            self.abort().result(timeout=30)
        except (concurrent.futures.TimeoutError, RuntimeError):
            logger.warning("engine did not abort in-flight requests within 30 s")
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._thread = None

    @property
    def paused(self) -> bool:
        """Whether stepping is paused."""
        return self._paused

    @property
    def sleeping(self) -> bool:
        """Whether KV cache or weights are released."""
        return self._kv_released or self.runner.weights_discarded or self.runner.offloaded

    # --------------------------------------------------------------------------- requests

    def validate(self, request: GenerateRequest) -> int:
        """Check a request against the model and budgets; return its ``max_new_tokens``.

        Raises:
            InvalidRequestError: prompt too long, unknown token id, bad stop token id.
            EngineUnavailableError: the engine is asleep or has no weights.
        """
        if self._kv_released:
            raise EngineUnavailableError(
                "the engine is asleep (KV cache released); call /wake_up first"
            )
        self.weight_updater.check_serving()
        max_new = check_request_fits(request, self.vocab_size, self.max_model_len)
        if request.multi_modal is not None and not self.runner.vision:
            raise InvalidRequestError(
                f"the served model ({self.info.model}) takes no images or videos",
                param="multi_modal",
                code="images_not_supported",
            )
        return max_new

    def _media(self, request: GenerateRequest) -> SeqMedia | None:
        mm = request.multi_modal
        if mm is None or not len(mm):
            if self.runner.vision:
                # Placeholder tokens with no media would read the placeholder's text embedding.
                found = set(request.prompt_ids) & set(self.runner.token_ids().values())
                if found:
                    raise InvalidRequestError(
                        "the prompt has image/video placeholder tokens but no images or videos "
                        "were given",
                        param="multi_modal",
                    )
            return None
        return build_seq_media(list(request.prompt_ids), mm, self.runner.family)

    def submit(self, request: GenerateRequest, sink: Sink, stream: bool = True) -> None:
        """Queue a request; its deltas go to ``sink`` until every sample has finished.

        With ``stream`` the sink gets each step's new tokens; without it, one delta per sample
        when that sample finishes. A sink may also receive the exception that failed the
        request (then nothing follows).

        Raises:
            InvalidRequestError: see :meth:`validate`; or ``request_id`` already in flight.
            EngineUnavailableError: see :meth:`validate`.
        """
        max_new = self.validate(request)
        media = self._media(request)
        with self._lock:
            if self._stopping:
                raise EngineUnavailableError("the engine is shutting down")
            if request.request_id in self._active_ids:
                raise RequestConflictError(
                    f"request_id {request.request_id!r} is already in flight",
                    param="request_id",
                    code="duplicate_request_id",
                )
            self._active_ids.add(request.request_id)
        self._command(lambda: self._add_or_fail(request, sink, stream, max_new, media))

    def _add_or_fail(
        self,
        request: GenerateRequest,
        sink: Sink,
        stream: bool,
        max_new: int,
        media: SeqMedia | None = None,
    ) -> None:
        try:
            self._add(request, sink, stream, max_new, media)
        except Exception as exc:  # the request fails; the engine goes on
            logger.exception("could not queue request %s", request.request_id)
            group = self._groups.pop(request.request_id, None)
            for seq in group.seqs if group is not None else []:
                self.scheduler.remove(seq)
            with self._lock:
                self._active_ids.discard(request.request_id)
            self._outbox.append((sink, exc))

    def _add(
        self,
        request: GenerateRequest,
        sink: Sink,
        stream: bool,
        max_new: int,
        media: SeqMedia | None = None,
    ) -> None:
        params = request.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        if media is not None:
            # Encode the images now, between steps: a tower failure then fails this request
            # only, and the forward finds every item cached.
            for item in media.items:
                self.runner.embedding_cache.get(item, self.runner.encode_item)
        group = _Group(request, [], sink, stream, time.perf_counter(), params.n)
        prompt = list(request.prompt_ids)
        for i in range(params.n):
            if params.seed is None or params.greedy:
                seed = None
            else:
                # Sample i of a seeded request gets its own stream derived from (seed, i).
                seed = (params.seed + 0x9E3779B97F4A7C15 * i) % 2**63
            row = SamplingRow(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                min_p=params.min_p,
                repetition_penalty=params.repetition_penalty,
                seed=seed,
                logprobs=params.logprobs,
                top_logprobs=params.top_logprobs,
            )
            seq = Seq(self._next_seq_id, group, i, prompt, params, max_new, row)
            self._next_seq_id += 1
            seq.stop_ids = frozenset(stop_ids)
            seq.media = media
            if params.return_routed_experts and self.runner.routes is not None:
                seq.routes = self.runner.routes.new_log(len(prompt) + max_new)
            if params.repetition_penalty != 1.0:
                row.seen_tokens = seq.tokens
            if i == 0 and params.prompt_logprobs is not None:
                # Position 0 has no prediction; the rest are filled as the prompt runs.
                seq.prompt_scores = [None] * len(prompt)
                seq.prompt_top = [[] for _ in prompt] if params.prompt_logprobs else None
            if i > 0:
                seq.leader = group.seqs[0]
            group.seqs.append(seq)
            self.scheduler.add(seq)
        self._groups[request.request_id] = group
        self._stats.prompt_tokens_total += len(prompt)

    def abort(self, request_ids: Sequence[str] | None = None) -> concurrent.futures.Future[int]:
        """End requests (all when ``None``) with ``abort``; the future gives how many."""
        ids = None if request_ids is None else list(request_ids)

        def run() -> int:
            if ids is None:
                return self._abort_groups(self._groups.values())
            return self._abort_groups([self._groups[i] for i in ids if i in self._groups])

        return self._command(run)

    def _abort_groups(self, groups: Iterable[_Group]) -> int:
        """End every unfinished sample of ``groups`` with ``abort``; return how many groups."""
        groups = list(groups)  # finishing a request removes it from self._groups
        for group in groups:
            for seq in group.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self._finish(seq, "abort", None)
        return len(groups)

    def pause(self) -> concurrent.futures.Future[None]:
        """Stop stepping; resolves once no step is running. Requests stay in flight."""
        return self._command(lambda: self._set_paused(True))

    def resume(self) -> concurrent.futures.Future[None]:
        """Resume stepping after :meth:`pause`."""
        return self._command(lambda: self._set_paused(False))

    def _set_paused(self, paused: bool) -> None:
        self._paused = paused

    # ---------------------------------------------------------------------------- weights
    # The protocol lives in :class:`WeightUpdater` (``self.weight_updater``); these delegate.

    @property
    def weight_version(self) -> int:
        """Version of the weights in use; see :class:`WeightUpdater`."""
        return self.weight_updater.version

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        partial: bool = False,
    ) -> int:
        """Stage new weights and switch to them; see :meth:`WeightUpdater.load`."""
        return self.weight_updater.load(named_tensors, version, partial)

    def update_weights_from_dir(
        self, path: str | os.PathLike[str], version: int | None = None
    ) -> int:
        """Load a HF model directory's weights and switch; see :meth:`WeightUpdater.load_dir`."""
        return self.weight_updater.load_dir(path, version)

    def begin_weight_update(
        self, transfer_id: str, mode: str = "staged", inflight: str = "keep"
    ) -> None:
        """Start a streamed update; see :meth:`WeightUpdater.begin`."""
        self.weight_updater.begin(transfer_id, mode, inflight)

    def weight_destination(self, transfer_id: str, name: str) -> torch.Tensor:
        """Where parameter ``name`` goes; see :meth:`WeightUpdater.destination`."""
        return self.weight_updater.destination(transfer_id, name)

    def shared_weight_destinations(self, transfer_id: str) -> dict[str, Any] | None:
        """Offer the shadows as a shared arena; see :meth:`WeightUpdater.shared_destinations`."""
        return self.weight_updater.shared_destinations(transfer_id)

    def commit_weight_update(
        self,
        transfer_id: str,
        names: Sequence[str],
        version: int | None = None,
        partial: bool = False,
    ) -> int:
        """Switch to a streamed update; see :meth:`WeightUpdater.commit`."""
        return self.weight_updater.commit(transfer_id, names, version, partial)

    def abort_weight_update(self, transfer_id: str | None, reason: str) -> bool:
        """Drop a streamed update; see :meth:`WeightUpdater.abort`."""
        return self.weight_updater.abort(transfer_id, reason)

    # ------------------------------------------------------------------------------ sleep

    def sleep(self, level: int = 1) -> concurrent.futures.Future[dict[str, Any]]:
        """Release memory: the KV cache, and the weights (offloaded at 1, discarded at 2).

        In-flight requests end with ``abort``.
        """
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}", param="level")

        def run() -> dict[str, Any]:
            device = self.runner.device
            on_gpu = device.type == "cuda"
            before = torch.cuda.memory_allocated(device) if on_gpu else 0
            aborted = self._abort_groups(self._groups.values())
            self.allocator.reset_prefix_cache()
            kv = self.cache.nbytes
            self.cache.release()
            self._kv_released = True
            weights = self.runner.offload() if level == 1 else self.runner.discard()
            return {
                "level": level,
                "aborted_requests": aborted,
                "kv_cache_bytes_released": kv,
                "weight_bytes_released": weights,
                # Measured, not computed: what the trainer's ranks on this GPU can now use.
                "device_bytes_freed": before - torch.cuda.memory_allocated(device)
                if on_gpu
                else None,
            }

        return self._command(run)

    def wake_up(
        self, tags: Sequence[str] | None = None
    ) -> concurrent.futures.Future[dict[str, Any]]:
        """Restore what :meth:`sleep` released; ``tags`` picks ``kv_cache`` and/or ``weights``.

        Weights discarded at level 2 come back only through :meth:`load_weights` or
        :meth:`update_weights_from_dir`.
        """
        wanted = {"kv_cache", "weights"} if tags is None else set(tags)
        unknown = wanted - {"kv_cache", "weights"}
        if unknown:
            raise InvalidRequestError(
                f"unknown wake_up tag(s) {sorted(unknown)}; expected 'kv_cache' and/or 'weights'",
                param="tags",
            )

        def run() -> dict[str, Any]:
            if "weights" in wanted:
                self.runner.reload()
            if "kv_cache" in wanted:
                self.cache.allocate()
                self._kv_released = False
            return {
                "kv_cache_bytes": self.cache.nbytes,
                "weight_bytes": self.runner.weight_bytes,
                "needs_weights": self.runner.weights_discarded,
            }

        return self._command(run)

    # ------------------------------------------------------------------------------ stats

    def stats(self) -> BackendStats:
        """Return a snapshot of the engine's counters and gauges."""
        s = dataclasses.replace(self._stats, finished_total=dict(self._stats.finished_total))
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.paused = self._paused
        s.sleeping = self.sleeping
        s.weight_version = self.weight_version
        s.kv_cache_blocks_used = self.allocator.num_used
        s.kv_cache_bytes = self.cache.nbytes
        s.weight_bytes = self.runner.weight_bytes
        s.prefix_cache_hit_tokens_total = self.allocator.hit_tokens_total
        with self._tps_lock:
            window = list(self._tps_window)
        now = time.perf_counter()
        recent = [(t, n) for t, n in window if now - t <= _TPS_WINDOW_S]
        if recent:
            span = max(now - recent[0][0], 1e-3)
            s.generated_tokens_per_s = sum(n for _, n in recent) / span
        return s

    # ------------------------------------------------------------------------ engine loop

    def _command(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as exc:  # handed to the caller, not raised on the engine
                fut.set_exception(exc)

        if self._stopping:
            fut.set_exception(EngineUnavailableError("the engine is shutting down"))
            return fut
        self._commands.put(run)
        self._wake.set()
        return fut

    def _run_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _loop(self) -> None:
        # A thread's OpenMP team size is its own (an unset one starts from torch's global
        # setting): give the engine thread the configured count explicitly.
        torch.set_num_threads(self._num_threads)
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            if self._paused or self._kv_released or not self.scheduler.has_work:
                self._flush()
                self._wake.wait(timeout=1.0)
                continue
            try:
                self._step()
            except Exception as exc:  # a failed step fails its requests, not the server
                logger.exception("engine step failed")
                self._fail_all(exc)
            self._flush()
        self._run_commands()
        self._flush()

    def _fail_all(self, exc: BaseException) -> None:
        for group in list(self._groups.values()):
            for seq in group.seqs:
                if seq.status is not SeqStatus.FINISHED:
                    self.scheduler.remove(seq)
            self._drop_group(group)
            self._outbox.append((group.sink, exc))

    def _flush(self) -> None:
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        # One call per request and step: its deltas merged, or the exception that ended it.
        merged: dict[int, tuple[Sink, Any]] = {}
        for sink, payload in items:
            key = id(sink)
            current = merged.get(key)
            if isinstance(payload, BaseException):
                merged[key] = (sink, payload)
            elif current is None:
                merged[key] = (sink, list(payload))
            elif isinstance(current[1], list):
                current[1].extend(payload)
        try:
            self._deliver(list(merged.values()))
        except Exception:
            logger.exception("delivering engine outputs failed")

    def _on_preempt(self, seq: Seq) -> None:
        self._stats.preemptions_total += 1

    # -------------------------------------------------------------------------------- step

    def _build_inputs(
        self, decode: list[Chunk], prefill: list[Chunk]
    ) -> tuple[StepInputs, list[Chunk]]:
        """Pack a step; return its inputs and the chunks in packed order.

        Packed order: decode tokens sorted by context length (so each length bucket pads
        little), then prefill chunks that start a sequence (attended causally among
        themselves, no cache read), then chunks continuing a partly computed sequence.
        """
        bs = self.config.block_size
        dev = self.runner.device
        decode = sorted(decode, key=lambda c: c.start)
        fresh = [c for c in prefill if c.start == 0]
        cont = [c for c in prefill if c.start > 0]
        ordered = decode + fresh + cont
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_index: list[int] = []
        # Prompt log-probs: the rows of every scored prompt position, after the sampling rows.
        score_index: list[int] = []
        score_spans: list[tuple[Seq, int, int, int]] = []

        def score(seq: Seq, start: int, length: int, packed_at: int) -> None:
            # Position p's logits score prompt token p + 1.
            count = min(start + length, seq.prompt_len - 1) - start
            if seq.scores_prompt and count > 0:
                score_spans.append((seq, start, count, len(score_index)))
                score_index.extend(range(packed_at, packed_at + count))

        vision = self.runner.vision
        # Vision models: (t, h, w) rows of M-RoPE positions, and where image rows go.
        mrope: list[list[int]] = [[], [], []]
        media: list[tuple[int, MediaItem, int, int]] = []
        for c in decode:
            seq = c.seq
            p = c.start
            if vision:
                self._add_media(seq, len(ids), p, p + 1, mrope, media)
            score(seq, p, 1, len(ids))
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // bs] * bs + p % bs)
            if c.samples:
                logits_index.append(len(ids) - 1)
        fresh_spans: list[tuple[int, int]] = []
        for c in fresh + cont:
            seq = c.seq
            end = c.start + c.length
            if c.start == 0:
                fresh_spans.append((len(ids), c.length))
            if vision:
                self._add_media(seq, len(ids), c.start, end, mrope, media)
            score(seq, c.start, c.length, len(ids))
            ids.extend(seq.tokens[c.start : end])
            rng = range(c.start, end)
            pos.extend(rng)
            blocks = seq.blocks
            slots.extend(blocks[p // bs] * bs + p % bs for p in rng)
            if c.samples:
                logits_index.append(len(ids) - 1)

        decode_lens = [c.start + 1 for c in decode]
        table: list[int] = []  # the decode block table, flat (rows padded with block 0)
        nb = 0
        if decode:
            nb = -(-decode_lens[-1] // bs)
            for c in decode:
                row = c.seq.blocks
                if len(row) >= nb:
                    table += row[:nb]
                else:
                    table += row
                    table += [0] * (nb - len(row))
        # All of the step's index tensors in one tensor (one conversion, one device copy),
        # handed out as contiguous slices.
        sampled = len(logits_index)
        logits_index += score_index
        t, s = len(ids), len(logits_index)
        packed = torch.tensor(ids + pos + slots + logits_index + table + decode_lens)
        if dev.type != "cpu":
            packed = packed.to(dev, non_blocking=True)
        ends = list(itertools.accumulate((t, t, t, s, len(table), len(decode_lens))))
        decode_table = decode_kv_lens = None
        if decode:
            decode_table = packed[ends[3] : ends[4]].view(len(decode), nb)
            decode_kv_lens = packed[ends[4] : ends[5]]
        offset = len(ids) - sum(c.length for c in cont)
        meta = StepMetadata(
            self.cache,
            packed[ends[1] : ends[2]],
            decode_table,
            decode_kv_lens,
            decode_lens,
            fresh_spans,
            self._group(cont, with_index=True, offset=offset) if cont else None,
            use_kernel=self._use_kernel,
            # Per chunk, not per token: a prefill step packs thousands of positions.
            max_position=max((c.start + c.length - 1 for c in ordered), default=0),
        )
        inputs = StepInputs(
            input_ids=packed[: ends[0]].unsqueeze(0),
            position_ids=packed[ends[0] : ends[1]].unsqueeze(0),
            logits_index=packed[ends[2] : ends[3]],
            meta=meta,
            score_spans=[(seq, first, n, sampled + row) for seq, first, n, row in score_spans],
        )
        if vision:
            inputs.mrope_positions = torch.tensor(mrope, device=dev).view(3, 1, -1)
            inputs.media = media
        return inputs, ordered

    @staticmethod
    def _add_media(
        seq: Seq,
        at: int,
        start: int,
        end: int,
        mrope: list[list[int]],
        media: list[tuple[int, MediaItem, int, int]],
    ) -> None:
        """Append positions ``start .. end-1`` of ``seq`` (packed from ``at``) to a vision step."""
        sm: SeqMedia | None = seq.media
        if sm is None:
            for row in mrope:
                row.extend(range(start, end))
            return
        for row, part in zip(mrope, sm.positions(start, end), strict=True):
            row.extend(part)
        for item, pos, lo, hi in sm.overlapping(start, end):
            media.append((at + pos - start, item, lo, hi))

    def _group(self, chunks: list[Chunk], with_index: bool, offset: int = 0) -> AttentionGroup:
        bs = self.config.block_size
        dev = self.runner.device
        kv_lens = [c.start + c.length for c in chunks]
        q_lens = [c.length for c in chunks]
        kv_len = max(kv_lens)
        nb = -(-kv_len // bs)
        table = [c.seq.blocks[:nb] + [0] * (nb - min(nb, len(c.seq.blocks))) for c in chunks]
        q_len = max(q_lens)
        q_lens_t = torch.tensor(q_lens, dtype=torch.long)
        q_index = valid_index = None
        if with_index:
            starts = torch.tensor([0, *q_lens[:-1]], dtype=torch.long).cumsum(0) + offset
            ar = torch.arange(q_len)
            q_index = (starts[:, None] + torch.minimum(ar[None, :], q_lens_t[:, None] - 1)).to(dev)
            valid = (ar[None, :] < q_lens_t[:, None]).reshape(-1)
            valid_index = valid.nonzero().squeeze(1).to(dev)
        return AttentionGroup(
            block_table=torch.tensor(table, dtype=torch.long).to(dev, non_blocking=True),
            kv_lens=torch.tensor(kv_lens, dtype=torch.long).to(dev, non_blocking=True),
            q_lens=q_lens_t.to(dev),
            q_len=q_len,
            kv_len=kv_len,
            q_index=q_index,
            valid_index=valid_index,
            offset=offset,
        )

    def _step(self) -> None:
        plan = self.scheduler.schedule()
        if not plan:
            return
        decode = [c for c in plan if c.length == 1]
        prefill = [c for c in plan if c.length > 1]
        inputs, ordered = self._build_inputs(decode, prefill)
        recorder = self.runner.routes
        record = recorder is not None and any(c.seq.routes is not None for c in plan)
        if record:
            recorder.start()
        logits = self.runner.forward(inputs)
        if record:
            self._store_routes(ordered, recorder.collect())
        sampling = [c for c in ordered if c.samples]
        if inputs.score_spans:
            self._score_prompts(inputs.score_spans, logits)
            logits = logits[: len(sampling)]
        for c in plan:
            self.scheduler.commit(c)
        self._stats.steps_total += 1
        if not sampling:
            return
        seqs = [c.seq for c in sampling]
        forked = self._fork_followers(seqs)
        if forked:
            # Each forked sample draws its first token from its leader's logits row.
            rows = list(range(len(seqs)))
            for row, seq in forked:
                rows.append(row)
                seqs.append(seq)
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        out = self.sampler(logits, [s.row for s in seqs])
        now = time.perf_counter()
        for i, seq in enumerate(seqs):
            self._append(seq, out.tokens[i], out.logprobs[i], out.top_logprobs[i], now)
        self._stats.generated_tokens_total += len(seqs)
        with self._tps_lock:
            self._tps_window.append((now, len(seqs)))
            while self._tps_window and now - self._tps_window[0][0] > _TPS_WINDOW_S:
                self._tps_window.popleft()

    @staticmethod
    def _score_prompts(spans: list[tuple[Seq, int, int, int]], logits: torch.Tensor) -> None:
        """Record the log-prob (and top alternatives) of the prompt tokens scored this step.

        Under ``log_softmax(logits / T)`` in fp32 (``T`` = 1 for greedy), as sampled tokens'
        log-probs are, without the sampling filters (top-k/p, min-p, repetition penalty).
        """
        for seq, first, count, row in spans:
            params = seq.params
            z = logits[row : row + count].float()
            if params.temperature not in (0.0, 1.0):
                z = z / params.temperature
            logp = torch.log_softmax(z, dim=-1)
            targets = torch.tensor(seq.tokens[first + 1 : first + 1 + count], device=z.device)
            values = logp.gather(1, targets[:, None])[:, 0].tolist()
            seq.prompt_scores[first + 1 : first + 1 + count] = values
            if params.prompt_logprobs:
                top = logp.topk(min(params.prompt_logprobs, logp.shape[-1]), dim=-1)
                pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
                for i, (ids, vals) in enumerate(pairs):
                    seq.prompt_top[first + 1 + i] = list(zip(ids, vals, strict=True))

    def _store_routes(self, ordered: list[Chunk], rows: np.ndarray) -> None:
        """Give each chunk's sequence the routes of the positions it computed this step."""
        offset = 0
        for c in ordered:  # packed order: each chunk's tokens are consecutive
            if c.seq.routes is not None:
                c.seq.routes.write(c.start, rows[offset : offset + c.length])
            offset += c.length

    def _fork_followers(self, sampling: list[Seq]) -> list[tuple[int, Seq]]:
        """Start the waiting samples of each leader that just computed its prompt.

        A request's samples after the first wait for the first (the leader) to compute the
        shared prompt. Rather than prefilling the prompt again each (``n - 1`` times the
        prompt's tokens: with short prompts, below one full block, the prefix cache shares
        nothing), they take the leader's keys and values (see :meth:`Scheduler.fork`) and
        draw their first token from the leader's logits in this same step.

        Returns:
            ``(row, sample)`` per forked sample, ``row`` being its leader's index in
            ``sampling``.
        """
        forked: list[tuple[int, Seq]] = []
        for row, leader in enumerate(sampling):
            if leader.num_output != 0 or leader.index != 0:
                continue
            group: _Group = leader.group
            for seq in group.seqs[1:]:
                copy = self.scheduler.fork(leader, seq)
                if copy is None:
                    continue
                if copy[0] >= 0:
                    self.cache.copy_block(*copy)
                if seq.routes is not None and leader.routes is not None:
                    # The follower's prompt was computed by its leader, routes included.
                    seq.routes.copy_prefix(leader.routes, seq.prompt_len)
                forked.append((row, seq))
        return forked

    def _append(
        self,
        seq: Seq,
        token: int,
        logprob: float | None,
        top: list[tuple[int, float]] | None,
        now: float,
    ) -> None:
        seq.tokens.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(float(logprob) if logprob is not None else float("nan"))
        if seq.top_logprobs is not None:
            seq.top_logprobs.append(top or [])
        if seq.num_output == 1:
            seq.first_weight_version = self.weight_version
        seq.weight_version = self.weight_version
        group: _Group = seq.group
        if group.first_token_time is None:
            group.first_token_time = now
            self._stats.ttft_seconds_sum += now - group.arrival
            self._stats.ttft_count += 1
        if token in seq.stop_ids:
            self._finish(seq, "stop", token)
        elif seq.params.stop and (hit := self._stop_string(seq)) is not None:
            self._finish(seq, "stop", hit)
        elif seq.num_output >= seq.max_new_tokens or len(seq.tokens) >= self.max_model_len:
            self._finish(seq, "length", None)
        elif group.stream:
            self._emit(seq, None, None)

    def _stop_string(self, seq: Seq) -> str | None:
        stops = seq.params.stop
        window = max(len(s) for s in stops) + 8
        tail = self.tokenizer.decode(seq.output_ids()[-window:], skip_special_tokens=True)
        for s in stops:
            if s in tail:
                return s
        return None

    def _emit(self, seq: Seq, finish_reason: str | None, stop_reason: int | str | None) -> None:
        new = seq.tokens[seq.prompt_len + seq.emitted :]
        start = seq.emitted
        seq.emitted += len(new)
        delta = SampleDelta(
            index=seq.index,
            token_ids=new,
            logprobs=None if seq.logprobs is None else seq.logprobs[start : seq.emitted],
            top_logprobs=None
            if seq.top_logprobs is None
            else seq.top_logprobs[start : seq.emitted],
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            weight_version=seq.weight_version,
            first_weight_version=seq.first_weight_version,
            cached_prompt_tokens=seq.cached_prompt_tokens,
        )
        if finish_reason is not None and seq.routes is not None:
            delta.routed_experts = seq.routes.take(len(seq.tokens)).tolist()
        if seq.scores_prompt:
            delta.prompt_logprobs = seq.prompt_scores
            delta.prompt_top_logprobs = seq.prompt_top
            seq.prompt_scores_sent = True
        self._outbox.append((seq.group.sink, [delta]))

    def _finish(self, seq: Seq, reason: str, stop_reason: int | str | None) -> None:
        self.scheduler.remove(seq)
        if seq.num_output == 0:
            seq.weight_version = self.weight_version
        self._emit(seq, reason, stop_reason)
        totals = self._stats.finished_total
        totals[reason] = totals.get(reason, 0) + 1
        group: _Group = seq.group
        group.unfinished -= 1
        if group.unfinished == 0:
            self._drop_group(group)

    def _drop_group(self, group: _Group) -> None:
        rid = group.request.request_id
        if self._groups.get(rid) is group:
            del self._groups[rid]
        with self._lock:
            self._active_ids.discard(rid)
