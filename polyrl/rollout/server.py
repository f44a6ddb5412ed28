"""The rollout HTTP server: one process per replica, any :class:`RolloutBackend` behind it.

Run ``python -m polyrl.workers.rollout_server MODEL_DIR --port 8000`` (or ``polyrl serve``). It
binds 127.0.0.1 unless told otherwise; with ``POLYRL_API_KEY`` set, every endpoint but ``/health``
wants ``Authorization: Bearer <key>``.

:func:`create_app` assembles the routers of :mod:`polyrl.rollout.routes` and then applies its
``extensions``, functions ``(app, backend)`` that add routes of other services: the rollout
service imports no other one. :mod:`polyrl.workers.rollout_server`, the entry point above (and
what :class:`~polyrl.rollout.launcher.ServerProcess` runs), adds the ``/weights/*`` endpoints of
:mod:`polyrl.weights.server_routes` that way. ``python -m polyrl.rollout.server`` takes the same
flags and serves everything below but those.

Endpoints
---------
``POST /generate``
    Token-in/token-out. Body: ``{"input_ids": [ids] | [[ids], ...], "sampling_params": {...},
    "request_id": str?, "stream": bool?}``; sampling params are the fields of
    :class:`~polyrl.core.rollout_api.SamplingParams`. One prompt answers
    ``{"request_id", "outputs": [{"index", "output_ids", "logprobs", "top_logprobs",
    "finish_reason", "stop_reason", "weight_version", "first_weight_version",
    "cached_prompt_tokens"}], "weight_version", "usage"}``; a list of prompts answers
    ``{"results": [...], "weight_version"}``. With ``stream`` (one prompt), server-sent events
    ``data: {"request_id", "index", "token_ids", "logprobs", "finish_reason", ...}`` end with
    ``data: [DONE]``. A vision model's server also takes ``"images"`` (base64, ``data:``
    URLs, or ``{"path": ...}`` inside ``--allowed-media-dir``) and ``"videos"`` (frame lists)
    with one placeholder token per item in ``input_ids`` (or the expanded runs); the answer
    then carries the expanded ``"prompt_ids"``. Media beyond ``--max-image-pixels``,
    ``--max-video-frames`` or ``--max-media-items``, unreadable, remote, outside the directory,
    or not matching the placeholders get 400, as do media sent to a text model.
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
    OpenAI-compatible; see :mod:`polyrl.rollout.openai_compat`. Chat messages to a vision
    model may hold ``image_url`` parts with ``data:`` URLs (remote URLs get 400).
``GET /health``
    ``{"status": "ok", "model", "backend", "weight_version", "paused", "sleeping", "running",
    "waiting", "max_model_len", "vocab_size", "eos_token_ids"}``.
``GET /metrics``
    Prometheus text format (running/waiting requests, tokens/s, KV-cache use, weight version...).
``POST /pause``, ``POST /resume``
    Stop and restart stepping; in-flight requests stay.
``POST /abort``
    ``{"request_ids": [...]}`` or ``{}`` for all: in-flight requests end with
    ``finish_reason: "abort"`` and the tokens they had.
``POST /sleep`` ``{"level": 1|2}``, ``POST /wake_up`` ``{"tags": ["weights", "kv_cache"]}``
    Release and restore KV-cache (and weight) memory.
``POST /update_weights``
    ``{"path": DIR, "version": int?}``: load a safetensors directory and switch to it between two
    decode steps; answers ``{"weight_version": v}``.

Errors
------
Every error body is ``{"error": {"message", "type", "param", "code"}}``:

* 400 ``invalid_request_error``: malformed JSON (``code: malformed_json``: bad syntax, NaN,
  an integer over 4,300 digits), nesting deeper than ``--max-json-depth``
  (``json_too_deep``), missing/unknown field, wrong type, invalid sampling parameter, unknown
  token id (``code: invalid_token_id``), prompt plus ``max_new_tokens`` longer than the context
  (``code: context_length_exceeded``; a text longer than any prompt that fits is refused
  before tokenizing), more than ``--max-sequences`` prompts x ``n`` (``too_many_sequences``),
  a chat template the server does not allow (``chat_template_not_allowed``), rendering and
  tokenizing past ``--render-timeout`` (``render_timeout``);
* 401 ``authentication_error``: missing or wrong bearer token;
* 404: unknown path; 405: wrong method (with ``Allow``);
* 409: ``request_id`` already in flight (``duplicate_request_id``);
* 413: body over ``--max-body-bytes`` (``body_too_large``);
* 429 ``rate_limit_error`` (``Retry-After: 1``): the prompt tokens (x ``n``) of the requests
  in flight would pass ``--max-queued-tokens``;
* 503 ``service_unavailable``: the engine is asleep or its weights were discarded.

A rejected request never reaches the engine, so it holds no slot or KV block. Every POST body
is described in ``/openapi.json`` (:mod:`polyrl.rollout.schemas`). Chat templates come from
the model or from ``--chat-template NAME=FILE`` (a request may name one); a request's own
template is refused unless ``--allow-request-chat-template``. Templates and the tokenizer run
in worker threads, so ``/health`` answers while a long prompt is prepared. Binding beyond
loopback needs ``POLYRL_API_KEY`` or ``--insecure``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI

from polyrl.core.http import serve_app
from polyrl.core.http_guard import BodyLimit, exposure_problem, insecure_warning, is_loopback
from polyrl.core.rollout_api import RolloutBackend
from polyrl.rollout.base import create_backend
from polyrl.rollout.openai_compat import PromptPolicy
from polyrl.rollout.options import (
    API_KEY_ENV,
    PARENT_FD_ENV,
    ServerLimits,
    add_backend_arguments,
    add_limit_arguments,
    add_listen_arguments,
    api_key_from_env,
    backend_options,
    limits_from_args,
)
from polyrl.rollout.routes.admin import admin_router
from polyrl.rollout.routes.common import BearerAuth, RenderPool, RequestTable, add_error_handlers
from polyrl.rollout.routes.generation import generation_router
from polyrl.rollout.routes.openai import openai_router

__all__ = [
    "AppExtension",
    "build_parser",
    "check_exposure",
    "create_app",
    "main",
    "serve",
    "watch_parent",
]

logger = logging.getLogger(__name__)

AppExtension = Callable[[FastAPI, RolloutBackend], Any]
"""Adds routes (or state) to the app of a backend: ``extension(app, backend)``; what it
returns is ignored. :func:`polyrl.weights.server_routes.register_weight_routes` is one."""


def create_app(
    backend: RolloutBackend,
    tokenizer: Any,
    api_key: str | None = None,
    manage_backend: bool = True,
    extensions: Sequence[AppExtension] = (),
    limits: ServerLimits | None = None,
    model_dir: str | None = None,
    vision: Any = None,
) -> FastAPI:
    """Build the FastAPI app serving ``backend``: the routers of :mod:`polyrl.rollout.routes`.

    Args:
        backend: the engine (started and stopped with the app when ``manage_backend``).
        tokenizer: the model's tokenizer (chat templates, text in and out).
        api_key: bearer token wanted on every endpoint but ``/health``; ``None`` = open.
        manage_backend: start the backend on app start-up and shut it down on exit.
        extensions: called as ``extension(app, backend)`` in order once the rollout routes are
            in, to add other services' routes (the bearer token guards them too).
        limits: what requests may ask for (body size, nesting, sequences, queued tokens,
            chat templates); default :class:`~polyrl.rollout.options.ServerLimits`.
        model_dir: the model's directory, reported as ``root`` by ``/v1/models`` (behind
            ``api_key`` like every route but ``/health``).
        vision: the model's :class:`~polyrl.models.processor.VisionProcessor` (vision models:
            ``/generate`` then takes ``images``/``videos`` and chat messages image parts);
            ``None`` refuses media with 400.

    Raises:
        ValueError: an allow-listed chat template file cannot be read.
    """
    limits = limits or ServerLimits()
    policy = PromptPolicy(
        templates=limits.load_templates(),
        allow_request_templates=limits.allow_request_chat_template,
    )
    renderer = RenderPool(limits.render_threads, limits.render_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_backend:
            await backend.start()
        try:
            yield
        finally:
            if manage_backend:
                await backend.shutdown()
            renderer.close()

    app = FastAPI(title="polyrl rollout server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.limits = limits
    add_error_handlers(app)
    if api_key is not None:
        app.add_middleware(BearerAuth, api_key=api_key)
    # Outermost: a body over the limit is refused before anything (auth included) reads it.
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    # One table for both: /abort ends /generate and OpenAI requests alike.
    table = RequestTable(backend, limits)
    for router in (
        admin_router(backend),
        openai_router(
            backend, tokenizer, table, renderer, policy, model_dir=model_dir, vision=vision
        ),
        generation_router(backend, table, vision=vision, renderer=renderer, limits=limits),
    ):
        # The routes go into the app's own table: app.include_router would keep each router as
        # one more level that every request is matched through, ~10 us of event-loop time per
        # request (so of the GIL the engine thread needs) on FastAPI 0.165.
        app.router.routes.extend(router.routes)
    for extend in extensions:
        extend(app, backend)
    return app


def serve(
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: str = "native",
    api_key: str | None = None,
    ready_file: str | None = None,
    log_level: str = "warning",
    on_ready: Callable[[str], None] | None = None,
    extensions: Sequence[AppExtension] = (),
    limits: ServerLimits | None = None,
    insecure: bool = False,
    **options: Any,
) -> None:
    """Serve ``model_dir`` until interrupted (SIGINT/SIGTERM shut down gracefully).

    Args:
        model_dir: local HF model directory.
        host: address to bind.
        port: port to bind (0 picks a free one; see ``ready_file``).
        backend: registered backend name.
        api_key: bearer token required on every endpoint but ``/health``.
        ready_file: where to write ``{"url", "pid"}`` once requests are accepted.
        log_level: uvicorn log level.
        on_ready: called with the URL once requests are accepted.
        extensions: passed to :func:`create_app`.
        limits: passed to :func:`create_app`.
        insecure: allow a non-loopback ``host`` without ``api_key`` (a warning is printed).
        **options: backend options (for ``native``: :class:`EngineConfig` fields).

    Raises:
        ValueError: ``host`` is beyond loopback, with no ``api_key`` and not ``insecure``.
    """
    from polyrl.models.loader import load_tokenizer
    from polyrl.models.processor import load_vision_processor

    check_exposure(host, api_key, insecure)
    limits = limits or ServerLimits()
    engine = create_backend(backend, model_dir, **options)
    tokenizer = load_tokenizer(model_dir, trust_remote_code=bool(options.get("trust_remote_code")))
    vision = load_vision_processor(model_dir, tokenizer=tokenizer, limits=limits.media_limits())
    app = create_app(
        engine,
        tokenizer,
        api_key=api_key,
        extensions=extensions,
        limits=limits,
        model_dir=os.path.abspath(model_dir),
        vision=vision,
    )
    asyncio.run(serve_app(app, host, port, ready_file, log_level, on_ready))


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    """Refuse (``ValueError``) a non-loopback ``host`` without a key unless ``insecure``.

    With ``insecure`` and no key, print a warning on stderr instead.
    """
    problem = exposure_problem(host, bool(api_key), insecure, f"set {API_KEY_ENV}")
    if problem is not None:
        raise ValueError(problem)
    if insecure and not api_key and not is_loopback(host):
        print(insecure_warning(host, "the rollout server"), file=sys.stderr, flush=True)


def build_parser(prog: str = "python -m polyrl.rollout.server") -> argparse.ArgumentParser:
    """Build the parser of a rollout server process (``prog`` names it in ``--help``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve one rollout replica over HTTP (see polyrl.rollout.server).",
    )
    add_listen_arguments(parser)
    add_backend_arguments(parser)
    add_limit_arguments(parser)
    return parser


