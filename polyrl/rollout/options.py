"""Command-line options shared by ``polyrl serve`` and the rollout server processes.

Kept free of heavy imports so ``polyrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = [
    "API_KEY_ENV",
    "PARENT_FD_ENV",
    "add_backend_arguments",
    "add_listen_arguments",
    "backend_options",
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
