"""The ``sglang`` rollout backend: a real SGLang server subprocess behind the backend API.

SGLang lives in its own virtual environment, ``.venv-sglang`` (made by
``scripts/setup_sglang_venv.sh``; it pins its own torch and transformers and, from PyPI, is a
CUDA build), and this module talks to it over HTTP only; it imports nothing from SGLang. It
can also front an SGLang server that is already running (``server_url``).

How each :class:`~polyrl.core.rollout_api.RolloutBackend` method maps onto SGLang's native
HTTP API:

* ``start`` -- launches ``.venv-sglang/bin/python -m sglang.launch_server --model-path MODEL_DIR
  --host 127.0.0.1 --port P --skip-tokenizer-init --incremental-streaming-output
  --enable-metrics ...`` (see :meth:`SGLangBackend.command` for the flags each option adds),
  waits for ``GET /health``, reads the context length from ``GET /server_info`` (older
  servers: ``/get_server_info``) and sends one warm-up request. With ``server_url`` nothing is
  launched: the backend waits for that server's ``/health`` and uses it.
* ``generate`` -- token-in/token-out through ``POST /generate`` with ``input_ids``,
  ``sampling_params``, ``stream: true`` and, when log-probs are wanted, ``return_logprob``,
  ``logprob_start_len: -1`` (no prompt log-probs) and ``top_logprobs_num``. Each of the ``n``
  samples is its own streamed request with its own ``rid`` (SGLang gives the copies of an
  ``n > 1`` request fresh random rids, which ``/abort_request`` could not reach); SGLang's
  radix cache shares the prompt between them. Output ids come from ``output_ids`` and
  log-probs from ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]`` triples);
  :func:`parse_generate_chunk` reads both the incremental and the cumulative stream formats.
  A caller that does not stream gets each sample in one piece when it finishes.
* ``abort`` -- ``POST /abort_request {"rid": ...}`` per unfinished sample; SGLang then ends the
  stream with ``finish_reason.type == "abort"`` and the tokens generated so far, which the
  caller gets. A stream that does not end within ``abort_timeout`` seconds is closed.
* ``pause``/``resume`` -- a gate in this backend holds new requests, and SGLang's
  ``POST /pause_generation {"mode": "in_place"}`` freezes in-flight ones where they are
  (``/continue_generation`` undoes both). Servers without those endpoints get the gate only.
* ``sleep``/``wake_up`` -- in-flight requests are aborted, then ``POST
  /release_memory_occupation`` / ``/resume_memory_occupation`` with ``tags`` (``kv_cache``,
  ``weights``). Needs the server started with ``--enable-memory-saver``
  (``enable_sleep_mode=True``). Level 1 releases the KV cache, and the weights too when
  ``weights_cpu_backup`` keeps a CPU copy of them; level 2 releases both and the weights count
  as discarded until ``update_weights``.
* ``update_weights`` -- ``POST /pause_generation {"mode": "retract"}`` (running requests go
  back to the queue and are re-prefilled under the new weights), ``POST
  /update_weights_from_disk {"model_path": DIR, "weight_version": V}`` (SGLang flushes its
  radix cache), ``POST /continue_generation``; the weight version this backend reports on every
  token is bumped. ``init_weights_update_group`` / ``update_weights_from_distributed`` /
  ``destroy_weights_update_group`` forward SGLang's NCCL broadcast path for a trainer that
  drives it directly. There is no ``load_weights``: SGLang's in-memory path
  (``/update_weights_from_tensor``) takes tensors pickled by SGLang's own serializer (CUDA IPC
  handles on a GPU), which polyrl cannot produce without importing SGLang; the weight routes
  therefore stage a safetensors directory and call ``update_weights`` (as for vLLM).
* ``stats`` -- request, token, cached-token and TTFT counters kept here, plus running/queued
  requests, KV-cache tokens and retractions scraped from SGLang's ``/metrics`` every
  ``metrics_interval`` seconds (the server runs with ``--enable-metrics``).

Log-probs: SGLang reports ``log(softmax(logits / T))``, after temperature and before any
top-k/top-p/min-p filter -- the native engine's convention.

Seeds: a request's ``seed`` becomes SGLang's ``sampling_seed`` (``seed + i`` for sample ``i``,
so the ``n`` samples differ); SGLang honours it only when started with
``--enable-deterministic-inference`` (``deterministic_inference=True``).

Stop strings need a tokenizer, which a ``--skip-tokenizer-init`` server does not load: requests
with ``stop`` are refused (use ``stop_token_ids``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import re
import shlex
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polyrl.core.rollout_api import (
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    RolloutError,
    SampleDelta,
    SampleOutput,
    SamplingParams,
    WeightReceive,
)
from polyrl.rollout.base import register_backend
from polyrl.rollout.subprocess_backend import (
    ServerOptions,
    StreamJob,
    SubprocessBackend,
    find_venv,
    prometheus_samples,
    value_flags,
    venv_has,
)

__all__ = [
    "SGLANG_ARGS_ENV",
    "SGLANG_VENV_ENV",
    "SGLangBackend",
    "SGLangOptions",
    "default_sglang_venv",
    "generate_body",
    "parse_generate_chunk",
    "parse_sglang_metrics",
    "sglang_available",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the SGLang virtual environment (default: ``.venv-sglang`` at the
#: repository root, then in the working directory).
SGLANG_VENV_ENV = "POLYRL_SGLANG_VENV"
#: Environment variable with extra SGLang server flags (shell syntax), appended last.
SGLANG_ARGS_ENV = "POLYRL_SGLANG_ARGS"

_SERVER_MODULE = "sglang.launch_server"
# polyrl's names -> SGLang's --dtype values ("auto": the checkpoint's).
_DTYPES = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
_URL = re.compile(r"^https?://[^/\s:]+(:\d+)?/?$")

_METRICS = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_used_tokens": "used_tokens",
    "sglang:max_total_num_tokens": "total_tokens",
    "sglang:token_usage": "token_usage",
    "sglang:num_retracted_requests_total": "retractions",
}


def default_sglang_venv() -> Path:
    """Where the SGLang virtual environment is looked for.

    ``$POLYRL_SGLANG_VENV`` if set; else the first of ``<repo>/.venv-sglang`` and
    ``./.venv-sglang`` that holds SGLang; else ``<repo>/.venv-sglang``.
    """
    return find_venv(SGLANG_VENV_ENV, ".venv-sglang", sglang_available)


def sglang_available(venv: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``venv`` (default :func:`default_sglang_venv`) holds a Python with SGLang.

    Cheap: it looks for the package's launcher module instead of importing SGLang (which
    takes many seconds and needs a GPU build to succeed); ``start()`` reports an install
    that is there but broken.
    """
    path = Path(venv) if venv is not None else default_sglang_venv()
    return venv_has(path, "lib/python3*/site-packages/sglang/launch_server.py")


