"""A vLLM worker extension: in-place weight reload from a safetensors directory.

This module runs inside the vLLM server's worker process, in the vLLM virtual environment
(``.venv-vllm``), not in polyrl's. It is therefore self-contained: it imports only the standard
library, ``torch`` and ``safetensors`` (both vLLM dependencies), never ``polyrl``.
:class:`~polyrl.rollout.vllm_backend.VLLMBackend` copies this file into a private directory as
the top-level module ``polyrl_vllm_ext``, puts that directory on the child's ``PYTHONPATH`` and
starts vLLM with ``--worker-extension-cls polyrl_vllm_ext.PolyrlWorkerExtension``; vLLM then
mixes the class into its worker, and the dev-mode ``POST /collective_rpc`` endpoint calls its
methods by name (arguments travel as strings).

Why a worker method and not vLLM's ``load_weights``: on CPU (and with quantised or fused
kernels generally) vLLM repacks linear weights into a kernel layout when the model is loaded.
Copying checkpoint tensors straight into the parameters would scramble them; the model
runner's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)`` path re-runs the
checkpoint-to-kernel processing layer by layer.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["PolyrlWorkerExtension", "iter_safetensors_dir", "safetensors_files"]

_EMBED_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "transformer.wte.weight")
_LM_HEAD = "lm_head.weight"


def safetensors_files(path: str) -> list[str]:
    """Return the ``*.safetensors`` files of a model directory, in a stable order.

    The same rule as :func:`polyrl.models.loader.safetensors_files`, restated because this
    module runs inside vLLM's process, where polyrl is not importable.

    Raises:
        FileNotFoundError: ``path`` is not a directory or holds no safetensors file.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"weights path {path!r} is not a directory")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = sorted(
            os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors")
        )
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in weights directory {path!r}")
    return files


def iter_safetensors_dir(path: str, tie_lm_head: bool) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` for every tensor of a safetensors model directory.

    With ``tie_lm_head`` and no ``lm_head.weight`` in the checkpoint (HF drops the tied copy
    when saving), the input embedding is also yielded as ``lm_head.weight``: vLLM's CPU path
    keeps a separately packed copy of the output head, which otherwise stays stale.
    """
    from safetensors import safe_open

    embed = None
    saw_head = False
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if name == _LM_HEAD:
                    saw_head = True
                elif name in _EMBED_NAMES:
                    embed = tensor
                yield name, tensor
    if tie_lm_head and not saw_head and embed is not None:
        yield _LM_HEAD, embed


class PolyrlWorkerExtension:
    """Methods mixed into vLLM's worker class; called through ``/collective_rpc``.

    Names carry a ``polyrl_`` prefix because vLLM refuses an extension whose attributes clash
    with the worker's own.
    """

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def polyrl_reload_weights(self, path: str) -> dict[str, Any]:
        """Reload every weight in place from the safetensors directory ``path``.

        Returns:
            ``{"tensors": count, "tied_lm_head": bool, "seconds": float}``.
        """
        runner = self.model_runner
        # The worker's own reload_weights wraps the runner's in vLLM's config context.
        reload = getattr(self, "reload_weights", None) or getattr(runner, "reload_weights", None)
        if reload is None:
            raise RuntimeError(
                f"this vLLM's model runner ({type(runner).__name__}) has no reload_weights(); "
                "polyrl needs vLLM >= 0.11 for in-place weight updates"
            )
        hf_config = runner.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        tied = bool(
            getattr(text_config, "tie_word_embeddings", False)
            or getattr(hf_config, "tie_word_embeddings", False)
        )
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in iter_safetensors_dir(path, tie_lm_head=tied):
                count += 1
                yield item

        start = time.perf_counter()
        reload(weights_iterator=counted(), is_checkpoint_format=True)
        return {"tensors": count, "tied_lm_head": tied, "seconds": time.perf_counter() - start}
