"""Command-line options shared by ``polyrl serve`` and the rollout server processes.

Kept free of heavy imports so ``polyrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polyrl.core.multimodal import MediaLimits

__all__ = [
    "API_KEY_ENV",
    "PARENT_FD_ENV",
    "ServerLimits",
    "add_backend_arguments",
    "add_limit_arguments",
    "add_listen_arguments",
    "backend_options",
    "limits_from_args",
]

#: Environment variable holding the bearer token (kept out of argv, where ``ps`` shows it).
API_KEY_ENV = "POLYRL_API_KEY"

#: Environment variable naming the read end of a pipe whose other end the parent holds: a replica
#: started by :class:`~polyrl.rollout.launcher.ServerProcess` shuts down when it reads EOF there,
#: so a parent killed without cleanup (SIGKILL, OOM) leaves no orphan server behind.
PARENT_FD_ENV = "POLYRL_PARENT_FD"

# (flag, engine option, type, help); only flags given on the command line reach the backend.
_BACKEND_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--dtype", "dtype", str, "weights and KV-cache dtype: float32 (default), bfloat16, float16"),
    ("--device", "device", str, "cpu (default) or cuda[:i]"),
    (
        "--matmul-dtype",
        "matmul_dtype",
        str,
        "dtype of the decoder layers' projection matmuls (default: --dtype); bfloat16 over "
        "float32 weights keeps norms, attention and the KV cache in float32",
    ),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences decoding at once (default 256)"),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        int,
        "most tokens per engine step, prefill chunks included (default 2048)",
    ),
    ("--kv-cache-tokens", "kv_cache_tokens", int, "KV-cache token budget (default 131072)"),
    ("--block-size", "block_size", int, "tokens per KV-cache block (default 16)"),
    ("--max-model-len", "max_model_len", int, "longest prompt + output (default: the model's)"),
    ("--seed", "seed", int, "seed for requests that bring none (default 0)"),
    ("--threads", "num_threads", int, "torch threads of each replica (default: cores/replicas)"),
    ("--served-model-name", "served_model_name", str, "model name reported to clients"),
)


def add_listen_arguments(parser: argparse.ArgumentParser, default_port: int = 8000) -> None:
    """Add ``MODEL_DIR``, ``--host``, ``--port``, ``--backend`` and ``--ready-file``."""
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="local Hugging Face model directory")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=default_port, help=f"port (default {default_port}; 0 = any)"
    )
    parser.add_argument(
        "--backend",
        default="native",
        help="inference backend: native (default), vllm or sglang",
    )
    parser.add_argument(
        "--ready-file",
        default=None,
        help="write {'url': ..., 'pid': ...} as JSON here once the server accepts requests",
    )
    parser.add_argument(
        "--log-level", default="warning", help="uvicorn log level (default warning)"
    )


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one rollout server (or router) accepts from its clients.

    Attributes:
        max_body_bytes: largest request body; larger ones get 413.
        max_json_depth: deepest nesting of arrays/objects in a body; deeper ones get 400.
        max_sequences: most sequences one request may ask for (prompts x ``n``); 400 above.
        max_queued_tokens: most prompt tokens (counted once per sample: prompt length x
            ``n``) held by the requests in flight; a request that would go over gets 429.
        render_timeout: seconds a chat template and the tokenizer may take on one request's
            prompt (they run off the event loop); 400 ``render_timeout`` past it.
        render_threads: threads that render and tokenize prompts.
        allow_request_chat_template: accept a Jinja template from the request
            (``chat_template_kwargs.chat_template``). Off by default: a template is code the
            server runs; with it off a request may only *name* a template of the model or of
            ``chat_templates``.
        chat_templates: name -> template file, the templates a request may name.
        allowed_media_dir: the directory images sent as ``{"path": ...}`` must lie in
            (``None``: paths are refused; images come as base64 or ``data:`` URLs).
        max_image_pixels: most pixels (width x height, read from the header) of one image.
        max_video_frames: most frames of one video.
        max_media_items: most images plus videos in one prompt.
    """

    max_body_bytes: int = 8 << 20
    max_json_depth: int = 64
    max_sequences: int = 1024
    max_queued_tokens: int = 1 << 22
    render_timeout: float = 10.0
    render_threads: int = 2
    allow_request_chat_template: bool = False
    chat_templates: Mapping[str, str] = dataclasses.field(default_factory=dict)
    allowed_media_dir: str | None = None
    max_image_pixels: int = 4096 * 4096
    max_video_frames: int = 256
    max_media_items: int = 64

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_json_depth",
            "max_sequences",
            "max_queued_tokens",
            "max_image_pixels",
            "max_video_frames",
            "max_media_items",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.render_threads, int) or self.render_threads < 1:
            raise ValueError(f"render_threads must be an int >= 1, got {self.render_threads!r}")
        if not isinstance(self.render_timeout, int | float) or not self.render_timeout > 0:
            raise ValueError(f"render_timeout must be > 0 seconds, got {self.render_timeout!r}")

    def load_templates(self) -> dict[str, str]:
        """Read the allow-listed template files.

        Raises:
            ValueError: a file cannot be read.
        """
        out = {}
        for name, path in self.chat_templates.items():
            try:
                with open(path, encoding="utf-8") as f:
                    out[name] = f.read()
            except OSError as exc:
                raise ValueError(f"--chat-template {name}={path}: cannot read it: {exc}") from exc
        return out

    def to_args(self) -> list[str]:
        """Return the command-line flags that give a server process these limits."""
        default = ServerLimits()
        args: list[str] = []
        for flag, name in _LIMIT_FLAGS:
            value = getattr(self, name)
            if value != getattr(default, name):
                args += [flag, str(value)]
        if self.allow_request_chat_template:
            args.append("--allow-request-chat-template")
        for name, path in self.chat_templates.items():
            args += ["--chat-template", f"{name}={path}"]
        if self.allowed_media_dir is not None:
            args += ["--allowed-media-dir", str(self.allowed_media_dir)]
        return args

    def media_limits(self) -> MediaLimits:
        """Return the bounds on decoded media these limits set."""
        from polyrl.core.multimodal import MediaLimits  # torch: not at import (polyrl --help)

        return MediaLimits(
            max_image_pixels=self.max_image_pixels,
            max_items=self.max_media_items,
            max_video_frames=self.max_video_frames,
        )