@dataclasses.dataclass(frozen=True)
class SGLangOptions(ServerOptions):
    """Options of :class:`SGLangBackend`; checked on construction.

    The first group shares names (and meaning) with the native and vLLM backends' options.

    Attributes:
        dtype: ``auto`` (default: the checkpoint's), ``float32``, ``bfloat16`` or ``float16``.
        device: ``cuda`` (default), ``cuda:i`` (``--base-gpu-id i``: GPUs ``i`` ..
            ``i + tensor_parallel_size - 1``) or ``cpu`` (only with an SGLang CPU build,
            which PyPI does not ship).
        max_model_len: longest prompt + output (``--context-length``; default: the model's).
        max_num_seqs: most requests running at once (``--max-running-requests``).
        max_num_batched_tokens: most prefill tokens per step (``--chunked-prefill-size``).
        kv_cache_tokens: KV-cache size in tokens (``--max-total-tokens``; default: what
            ``gpu_memory_utilization`` leaves).
        seed: SGLang's global seed (``--random-seed``).
        served_model_name: model name reported to clients (default: the directory's name).
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes (off:
            ``--disable-radix-cache``).
        trust_remote_code: allow modelling code shipped in the model directory.
        tensor_parallel_size: GPUs the model is split over (``--tp-size``).
        gpu_memory_utilization: fraction of GPU memory for weights and KV cache
            (``--mem-fraction-static``; default: SGLang's).
        enable_sleep_mode: make ``sleep``/``wake_up`` free memory (``--enable-memory-saver``).
        enforce_eager: no CUDA graphs (``--disable-cuda-graph``).

    SGLang-only:
        weights_cpu_backup: keep a CPU copy of the weights while asleep
            (``--enable-weights-cpu-backup``; needs ``enable_sleep_mode``), so that
            ``sleep(level=1)`` can release them too.
        deterministic_inference: ``--enable-deterministic-inference``, which makes SGLang
            honour per-request seeds.
        enable_metrics: ``--enable-metrics`` (what :meth:`SGLangBackend.stats` scrapes).
        server_url: use the SGLang server already running at this URL instead of launching
            one (the launch options above are then ignored; ``update_weights`` paths must be
            readable by that server).
        sglang_venv: the SGLang virtual environment (default: :func:`default_sglang_venv`).
        startup_timeout: seconds to wait for the server to come up.
        warmup: send one tiny request in ``start()`` so the first real one is not slow.
        log_path: file for the server's output (default: a private temporary directory).
        extra_args: more SGLang server flags, a list or one shell-syntax string
            (``$POLYRL_SGLANG_ARGS`` is appended too).
        env: more environment variables for the server.
        metrics_interval: seconds between scrapes of SGLang's ``/metrics``.
        buffered_stream_interval: tokens per SGLang chunk when the caller does not stream.
        abort_timeout: seconds ``abort`` waits for SGLang to end an aborted stream.
    """

    weights_cpu_backup: bool = False
    deterministic_inference: bool = False
    enable_metrics: bool = True
    server_url: str | None = None
    sglang_venv: str | None = None
    startup_timeout: float = 900.0
    abort_timeout: float = 10.0

    _backend = "sglang"
    _dtypes = tuple(_DTYPES)
    _flags = ("weights_cpu_backup", "deterministic_inference", "enable_metrics")
    _durations = ("abort_timeout",)

    def __post_init__(self) -> None:
        super().__post_init__()
        expected = "a fraction in (0, 1) or None"
        self._check_fraction("gpu_memory_utilization", expected, one=False)
        if self.weights_cpu_backup and not self.enable_sleep_mode:
            raise ValueError(
                "sglang backend option weights_cpu_backup=True needs enable_sleep_mode=True "
                "(SGLang keeps the CPU copy only with --enable-memory-saver)"
            )
        if self.server_url is not None and (
            not isinstance(self.server_url, str) or not _URL.match(self.server_url)
        ):
            raise self._bad("server_url", "an http(s)://host:port URL or None")


