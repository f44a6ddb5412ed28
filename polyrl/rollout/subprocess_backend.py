"""What the rollout backends that run an inference server as a child process share.

vLLM and SGLang each live in a virtual environment of their own and are reached over HTTP
only. :class:`SubprocessBackend` owns that server: it launches it (in its own process group,
tied to this process, on a free port, retrying when another process takes the port first),
waits for ``/health``, warms it up, maps HTTP failures onto :mod:`polyrl.core.rollout_api`
errors, scrapes ``/metrics`` in the background, keeps the request/token/TTFT counters and the
pause and sleep flags, and stops the whole process group. :class:`StreamJob` is the part of one
in-flight request that does not depend on the server: its delta queue, its counters and the
reading of a server-sent-event stream. :class:`ServerOptions` declares and checks the options
every such backend takes.

A backend subclasses the three and supplies only what differs between servers: the command line
and environment, the model info and warm-up request, the request body and the parsing of its
answers (in its job class), the pause/resume, sleep/wake and weight-update calls, and which
scraped gauges :meth:`~SubprocessBackend.stats` reports.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections import deque
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import Any, ClassVar

import httpx

from polyrl.core.process import free_port, kill_group, spawn_group
from polyrl.core.rollout_api import (
    BackendStats,
    DeltaStream,
    EngineUnavailableError,
    GenerateRequest,
    InvalidRequestError,
    ModelInfo,
    RolloutError,
    SampleDelta,
    check_request_fits,
)
from polyrl.rollout.base import check_backend_options

__all__ = [
    "ServerOptions",
    "StreamJob",
    "SubprocessBackend",
    "find_venv",
    "is_pos_int",
    "model_shapes",
    "prometheus_samples",
    "repo_root",
    "value_flags",
    "venv_has",
]

logger = logging.getLogger(__name__)

_TPS_WINDOW_S = 5.0  # generated tokens/s is averaged over this many seconds
_PORT_TRIES = 3
_MEMORY_TAGS = ("kv_cache", "weights")


def repo_root() -> Path:
    """Return the repository this package was loaded from (where the servers' venvs live)."""
    return Path(__file__).resolve().parents[2]


def venv_has(venv: str | os.PathLike[str], pattern: str) -> bool:
    """Whether ``venv`` has an executable ``bin/python`` and a file matching ``pattern``.

    Cheap: a glob for one of the package's files instead of importing it (which takes seconds
    and may need a GPU); ``start()`` reports an install that is there but broken.
    """
    path = Path(venv)
    python = path / "bin" / "python"
    if not (python.exists() and os.access(python, os.X_OK)):
        return False
    return any(path.glob(pattern))


def find_venv(env_var: str, name: str, available: Callable[[Path], bool]) -> Path:
    """Where a server's virtual environment is looked for.

    ``$env_var`` if set; else the first of ``<repo>/name`` and ``./name`` for which
    ``available`` holds; else ``<repo>/name``.
    """
    env = os.environ.get(env_var)
    if env:
        return Path(env).expanduser().resolve()
    candidates = [repo_root() / name, Path.cwd() / name]
    for c in candidates:
        if available(c):
            return c.resolve()
    return candidates[0]


def is_pos_int(value: Any) -> bool:
    """Whether ``value`` is an ``int`` (not a ``bool``) of at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def model_shapes(model_dir: Path) -> dict[str, Any]:
    """Read what a backend needs from ``config.json`` and ``generation_config.json``.

    Returns ``vocab_size``, ``media_tokens`` (placeholder token id by media kind, empty for a
    text model), ``layers``, ``kv_heads``, ``head_dim``, ``dtype``, ``eos`` (sorted tuple of
    ids) and ``max_position``; the text model's values for a multimodal config.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: no usable ``vocab_size``.
    """
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{model_dir} is not a Hugging Face model directory (no config.json)"
        )
    config = json.loads(config_path.read_text())
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads")
    hidden = text.get("hidden_size")
    head_dim = text.get("head_dim") or (hidden // heads if hidden and heads else None)
    eos: set[int] = set()
    gen_path = model_dir / "generation_config.json"
    sources = [config, text]
    if gen_path.is_file():
        sources.append(json.loads(gen_path.read_text()))
    for src in sources:
        value = src.get("eos_token_id")
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(v for v in value if isinstance(v, int))
    vocab = text.get("vocab_size") or config.get("vocab_size")
    if not is_pos_int(vocab):
        raise ValueError(f"{config_path} has no usable vocab_size (got {vocab!r})")
    return {
        "vocab_size": vocab,
        # Placeholder token id by media kind, for a vision-language model's config.
        "media_tokens": {
            kind: config[f"{kind}_token_id"]
            for kind in ("image", "video")
            if is_pos_int(config.get(f"{kind}_token_id"))
        },
        "layers": text.get("num_hidden_layers"),
        "kv_heads": text.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "dtype": text.get("torch_dtype") or text.get("dtype") or config.get("dtype"),
        "eos": tuple(sorted(eos)),
        "max_position": text.get("max_position_embeddings"),
    }


def prometheus_samples(text: str) -> Iterator[tuple[str, str, float]]:
    """Yield ``(name, labels, value)`` for each sample line of Prometheus text.

    ``labels`` is what stands between the braces (``""`` without any); comment lines and
    lines whose value does not parse are skipped.
    """
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        labels = line.partition("{")[2].rpartition("}")[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        yield name, labels, value


def value_flags(pairs: Iterable[tuple[str, Any]]) -> list[str]:
    """Return ``[flag, str(value), ...]`` for the ``(flag, value)`` pairs whose value is set."""
    out: list[str] = []
    for flag, value in pairs:
        if value is not None:
            out += [flag, str(value)]
    return out


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """The options every subprocess backend takes, checked on construction.

    Names and meaning are shared with the native engine's options (``polyrl serve --backend
    B --dtype bfloat16 --max-num-seqs 64 ...`` works for every ``B``); each backend's
    subclass documents what they become for its server, may change a default and adds its
    own. The ``_``-prefixed class attributes tell the checks what the subclass adds.
    """

    dtype: str = "auto"
    device: str = "cuda"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_tokens: int | None = None
    seed: int | None = None
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    enable_sleep_mode: bool = False
    enforce_eager: bool = False
    startup_timeout: float = 600.0
    warmup: bool = True
    log_path: str | None = None
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    metrics_interval: float = 1.0
    buffered_stream_interval: int = 16

    #: The backend's registered name, for messages.
    _backend: ClassVar[str] = "subprocess"
    #: The accepted ``dtype`` values, and the ``device`` values as the error message lists them.
    _dtypes: ClassVar[Collection[str]] = ()
    _devices: ClassVar[str] = "'cuda', 'cuda:<index>' or 'cpu'"
    #: The subclass's options that are an int >= 1 or ``None``, true/false, seconds > 0.
    _counts: ClassVar[tuple[str, ...]] = ()
    _flags: ClassVar[tuple[str, ...]] = ()
    _durations: ClassVar[tuple[str, ...]] = ()

    def _bad(self, name: str, expected: str) -> ValueError:
        value = getattr(self, name)
        return ValueError(
            f"invalid {self._backend} backend option {name}={value!r}: expected {expected}"
        )

    def __post_init__(self) -> None:
        bad = self._bad
        if self.dtype not in self._dtypes:
            raise bad("dtype", f"one of {', '.join(self._dtypes)}")
        if not isinstance(self.device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise bad("device", self._devices)
        counts = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens")
        for name in (*counts, *self._counts):
            value = getattr(self, name)
            if value is not None and not is_pos_int(value):
                raise bad(name, "an int >= 1 (or None for the default)")
        for name in ("tensor_parallel_size", "buffered_stream_interval"):
            if not is_pos_int(getattr(self, name)):
                raise bad(name, "an int >= 1")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0
        ):
            raise bad("seed", "an int >= 0 or None")
        flags = ("enable_prefix_caching", "trust_remote_code", "enable_sleep_mode", "enforce_eager")
        for name in (*flags, "warmup", *self._flags):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false")
        for name in ("startup_timeout", "metrics_interval", *self._durations):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise bad(name, "a number of seconds > 0")
        if isinstance(self.extra_args, str) or not all(isinstance(a, str) for a in self.extra_args):
            raise bad("extra_args", "a list of command-line strings")
        if not isinstance(self.env, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()
        ):
            raise bad("env", "a mapping of strings to strings")

    def _check_fraction(self, name: str, expected: str, *, one: bool) -> None:
        """Check that ``name`` is ``None`` or a fraction in (0, 1], or in (0, 1) unless ``one``."""
        value = getattr(self, name)
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (0 < value <= 1 if one else 0 < value < 1)
        ):
            raise self._bad(name, expected)


class StreamJob(abc.ABC):
    """One request in flight at a server: the server-independent half.

    A backend's job class adds ``samples`` (objects with a ``finished`` flag), ``start()``
    and ``cancel()``; this keeps the delta queue the caller reads, whether the request has
    reached the server (``sent``), and the backend's counters for it.
    """

    samples: Sequence[Any]

    def __init__(
        self, backend: SubprocessBackend, request: GenerateRequest, max_new: int, stream: bool
    ):
        self.backend = backend
        self.request = request
        self.max_new = max_new
        self.stream = stream
        self.inbox: asyncio.Queue[list[SampleDelta] | BaseException] = asyncio.Queue()
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.sent = False

    @property
    def unfinished(self) -> int:
        """How many samples have not finished."""
        return sum(not s.finished for s in self.samples)

    @abc.abstractmethod
    def start(self) -> None:
        """Start the task(s) that send the request and stream its answer."""

    @abc.abstractmethod
    async def cancel(self) -> None:
        """Abort: end the unfinished samples with ``abort``."""

    async def _admit(self) -> httpx.AsyncClient:
        """Wait out a pause, then return the client; the first call counts the prompt."""
        b = self.backend
        await b._gate.wait()
        b._check_serving()
        client = b._http()
        if not self.sent:
            self.sent = True
            b._counters["prompt_tokens"] += len(self.request.prompt_ids)
        return client

    async def _chunks(
        self, client: httpx.AsyncClient, path: str, body: Mapping[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """POST ``body`` to ``path`` and yield the JSON of each ``data:`` event until ``[DONE]``.

        Raises:
            InvalidRequestError: the server refused the request (4xx).
            RolloutError: a server error, or an event carrying ``error``.
        """
        b = self.backend
        async with client.stream("POST", path, json=body, timeout=httpx.Timeout(None)) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                raise b._server_error(resp.status_code, text)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise b._server_error(500, json.dumps(chunk))
                yield chunk

    def _failure(self, exc: Exception) -> Exception:
        """Return the error the caller gets for ``exc`` (a dead server named as such)."""
        if isinstance(exc, httpx.HTTPError | json.JSONDecodeError):
            return self.backend._transport_error(exc)
        return exc

    def _count_tokens(self, n: int) -> None:
        """Count ``n`` new tokens (the first of the request also times its TTFT)."""
        b = self.backend
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
            b._counters["ttft_sum"] += self.first_token_at - self.submitted
            b._counters["ttft_count"] += 1
        now = time.perf_counter()
        b._counters["generated_tokens"] += n
        b._tps.append((now, n))
        while b._tps and now - b._tps[0][0] > _TPS_WINDOW_S:
            b._tps.popleft()

    def _count_finish(self, reason: str) -> None:
        self.backend._finished[reason] = self.backend._finished.get(reason, 0) + 1

    def _abort_delta(self, index: int, first_version: int | None, reason: str) -> SampleDelta:
        """Return the closing delta of a streamed sample ended here: no tokens, ``reason``."""
        return SampleDelta(
            index=index,
            token_ids=[],
            logprobs=[] if self.request.params.logprobs else None,
            finish_reason=reason,
            weight_version=self.backend._weight_version,
            first_weight_version=first_version,
        )


class SubprocessBackend(abc.ABC):
    """A rollout backend whose engine is an inference server running as a child process.

    Implements the :class:`~polyrl.core.rollout_api.RolloutBackend` methods that do not
    depend on the server (``start``, ``shutdown``, ``generate``'s checks, ``abort``,
    ``pause``/``resume``'s gate, ``stats``) on top of the hooks a subclass overrides; see
    the module docstring. ``options`` is the backend's options dataclass; the base reads its
    ``startup_timeout``, ``warmup``, ``log_path`` and ``metrics_interval``.

    Args:
        model_dir: local HF model directory (safetensors weights); read here for the vocab
            size and eos ids.
        **options: fields of the backend's :attr:`options_class`; ``extra_args`` may also
            be one string in shell syntax.

    Raises:
        TypeError: an option that is not a field of :attr:`options_class`.
        ValueError: an option with a bad value.
        FileNotFoundError: ``model_dir`` has no ``config.json``.
    """

    #: The backend's registered name ("vllm"), used in messages and temporary names.
    name: ClassVar[str]
    #: The server's name as its project spells it ("vLLM"), used in messages.
    server_name: ClassVar[str]
    #: The dataclass whose fields are this backend's options.
    options_class: ClassVar[type[ServerOptions]]
    #: The backend's checked options (an instance of :attr:`options_class`).
    options: ServerOptions

    def __init__(self, model_dir: str | os.PathLike[str], **options: Any):
        check_backend_options(self.name, self.options_class, options)
        extra = options.get("extra_args")
        if isinstance(extra, str):  # one string in shell syntax, like $POLYRL_<NAME>_ARGS
            options["extra_args"] = tuple(shlex.split(extra))
        elif extra is not None:
            options["extra_args"] = tuple(extra)
        self.model_dir = Path(model_dir).expanduser().resolve()
        self.options = self.options_class(**{k: v for k, v in options.items() if v is not None})
        self._shapes = model_shapes(self.model_dir)
        self.venv = self._find_venv()
        self.url: str | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self.warmup_seconds: float | None = None
        self._info: ModelInfo | None = None
        self._client: httpx.AsyncClient | None = None
        self._tmp: str | None = None
        self._log_path: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self._poller: asyncio.Task[None] | None = None
        self._jobs: dict[str, StreamJob] = {}
        self._gate = asyncio.Event()
        self._gate.set()
        self._paused = False
        self._kv_released = False
        self._weights_asleep = False
        self._weights_discarded = False
        self._stopping = False
        self._weight_version = 0
        self._weights_lock = asyncio.Lock()
        self._engine_pause = True  # whether the server's pause endpoint answered
        self._keep_log = False
        self._counters: dict[str, float] = {
            "prompt_tokens": 0,
            "generated_tokens": 0,
            "cached_tokens": 0,
            "ttft_sum": 0.0,
            "ttft_count": 0,
        }
        self._finished: dict[str, int] = {}
        self._tps: deque[tuple[float, int]] = deque()
        self._scraped: dict[str, Any] = {}

    # ------------------------------------------------------------------------------ hooks

    @abc.abstractmethod
    def _find_venv(self) -> Path:
        """Return the server's virtual environment (its ``bin/python`` runs the launch stub)."""

    @abc.abstractmethod
    def command(self, port: int) -> list[str]:
        """Return the server's command line for ``port``."""

    @abc.abstractmethod
    def _launch_environment(self, tmp_dir: str) -> dict[str, str]:
        """Return the launched server's environment (``tmp_dir``: this launch's own folder)."""

    def _check_loadable(self) -> None:  # noqa: B027 - optional hook
        """Raise when the server cannot be launched (no install, a model it cannot run)."""

    def _prepare(self, tmp_dir: str) -> None:  # noqa: B027 - optional hook
        """Put what the server needs into ``tmp_dir`` before it is launched."""

    def _tidy_kept(self, tmp_dir: str) -> None:  # noqa: B027 - optional hook
        """Remove what :meth:`_prepare` wrote from a ``tmp_dir`` kept for its log."""

    async def _connect(self, started: float) -> None:
        """Make the server answer ``/health`` behind ``self._client``: launch it by default."""
        await self._launch(started)

    @abc.abstractmethod
    async def _model_info(self) -> ModelInfo:
        """Return the served model's info, once the server is up."""

    @abc.abstractmethod
    def _warmup_request(self) -> tuple[str, dict[str, Any]]:
        """Return the path and JSON body of a tiny generation request."""

    @abc.abstractmethod
    def _new_job(self, request: GenerateRequest, max_new: int, stream: bool) -> StreamJob:
        """Return the backend's job for ``request`` (not started yet)."""

    def _validate(self, request: GenerateRequest) -> int:
        """Check ``request`` against the model; return its most new tokens."""
        info = self.info
        if request.multi_modal is not None:
            self._check_media(request)
        return check_request_fits(request, info.vocab_size, info.max_model_len)

    def _check_media(self, request: GenerateRequest) -> None:
        """Raise unless the server can be sent ``request``'s images and videos.

        By default it cannot: sending the token ids alone would generate from the
        placeholders' text embeddings, silently wrong.
        """
        raise InvalidRequestError(
            f"the {self.info.backend} backend takes no images or videos with token-id prompts "
            "over its server's HTTP API; use the native backend for vision models",
            param="multi_modal",
            code="images_not_supported",
        )

    def _check_answer(self, path: str, answer: Any) -> None:  # noqa: B027 - optional hook
        """Raise for a 200 answer of a control call that still says it failed."""

    async def _pause_engine(self) -> None:  # noqa: B027 - optional hook
        """Freeze the server's in-flight requests (the gate already holds new ones)."""

    async def _resume_engine(self) -> None:  # noqa: B027 - optional hook
        """Undo :meth:`_pause_engine`."""

    @property
    def _scrapes(self) -> bool:
        """Whether the server serves ``/metrics``."""
        return True

    @abc.abstractmethod
    def _read_metrics(self, text: str) -> dict[str, Any]:
        """Pick the gauges :meth:`stats` reports out of the server's Prometheus text."""

    def _engine_stats(self) -> dict[str, Any]:
        """Return the :class:`BackendStats` fields read from the last scrape (KV cache, ...)."""
        return {}

    # ----------------------------------------------------------------------------- basics

    @property
    def info(self) -> ModelInfo:
        """The served model (``max_model_len`` as the server reports it)."""
        if self._info is None:
            raise RuntimeError(f"the {self.name} backend is not started; await start() first")
        return self._info

    @property
    def weight_version(self) -> int:
        """Version of the weights in use."""
        return self._weight_version

    def log_tail(self, chars: int = 4000) -> str:
        """Return the end of the server's log (empty for a server not launched here)."""
        if self._log_path is None:
            return ""
        try:
            return self._log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError(f"the {self.name} backend is not started; await start() first")
        return self._client

    def _exited(self) -> EngineUnavailableError | None:
        if self.process is not None and self.process.poll() is not None:
            return EngineUnavailableError(
                f"the {self.server_name} server exited with code {self.process.returncode}; "
                f"log tail:\n{self.log_tail(2000)}"
            )
        return None

    def _check_serving(self) -> None:
        if self._stopping:
            raise EngineUnavailableError(f"the {self.name} backend is shutting down")
        exited = self._exited()
        if exited is not None:
            raise exited

    def _server_error(self, status: int, text: str) -> RolloutError:
        """Map an HTTP error answer: 4xx is the caller's fault, anything else the server's."""
        message = text
        with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
            body = json.loads(text)
            err = body.get("error", body)
            if isinstance(err, dict):
                message = err.get("message") or body.get("message") or body.get("detail") or text
            else:
                message = str(err)
        name = self.server_name
        if 400 <= status < 500:
            return InvalidRequestError(f"{name} rejected the request: {message}")
        self._keep_log = True
        where = f" ({name}'s log: {self._log_path})" if self._log_path else ""
        return RolloutError(f"{name} server error (HTTP {status}): {message}{where}")

    def _transport_error(self, exc: BaseException) -> RolloutError:
        self._keep_log = True
        exited = self._exited()
        if exited is not None:
            return exited
        return RolloutError(
            f"talking to the {self.server_name} server failed: {type(exc).__name__}: {exc}"
        )

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json_body: Any = None,
        timeout: float | None = 300.0,
    ) -> Any:
        """One control request to the server; returns the decoded JSON body (or ``None``).

        Raises:
            InvalidRequestError: the server answered 4xx (404 for an endpoint it lacks).
            RolloutError: 5xx, a transport failure, or what :meth:`_check_answer` refuses.
        """
        self._check_serving()
        try:
            resp = await self._http().request(
                method, path, params=params, json=json_body, timeout=timeout
            )
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        answer: Any = None
        if resp.content:
            try:
                answer = resp.json()
            except json.JSONDecodeError:
                answer = resp.text
        self._check_answer(path, answer)
        if resp.status_code != 200:
            raise self._server_error(resp.status_code, resp.text)
        return answer

    def _child_environment(self, drop: Collection[str] = ()) -> dict[str, str]:
        """Return this process's environment for the server, less ``drop``, offline, unbuffered.

        The server's venv comes first on ``PATH``; the settings a caller may give (offline
        hubs, no telemetry) are only defaults.
        """
        env = dict(os.environ)
        # The polyrl venv must not leak into the server's interpreter, nor our API key into its env.
        for key in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH", "POLYRL_API_KEY", *drop):
            env.pop(key, None)
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    # --------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Launch the server (or reach one), wait until it answers, warm it up, start scraping.

        A launched server is told to exit when the thread that started it ends
        (``PR_SET_PDEATHSIG``), so call this from a thread that outlives the backend, as an
        event loop's thread does.

        Raises:
            FileNotFoundError: no installation in the venv.
            ValueError: a model the server cannot run (the backend's own checks).
            RuntimeError: the server exited while starting (the message has its log tail).
            TimeoutError: it was not healthy after ``startup_timeout`` seconds.
        """
        if self._client is not None:
            return
        started = time.perf_counter()
        try:
            await self._connect(started)
            self.startup_seconds = time.perf_counter() - started
            self._info = await self._model_info()
            if self.options.warmup:
                t0 = time.perf_counter()
                path, body = self._warmup_request()
                await self._call("POST", path, json_body=body, timeout=self.options.startup_timeout)
                self.warmup_seconds = time.perf_counter() - t0
            await self._scrape()
            self._poller = asyncio.ensure_future(self._poll())
        except BaseException:
            self._keep_log = True
            await self._stop_process()
            raise

    async def _launch(self, started: float) -> None:
        """Launch the server on a free port; try other ports when one was taken meanwhile."""
        self._check_loadable()
        self._tmp = tempfile.mkdtemp(prefix=f"polyrl-{self.name}-")
        self._prepare(self._tmp)
        self._log_path = (
            Path(self.options.log_path)
            if self.options.log_path
            else Path(self._tmp) / f"{self.name}-server.log"
        )
        env = self._launch_environment(self._tmp)
        for attempt in range(_PORT_TRIES):
            port = free_port("127.0.0.1")
            self._spawn(port, env)
            self._new_client(f"http://127.0.0.1:{port}")
            if await self._wait_healthy(started):
                return
            # Lost the race for the port to another process: try another one.
            await self._http().aclose()
            self._client = None
            if attempt == _PORT_TRIES - 1:
                raise RuntimeError(
                    f"{self.server_name} could not bind a port; log tail:\n{self.log_tail()}"
                )

    def _new_client(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(60.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,
        )

    def _spawn(self, port: int, env: dict[str, str]) -> None:
        assert self._log_path is not None
        self.process = spawn_group(
            self.command(port),
            python=self.venv / "bin" / "python",
            log_path=self._log_path,
            env=env,
        )
        # Whatever happens to this object, the server's process group goes with it.
        self._finalizer = weakref.finalize(self, kill_group, self.process.pid, signal.SIGKILL)

    async def _wait_healthy(self, started: float) -> bool:
        """Wait for ``/health``; ``False`` when a launched child died of a port clash."""
        deadline = started + self.options.startup_timeout
        while True:
            if self.process is not None:
                code = self.process.poll()
                if code is not None:
                    tail = self.log_tail()
                    if "Address already in use" in tail:
                        self.process = None
                        return False
                    raise RuntimeError(
                        f"the {self.server_name} server exited with code {code} while starting "
                        f"({self._log_path}); log tail:\n{tail}"
                    )
            with contextlib.suppress(httpx.HTTPError):
                resp = await self._http().get("/health", timeout=5.0)
                if resp.status_code == 200:
                    return True
            if time.perf_counter() > deadline:
                where = self.url if self.process is None else f"log tail:\n{self.log_tail()}"
                raise TimeoutError(
                    f"the {self.server_name} server was not healthy after "
                    f"{self.options.startup_timeout} s; {where}"
                )
            await asyncio.sleep(0.5)

    async def shutdown(self) -> None:
        """Abort in-flight requests and stop a launched server (its whole process group)."""
        if self._stopping:
            return
        with contextlib.suppress(Exception):
            await self.abort(None)
        self._stopping = True
        self._gate.set()
        await self._stop_process()

    async def _stop_process(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
            self._poller = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        proc = self.process
        if proc is not None and proc.poll() is None:
            kill_group(proc.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                kill_group(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait)
        if proc is not None:
            # The server's engine and worker processes share its group; make sure none lingers.
            kill_group(proc.pid, signal.SIGKILL)
        if self._finalizer is not None:
            self._finalizer.detach()
        if proc is not None and proc.returncode not in (0, -signal.SIGTERM, None):
            self._keep_log = True
        if self._tmp is not None:
            if self._keep_log and self.options.log_path is None:
                # Something went wrong: keep the server's log for a post-mortem.
                logger.warning("%s server log kept at %s", self.server_name, self._log_path)
                self._tidy_kept(self._tmp)
            else:
                shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    # -------------------------------------------------------------------------- requests

    async def generate(
        self, request: GenerateRequest, stream: bool = True
    ) -> AsyncIterator[SampleDelta]:
        """Submit ``request`` to the server and return its delta stream.

        Validation errors raise here. Closing the stream (``aclose``) before every sample
        finished aborts the request.

        Raises:
            InvalidRequestError: bad token ids, too long, something the server cannot do,
                duplicate in-flight ``request_id``.
            EngineUnavailableError: asleep, weights discarded, shutting down, server gone.
        """
        self._http()
        self._check_serving()
        if self._kv_released:
            raise EngineUnavailableError(
                "the engine is asleep (KV cache released); call /wake_up first"
            )
        if self._weights_discarded:
            raise EngineUnavailableError(
                "the weights were discarded by sleep(level=2); load new ones with "
                "/update_weights first"
            )
        max_new = self._validate(request)
        if request.request_id in self._jobs:
            raise InvalidRequestError(
                f"request_id {request.request_id!r} is already in flight", param="request_id"
            )
        job = self._new_job(request, max_new, stream)
        self._jobs[request.request_id] = job
        job.start()
        return DeltaStream(request.params.n, cancel=job.cancel, inbox=job.inbox)

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """End in-flight requests (all when ``None``) with ``abort``; returns how many."""
        if request_ids is None:
            jobs = list(self._jobs.values())
        else:
            jobs = [j for i in request_ids if (j := self._jobs.get(i)) is not None]
        await asyncio.gather(*(j.cancel() for j in jobs))
        return len(jobs)

    # --------------------------------------------------------------------------- control

    async def pause(self) -> None:
        """Hold new requests here and freeze in-flight ones in the server."""
        self._gate.clear()
        self._paused = True
        await self._pause_engine()

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        await self._resume_engine()
        self._paused = False
        self._gate.set()

    async def _engine_call(self, path: str, **kwargs: Any) -> bool:
        """POST to an optional endpoint; ``False`` (and no more tries) when the server lacks it.

        For the pause/continue endpoints, which older servers do not have: without them the
        gate alone still holds new requests.
        """
        if not self._engine_pause:
            return False
        try:
            await self._call("POST", path, **kwargs)
        except InvalidRequestError as exc:
            logger.warning(
                "%s has no usable %s (%s); pausing new requests only", self.server_name, path, exc
            )
            self._engine_pause = False
            return False
        return True

    @staticmethod
    def _check_level(level: int) -> None:
        if level not in (1, 2) or isinstance(level, bool):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}", param="level")

    @staticmethod
    def _wake_tags(tags: Collection[str] | None) -> set[str]:
        """Check and return the memory ``wake_up`` is asked to restore (default: all)."""
        wanted = set(_MEMORY_TAGS) if tags is None else set(tags)
        unknown = wanted - set(_MEMORY_TAGS)
        if unknown:
            raise InvalidRequestError(
                f"unknown wake_up tag(s) {sorted(unknown)}; expected 'kv_cache' and/or 'weights'",
                param="tags",
            )
        return wanted

    def _asleep(self, level: int, weights: bool) -> None:
        """Record a sleep: the KV cache released, the weights too if ``weights``."""
        self._kv_released = True
        self._weights_asleep = weights
        if level == 2:
            self._weights_discarded = True

    def _next_version(self, version: int | None) -> int:
        """Check a caller's ``version``; return it, or the next one when it is ``None``."""
        if version is not None and (
            not isinstance(version, int) or isinstance(version, bool) or version < 0
        ):
            raise InvalidRequestError(
                f"version must be an int >= 0, got {version!r}", param="version"
            )
        return self._weight_version + 1 if version is None else version

    def _loaded(self, version: int) -> int:
        """Record that weights of ``version`` now serve; return it."""
        self._weights_discarded = False
        self._weight_version = version
        return version

    # ----------------------------------------------------------------------------- stats

    async def _scrape(self) -> None:
        if not self._scrapes:
            return
        with contextlib.suppress(httpx.HTTPError, RolloutError):
            resp = await self._http().get("/metrics", timeout=10.0)
            if resp.status_code == 200:
                self._scraped = self._read_metrics(resp.text)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.options.metrics_interval)
            if self.process is not None and self.process.poll() is not None:
                return
            await self._scrape()

    def stats(self) -> BackendStats:
        """Counters kept here plus the gauges last scraped from the server."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in self._tps if now - t <= _TPS_WINDOW_S]
        tps = 0.0
        if recent:
            tps = sum(n for _, n in recent) / max(now - recent[0][0], 1e-3)
        in_flight = sum(j.unfinished for j in self._jobs.values() if j.sent)
        gated = sum(j.unfinished for j in self._jobs.values() if not j.sent)
        # The server's queue holds requests that reached it: part of those in flight.
        queued = min(int(self._scraped.get("waiting", 0)), in_flight)
        return BackendStats(
            running=in_flight - queued,
            waiting=gated + queued,
            paused=self._paused,
            sleeping=self._kv_released or self._weights_asleep or self._weights_discarded,
            weight_version=self._weight_version,
            prompt_tokens_total=int(self._counters["prompt_tokens"]),
            generated_tokens_total=int(self._counters["generated_tokens"]),
            generated_tokens_per_s=tps,
            finished_total=dict(self._finished),
            ttft_seconds_sum=float(self._counters["ttft_sum"]),
            ttft_count=int(self._counters["ttft_count"]),
            **self._engine_stats(),
        )