_LIMIT_FLAGS = (
    ("--max-body-bytes", "max_body_bytes"),
    ("--max-json-depth", "max_json_depth"),
    ("--max-sequences", "max_sequences"),
    ("--max-queued-tokens", "max_queued_tokens"),
    ("--render-timeout", "render_timeout"),
    ("--render-threads", "render_threads"),
    ("--max-image-pixels", "max_image_pixels"),
    ("--max-video-frames", "max_video_frames"),
    ("--max-media-items", "max_media_items"),
)


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the request limits of :class:`ServerLimits` and ``--insecure``."""
    d = ServerLimits()
    group = parser.add_argument_group("request limits")
    group.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help=f"largest request body in bytes; larger get 413 (default {d.max_body_bytes})",
    )
    group.add_argument(
        "--max-json-depth",
        type=int,
        default=d.max_json_depth,
        help=f"deepest JSON nesting in a body (default {d.max_json_depth})",
    )
    group.add_argument(
        "--max-sequences",
        type=int,
        default=d.max_sequences,
        help=f"most sequences (prompts x n) per request (default {d.max_sequences})",
    )
    group.add_argument(
        "--max-queued-tokens",
        type=int,
        default=d.max_queued_tokens,
        help="most prompt tokens (x n) of the requests in flight; beyond it requests get 429 "
        f"(default {d.max_queued_tokens})",
    )
    group.add_argument(
        "--render-timeout",
        type=float,
        default=d.render_timeout,
        help=f"seconds to render and tokenize one prompt (default {d.render_timeout:g})",
    )
    group.add_argument(
        "--render-threads",
        type=int,
        default=d.render_threads,
        help=f"threads rendering and tokenizing prompts (default {d.render_threads})",
    )
    group.add_argument(
        "--max-image-pixels",
        type=int,
        default=d.max_image_pixels,
        help=f"most pixels of one image (default {d.max_image_pixels})",
    )
    group.add_argument(
        "--max-video-frames",
        type=int,
        default=d.max_video_frames,
        help=f"most frames of one video (default {d.max_video_frames})",
    )
    group.add_argument(
        "--max-media-items",
        type=int,
        default=d.max_media_items,
        help=f"most images plus videos in one prompt (default {d.max_media_items})",
    )
    group.add_argument(
        "--allowed-media-dir",
        default=None,
        metavar="DIR",
        help="accept images sent as {'path': ...} inside DIR (default: no paths)",
    )
    group.add_argument(
        "--chat-template",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="allow requests to name this Jinja chat template "
        "(chat_template_kwargs.chat_template = NAME); repeatable",
    )
    group.add_argument(
        "--allow-request-chat-template",
        action="store_true",
        help="let requests bring their own Jinja chat template (trusted clients only: a "
        "template is code the server runs)",
    )
    group.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening beyond loopback without an API key (the server is then open "
        "to anyone who can reach it)",
    )


def limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """Build :class:`ServerLimits` from :func:`add_limit_arguments`' flags.

    Raises:
        ValueError: a bad limit or ``--chat-template`` value.
    """
    templates = {}
    for item in getattr(args, "chat_template", None) or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--chat-template wants NAME=FILE, got {item!r}")
        templates[name] = path
    d = ServerLimits()
    return ServerLimits(
        **{name: getattr(args, name, getattr(d, name)) for _, name in _LIMIT_FLAGS},
        allow_request_chat_template=bool(getattr(args, "allow_request_chat_template", False)),
        chat_templates=templates,
        allowed_media_dir=getattr(args, "allowed_media_dir", None),
    )


def add_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (dtype, budgets, ...) and ``--no-prefix-caching``."""
    group = parser.add_argument_group("engine")
    for flag, dest, typ, text in _BACKEND_FLAGS:
        group.add_argument(flag, dest=dest, type=typ, default=None, help=text)
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=None,
        help="do not reuse KV blocks of shared prompt prefixes",
    )
    group.add_argument(
        "--engine-options",
        default=None,
        metavar="JSON",
        help="backend options as one JSON object of option names (how the trainer's launcher "
        "passes them); the flags above override its entries",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        default=None,
        help="allow modelling code shipped inside the model directory",
    )


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """Return the engine options given on the command line (flags left out are not included).

    ``--engine-options`` gives a JSON object of options; the other flags override its entries.

    Raises:
        ValueError: ``--engine-options`` is not a JSON object.
    """
    options: dict[str, Any] = {}
    raw = getattr(args, "engine_options", None)
    if raw is not None:
        try:
            options = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--engine-options is not valid JSON ({exc}); expected an object"
            ) from None
        if not isinstance(options, dict):
            raise ValueError(
                f"--engine-options must be a JSON object of option names, got {raw[:80]!r}"
            )
    names = [dest for _, dest, _, _ in _BACKEND_FLAGS] + [
        "enable_prefix_caching",
        "trust_remote_code",
    ]
    options.update({n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
    return options


def api_key_from_env() -> str | None:
    """Return the bearer token from :data:`API_KEY_ENV`, or ``None`` when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None