# ------------------------------------------------------------------ request/response mapping


def generate_body(
    request: GenerateRequest,
    max_new_tokens: int,
    rid: str,
    index: int = 0,
    *,
    stream_interval: int | None = None,
) -> dict[str, Any]:
    """Return the SGLang ``POST /generate`` JSON body for sample ``index`` of ``request``.

    One sample per SGLang request (``n`` is always 1 there); ``index`` only shifts the seed.

    Raises:
        InvalidRequestError: stop strings (a ``--skip-tokenizer-init`` server has no
            tokenizer to match them with); prompt log-probs (not wired for SGLang).
    """
    p = request.params
    if p.prompt_logprobs is not None:
        raise InvalidRequestError(
            "the sglang backend does not return prompt log-probs; score prompts with the "
            "native or the vllm backend",
            param="prompt_logprobs",
        )
    if p.stop:
        raise InvalidRequestError(
            "the sglang backend runs SGLang token-in/token-out (--skip-tokenizer-init), which "
            "cannot match stop strings; use stop_token_ids",
            param="stop",
        )
    sampling: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "ignore_eos": p.ignore_eos,
    }
    if p.stop_token_ids:
        sampling["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        sampling["sampling_seed"] = (p.seed + index) % 2**63
    if stream_interval is not None:
        sampling["stream_interval"] = stream_interval
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(request.prompt_ids),
        "sampling_params": sampling,
        "stream": True,
    }
    if p.logprobs or p.top_logprobs:
        body["return_logprob"] = True
        body["logprob_start_len"] = -1
        body["top_logprobs_num"] = p.top_logprobs
    return body