def watch_parent(fd: int) -> threading.Thread:
    """Shut this process down gracefully (SIGTERM to itself) once ``fd`` reads end-of-file.

    ``fd`` is the read end of a pipe whose write end only the parent holds: when the parent
    dies, however it dies, the kernel closes that end. (``PR_SET_PDEATHSIG`` would fire when
    the *thread* that spawned the child exits, which kills replicas started from worker threads.)
    """

    def wait() -> None:
        try:
            while os.read(fd, 4096):
                pass
        except OSError:
            pass
        logger.warning("parent process is gone: shutting down")
        os.kill(os.getpid(), signal.SIGTERM)
        # A signal that lands before the server installs its handlers is ignored (see
        # serve_app): do not outlive the parent by more than a grace period regardless.
        threading.Event().wait(30.0)
        os._exit(0)

    thread = threading.Thread(target=wait, name="polyrl-parent-watch", daemon=True)
    thread.start()
    return thread


def main(
    argv: Sequence[str] | None = None,
    *,
    extensions: Sequence[AppExtension] = (),
    prog: str = "python -m polyrl.rollout.server",
) -> int:
    """Run a rollout server process; return the exit code.

    The entry point of ``python -m polyrl.rollout.server`` (no extensions) and, with the weight
    routes, of :mod:`polyrl.workers.rollout_server`.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``); see :func:`build_parser`.
        extensions: passed to :func:`create_app`.
        prog: the program name shown in ``--help`` and usage errors.
    """
    args = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    parent_fd = os.environ.pop(PARENT_FD_ENV, None)
    if parent_fd:
        watch_parent(int(parent_fd))
    try:
        serve(
            args.model_dir,
            host=args.host,
            port=args.port,
            backend=args.backend,
            api_key=api_key_from_env(),
            ready_file=args.ready_file,
            log_level=args.log_level,
            extensions=extensions,
            limits=limits_from_args(args),
            insecure=args.insecure,
            **backend_options(args),
        )
    except (ValueError, TypeError, FileNotFoundError, NotADirectoryError, OSError) as exc:
        print(f"polyrl serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