def _finish(meta: Mapping[str, Any], last: int | None) -> tuple[str | None, int | str | None]:
    """Map SGLang's ``meta_info.finish_reason`` onto polyrl's (reason, stop_reason)."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    if isinstance(fr, str):  # some older servers send the bare type
        fr = {"type": fr}
    kind = fr.get("type")
    if kind == "length":
        return "length", None
    if kind == "abort":
        return "abort", None
    matched = fr.get("matched")
    if isinstance(matched, list):
        matched = matched[-1] if matched else None
    return "stop", last if matched is None else matched


def _logprob(entry: Any) -> float:
    if not entry or entry[0] is None:
        return float("nan")
    return float(entry[0])


def parse_generate_chunk(
    chunk: Mapping[str, Any],
    seen: int,
    params: SamplingParams,
    *,
    index: int = 0,
    weight_version: int = 0,
    first_weight_version: int | None = None,
) -> tuple[SampleDelta, int]:
    """Turn one SGLang ``/generate`` answer for a sample into the delta past ``seen`` tokens.

    Works for every shape SGLang answers in: incremental stream chunks
    (``--incremental-streaming-output``: ``output_ids`` holds the new tokens only), cumulative
    ones (the default: everything so far) and the non-streamed answer; ``meta_info
    .completion_tokens`` (the count so far) says how many of the trailing ids are new.
    Log-probs are the last as many entries of ``meta_info.output_token_logprobs``
    (``[logprob, token_id, text]``), alternatives those of ``output_top_logprobs``.

    Returns:
        The delta (``token_ids`` may be empty) and the new number of tokens seen.

    Raises:
        RolloutError: the chunk carries fewer ids than it says are new.
    """
    meta = chunk.get("meta_info") or {}
    ids = [int(t) for t in (chunk.get("output_ids") or ())]
    total = meta.get("completion_tokens")
    total = seen + len(ids) if total is None and len(ids) < seen else total
    total = len(ids) if total is None else int(total)
    new = max(total - seen, 0)
    if new > len(ids):
        raise RolloutError(
            f"SGLang reported {total} completion tokens but sent {len(ids)} output ids "
            f"after {seen} were already received"
        )
    new_ids = ids[len(ids) - new :] if new else []
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    if params.logprobs:
        entries = list(meta.get("output_token_logprobs") or ())[-new:] if new else []
        logprobs = [float("nan")] * (new - len(entries)) + [_logprob(e) for e in entries]
    if params.top_logprobs:
        rows = list(meta.get("output_top_logprobs") or ())[-new:] if new else []
        rows = [None] * (new - len(rows)) + rows
        top = []
        for row in rows:
            pairs = [(int(e[1]), float(e[0])) for e in (row or ()) if e and e[0] is not None]
            pairs.sort(key=lambda pair: -pair[1])
            top.append(pairs[: params.top_logprobs])
    reason, stop_reason = _finish(meta, ids[-1] if ids else None)
    delta = SampleDelta(
        index=index,
        token_ids=new_ids,
        logprobs=logprobs,
        top_logprobs=top,
        finish_reason=reason,
        stop_reason=stop_reason,
        weight_version=weight_version,
        first_weight_version=first_weight_version,
        cached_prompt_tokens=int(meta.get("cached_tokens") or 0),
    )
    return delta, seen + new


def parse_sglang_metrics(text: str) -> dict[str, float]:
    """Pick the SGLang metrics :meth:`SGLangBackend.stats` reports out of Prometheus text.

    Values of the same metric with different labels (TP/DP ranks) are summed.
    """
    out: dict[str, float] = {}
    for name, _, value in prometheus_samples(text):
        key = _METRICS.get(name)
        if key is not None and math.isfinite(value):
            out[key] = out.get(key, 0.0) + value
    return out


# ------------------------------------------------------------------------------ requests


class _Sample:
    """One of a request's ``n`` samples: its SGLang request and what came back."""

    __slots__ = ("done", "finished", "first_version", "index", "rid", "seen", "task", "whole")

    def __init__(self, index: int, rid: str, params: SamplingParams):
        self.index = index
        self.rid = rid
        self.seen = 0
        self.first_version: int | None = None
        self.finished = False
        self.done = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.whole = SampleOutput(index=index, logprobs=[] if params.logprobs else None)


class _Job(StreamJob):
    """One request in flight: a streamed SGLang request per sample, one delta queue."""

    backend: SGLangBackend

    def __init__(
        self, backend: SGLangBackend, request: GenerateRequest, max_new: int, stream: bool
    ):
        super().__init__(backend, request, max_new, stream)
        tag = uuid.uuid4().hex[:12]
        # SGLang aborts every rid that *starts with* the one given: fixed-width sample numbers
        # keep one sample's rid from being a prefix of another's.
        self.samples = [
            _Sample(i, f"polyrl-{tag}-{i:03d}-{request.request_id}", request.params)
            for i in range(request.params.n)
        ]
        self.failed = False

    def start(self) -> None:
        for s in self.samples:
            s.task = asyncio.ensure_future(self._run(s))

    async def cancel(self) -> None:
        """Abort: ask SGLang to end the unfinished samples, then close what is left."""
        b = self.backend
        left = [s for s in self.samples if not s.finished]
        if self.sent and left and b._client is not None:
            with contextlib.suppress(Exception):
                await asyncio.gather(
                    *(
                        b._http().post("/abort_request", json={"rid": s.rid}, timeout=10.0)
                        for s in left
                    )
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*(s.done.wait() for s in left)), b.options.abort_timeout
                )
        tasks = [s.task for s in self.samples if s.task is not None and not s.task.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._end_unfinished("abort")
        if b._jobs.get(self.request.request_id) is self:
            del b._jobs[self.request.request_id]

    async def _run(self, s: _Sample) -> None:
        b = self.backend
        try:
            client = await self._admit()
            body = generate_body(
                self.request,
                self.max_new,
                s.rid,
                s.index,
                stream_interval=None if self.stream else b.options.buffered_stream_interval,
            )
            # Closed on a break too: leaving the stream closes SGLang's connection at once.
            async with contextlib.aclosing(self._chunks(client, "/generate", body)) as chunks:
                async for chunk in chunks:
                    delta = self._take(s, chunk)
                    if delta is not None:
                        self.inbox.put_nowait([delta])
                    if s.finished:
                        break
            if not s.finished:
                raise RolloutError(
                    f"the SGLang stream of sample {s.index} of request "
                    f"{self.request.request_id!r} ended before the sample finished"
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            exc = self._failure(exc)
            if not self.failed:
                self.failed = True
                self.inbox.put_nowait(exc)
                for other in self.samples:
                    if other is not s and other.task is not None:
                        other.task.cancel()
            for other in self.samples:
                other.finished = True
        finally:
            s.done.set()
            if all(x.done.is_set() for x in self.samples):
                if b._jobs.get(self.request.request_id) is self:
                    del b._jobs[self.request.request_id]

    def _take(self, s: _Sample, chunk: Mapping[str, Any]) -> SampleDelta | None:
        """Record one SGLang chunk of sample ``s``; return the delta to deliver now, if any."""
        b = self.backend
        if s.finished:
            return None
        version = b._weight_version
        delta, s.seen = parse_generate_chunk(
            chunk,
            s.seen,
            self.request.params,
            index=s.index,
            weight_version=version,
            first_weight_version=s.first_version,
        )
        if delta.token_ids:
            if s.first_version is None:
                s.first_version = version
                delta.first_weight_version = version
            self._count_tokens(len(delta.token_ids))
        if delta.finish_reason is not None:
            s.finished = True
            self._count_finish(delta.finish_reason)
            b._counters["cached_tokens"] += delta.cached_prompt_tokens
        if self.stream:
            if not delta.token_ids and delta.finish_reason is None:
                return None
            return delta
        s.whole.add(delta)
        return self._whole(s) if delta.finish_reason is not None else None

    def _whole(self, s: _Sample) -> SampleDelta:
        w = s.whole
        return SampleDelta(
            index=s.index,
            token_ids=list(w.output_ids),
            logprobs=list(w.logprobs) if w.logprobs is not None else None,
            top_logprobs=list(w.top_logprobs or []) if self.request.params.top_logprobs else None,
            finish_reason=w.finish_reason,
            stop_reason=w.stop_reason,
            weight_version=self.backend._weight_version,
            first_weight_version=s.first_version,
            cached_prompt_tokens=w.cached_prompt_tokens,
        )

    def _end_unfinished(self, reason: str) -> None:
        """Deliver ``reason`` for every sample that has not finished."""
        deltas: list[SampleDelta] = []
        for s in self.samples:
            if s.finished:
                continue
            s.finished = True
            self._count_finish(reason)
            if self.stream:
                deltas.append(self._abort_delta(s.index, s.first_version, reason))
            else:
                s.whole.finish_reason = reason
                deltas.append(self._whole(s))
        if deltas:
            self.inbox.put_nowait(deltas)


# ------------------------------------------------------------------------------- backend


@register_backend("sglang")
class SGLangBackend(SubprocessBackend):
    """An SGLang server subprocess behind :class:`~polyrl.core.rollout_api.RolloutBackend`.

    See the module docstring for how every method maps onto SGLang.

    Takes ``model_dir`` (read here for the vocab size and eos ids even when ``server_url``
    names a running server) and :class:`SGLangOptions` fields, as :class:`SubprocessBackend`
    does.
    """

    options_class = SGLangOptions
    #: Pushed weights are staged as a safetensors directory for :meth:`update_weights`.
    weight_receive: WeightReceive = "safetensors_dir"
    name = "sglang"
    server_name = "SGLang"
    options: SGLangOptions

    # --------------------------------------------------------------------------- lifecycle

    def _find_venv(self) -> Path:
        o = self.options
        return Path(o.sglang_venv).resolve() if o.sglang_venv else default_sglang_venv()

    def command(self, port: int) -> list[str]:
        """Return the SGLang server's command line for ``port``."""
        o = self.options
        cmd = [
            str(self.venv / "bin" / "python"),
            "-m",
            _SERVER_MODULE,
            "--model-path",
            str(self.model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--incremental-streaming-output",
            "--served-model-name",
            o.served_model_name or self.model_dir.name,
            "--dtype",
            _DTYPES[o.dtype],
            "--tp-size",
            str(o.tensor_parallel_size),
        ]
        device, _, gpu = o.device.partition(":")
        cmd += ["--device", device]
        if gpu:
            cmd += ["--base-gpu-id", gpu]
        cmd += value_flags(
            (
                ("--context-length", o.max_model_len),
                ("--max-running-requests", o.max_num_seqs),
                ("--chunked-prefill-size", o.max_num_batched_tokens),
                ("--max-total-tokens", o.kv_cache_tokens),
                ("--mem-fraction-static", o.gpu_memory_utilization),
                ("--random-seed", o.seed),
            )
        )
        for flag, on in (
            ("--disable-radix-cache", not o.enable_prefix_caching),
            ("--enable-memory-saver", o.enable_sleep_mode),
            ("--enable-weights-cpu-backup", o.weights_cpu_backup),
            ("--disable-cuda-graph", o.enforce_eager),
            ("--enable-deterministic-inference", o.deterministic_inference),
            ("--enable-metrics", o.enable_metrics),
            ("--trust-remote-code", o.trust_remote_code),
        ):
            if on:
                cmd.append(flag)
        cmd += list(o.extra_args)
        cmd += shlex.split(os.environ.get(SGLANG_ARGS_ENV, ""))
        return cmd

    def environment(self) -> dict[str, str]:
        """Return the SGLang server's environment."""
        env = self._child_environment()
        env.update(self.options.env)
        return env

    def _check_loadable(self) -> None:
        if not sglang_available(self.venv):
            raise FileNotFoundError(
                f"no SGLang installation in {self.venv}; create it with "
                f"scripts/setup_sglang_venv.sh (needs a CUDA GPU to run), point "
                f"${SGLANG_VENV_ENV} / sglang_venv at one, or give server_url of a running "
                f"SGLang server"
            )

    def _launch_environment(self, tmp_dir: str) -> dict[str, str]:
        return self.environment()

    async def _connect(self, started: float) -> None:
        if self.options.server_url:
            self._new_client(self.options.server_url)
            await self._wait_healthy(started)
        else:
            await self._launch(started)

    async def _model_info(self) -> ModelInfo:
        return ModelInfo(
            model=self.options.served_model_name or self.model_dir.name,
            vocab_size=int(self._shapes["vocab_size"]),
            max_model_len=await self._context_length(),
            eos_token_ids=tuple(self._shapes["eos"]),
            backend="sglang",
        )

    async def _context_length(self) -> int:
        info: Any = None
        for path in ("/server_info", "/get_server_info"):
            with contextlib.suppress(RolloutError):
                info = await self._call("GET", path, timeout=30.0)
                break
        length = info.get("context_length") if isinstance(info, dict) else None
        return int(length or self.options.max_model_len or self._shapes["max_position"] or 2048)

    def _warmup_request(self) -> tuple[str, dict[str, Any]]:
        return "/generate", {
            "input_ids": [min(16, self.info.vocab_size - 1)],
            "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True},
        }

    def _check_answer(self, path: str, answer: Any) -> None:
        # SGLang answers some failed control calls with 200 and {"success": false}.
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RolloutError(f"SGLang {path} failed: {answer.get('message') or answer}")

    # -------------------------------------------------------------------------- requests

    def _validate(self, request: GenerateRequest) -> int:
        max_new = super()._validate(request)
        generate_body(request, max_new, "check")  # refuses what SGLang cannot do, here
        return max_new

    def _new_job(self, request: GenerateRequest, max_new: int, stream: bool) -> _Job:
        return _Job(self, request, max_new, stream)

    # --------------------------------------------------------------------------- control

    async def _pause_engine(self) -> None:
        await self._engine_call("/pause_generation", json_body={"mode": "in_place"})

    async def _resume_engine(self) -> None:
        await self._engine_call("/continue_generation", json_body={})

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Abort in-flight requests, then release GPU memory; ``generate`` answers 503 after.

        Level 1 releases the KV cache (and the weights when ``weights_cpu_backup`` keeps a
        copy); level 2 releases both and the weights must be reloaded by ``update_weights``.

        Raises:
            InvalidRequestError: a level other than 1 or 2, or a server launched here without
                ``enable_sleep_mode`` (``--enable-memory-saver``).
        """
        self._check_level(level)
        if not self.options.server_url and not self.options.enable_sleep_mode:
            raise InvalidRequestError(
                "the SGLang server was started without --enable-memory-saver; create the "
                "sglang backend with enable_sleep_mode=true to use sleep/wake_up",
                param="level",
            )
        aborted = await self.abort(None)
        release_weights = level == 2 or self.options.weights_cpu_backup
        tags = ["kv_cache", "weights"] if release_weights else ["kv_cache"]
        answer = await self._call("POST", "/release_memory_occupation", json_body={"tags": tags})
        self._asleep(level, weights=release_weights)
        return {
            "level": level,
            "aborted_requests": aborted,
            "released": tags,
            "kv_cache_bytes_released": None,
            "weight_bytes_released": None,
            "sglang": answer,
        }

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """``/resume_memory_occupation`` for ``tags`` (``weights``/``kv_cache``; default both).

        Only what :meth:`sleep` released is resumed (SGLang refuses to resume memory it holds).
        """
        wanted = self._wake_tags(tags)
        asleep = {"kv_cache"} if self._kv_released else set()
        if self._weights_asleep:
            asleep.add("weights")
        # Weights before the KV cache: SGLang's recommended order.
        resume = [t for t in ("weights", "kv_cache") if t in wanted & asleep]
        answer = None
        if resume:
            answer = await self._call(
                "POST", "/resume_memory_occupation", json_body={"tags": resume}
            )
        if "kv_cache" in resume:
            self._kv_released = False
        if "weights" in resume:
            self._weights_asleep = False
        return {"needs_weights": self._weights_discarded, "resumed": resume, "sglang": answer}

    async def _updating(self, body: Mapping[str, Any], path: str) -> Any:
        """Pause SGLang (retracting running requests), call ``path``, continue."""
        if self._weights_asleep:
            await self._call("POST", "/resume_memory_occupation", json_body={"tags": ["weights"]})
            self._weights_asleep = False
        frozen = await self._engine_call("/pause_generation", json_body={"mode": "retract"})
        try:
            return await self._call("POST", path, json_body=dict(body), timeout=None)
        finally:
            if frozen and not self._paused:
                await self._engine_call("/continue_generation", json_body={})

    async def update_weights(self, path: str, version: int | None = None) -> int:
        """Reload all weights in place from a safetensors directory; return the new version.

        Running requests are retracted while SGLang loads and re-prefilled under the new
        weights after (SGLang flushes its radix cache).
        """
        new_version = self._next_version(version)
        weights = Path(path)
        if not weights.is_dir() or not any(weights.glob("*.safetensors")):
            raise InvalidRequestError(
                f"weights path {str(path)!r} is not a directory holding *.safetensors files",
                param="path",
            )
        path = str(weights.resolve())
        async with self._weights_lock:
            answer = await self._updating(
                {"model_path": path, "weight_version": str(new_version), "flush_cache": True},
                "/update_weights_from_disk",
            )
            logger.info("SGLang reloaded weights from %s: %s", path, answer)
            return self._loaded(new_version)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> Any:
        """Make SGLang's workers join a trainer's process group (``/init_weights_update_group``).

        The trainer is rank 0; SGLang's TP workers take ranks ``rank_offset`` onwards.
        """
        return await self._call(
            "POST",
            "/init_weights_update_group",
            json_body={
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": int(rank_offset),
                "world_size": int(world_size),
                "group_name": group_name,
                "backend": backend,
            },
            timeout=None,
        )

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        version: int | None = None,
        group_name: str = "weight_update_group",
    ) -> int:
        """Receive tensors the trainer broadcasts over the group; return the new version.

        The trainer must broadcast ``names`` (with these ``dtypes``, e.g. ``"bfloat16"``, and
        ``shapes``) from rank 0 while this call is in flight.
        """
        new_version = self._next_version(version)
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidRequestError("names, dtypes and shapes must have the same length")
        async with self._weights_lock:
            await self._updating(
                {
                    "names": list(names),
                    "dtypes": list(dtypes),
                    "shapes": [list(s) for s in shapes],
                    "group_name": group_name,
                    "weight_version": str(new_version),
                    "flush_cache": True,
                },
                "/update_weights_from_distributed",
            )
            return self._loaded(new_version)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Any:
        """Leave the group made by :meth:`init_weights_update_group`."""
        return await self._call(
            "POST", "/destroy_weights_update_group", json_body={"group_name": group_name}
        )

    # ----------------------------------------------------------------------------- stats

    @property
    def _scrapes(self) -> bool:
        return self.options.enable_metrics or bool(self.options.server_url)

    def _read_metrics(self, text: str) -> dict[str, Any]:
        return parse_sglang_metrics(text)

    def _engine_stats(self) -> dict[str, Any]:
        """KV cache in tokens (SGLang has no blocks), cached prompt tokens, retractions."""
        sc = self._scraped
        total = int(sc.get("total_tokens", 0))
        used = int(sc.get("used_tokens", 0)) or int(math.ceil(sc.get("token_usage", 0.0) * total))
        return {
            "kv_cache_blocks_total": total,
            "kv_cache_blocks_used": used,
            "prefix_cache_hit_tokens_total": int(self._counters["cached_tokens"]),
            "preemptions_total": int(sc.get("retractions", 0)),
        }
