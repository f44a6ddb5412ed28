"""A vLLM worker extension: in-place weight reload from a safetensors directory or from memory.

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

Two sources feed that path: ``polyrl_reload_weights(path)`` reads a safetensors directory;
``polyrl_load_shared(layout_json)`` takes the tensors from memory, as described by a *layout*
(made by :func:`polyrl.rollout.vllm_weights.pack_weights`)::

    {"segments": [{"path": "/dev/shm/polyrl-arena-...", "size": int}, ...],
     "tensors": [{"name": str, "dtype": "float32", "shape": [int, ...],
                  "segment": int, "offset": int}                   # bytes in a segment
                 | {"name": str, "dtype": ..., "shape": ...,
                    "cuda_ipc": base64(pickle((rebuild, args))),  # torch's reduce_tensor
                    "device_uuid": str}, ...]}

A segment is a POSIX shared-memory file the polyrl process wrote and keeps until the call
returns; every worker maps it and reads its tensors in place (no copy before the reload's
own). A CUDA tensor travels as a CUDA IPC handle: each worker -- every tensor-parallel rank --
opens the handle itself, on the GPU that holds the memory (found by ``device_uuid``, since the
two processes may number their visible GPUs differently), and the reload copies from it into
its own shard. The handles are pickles: this method trusts its caller, the polyrl process that
started this server (``/collective_rpc`` listens on 127.0.0.1 only).
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import pickle
import time
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "PolyrlWorkerExtension",
    "iter_safetensors_dir",
    "iter_shared",
    "safetensors_files",
    "with_tied_head",
]

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


def with_tied_head(
    items: Iterable[tuple[str, Any]], tie_lm_head: bool
) -> Iterator[tuple[str, Any]]:
    """Yield ``items``, then (tied, no ``lm_head.weight`` among them) the embedding as the head.

    HF drops the tied copy when saving (and polyrl's senders skip it): vLLM's CPU path keeps a
    separately packed copy of the output head, which would otherwise stay stale.
    """
    embed = None
    saw_head = False
    for name, tensor in items:
        if name == _LM_HEAD:
            saw_head = True
        elif name in _EMBED_NAMES:
            embed = tensor
        yield name, tensor
    if tie_lm_head and not saw_head and embed is not None:
        yield _LM_HEAD, embed


def iter_safetensors_dir(path: str, tie_lm_head: bool) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` for every tensor of a safetensors model directory.

    The tied output head is handled as in :func:`with_tied_head`.
    """
    from safetensors import safe_open

    def tensors() -> Iterator[tuple[str, Any]]:
        for file in safetensors_files(path):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    yield from with_tied_head(tensors(), tie_lm_head)


def _local_cuda_index(uuid: str | None, fallback: int) -> int:
    """Return this process's index of the GPU with UUID ``uuid`` (``fallback`` if unknown)."""
    import torch

    if uuid:
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == uuid:
                return i
        raise RuntimeError(
            f"a CUDA IPC weight lives on GPU {uuid}, which this vLLM worker cannot see "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"
        )
    return fallback


def open_cuda_ipc(handle: str, device_uuid: str | None = None) -> Any:
    """Rebuild a CUDA tensor from ``base64(pickle((rebuild, args)))`` of ``reduce_tensor``."""
    rebuild, args = pickle.loads(base64.b64decode(handle))  # noqa: S301 - our own parent's
    args = list(args)
    # torch's rebuild_cuda_tensor takes the storage's device index at position 6; the sender
    # and this worker may number the GPUs differently (CUDA_VISIBLE_DEVICES), the UUID not.
    if len(args) > 6 and isinstance(args[6], int) and not isinstance(args[6], bool):
        args[6] = _local_cuda_index(device_uuid, args[6])
    return rebuild(*args)


def iter_shared(layout: dict[str, Any], tie_lm_head: bool) -> Iterator[tuple[str, Any]]:
    """Yield ``(name, tensor)`` for every tensor of a layout (see the module doc), in order.

    Segment tensors are views of the mapped files (no copy). A mapping is never closed here:
    ``torch.frombuffer`` views keep its object alive, and it is unmapped when the last view
    (one the model kept, say) is gone -- closing it earlier would leave them dangling. The
    tied output head is handled as in :func:`with_tied_head`.
    """
    import torch

    views: list[Any] = []
    for seg in layout.get("segments", ()):
        size = int(seg["size"])
        fd = os.open(str(seg["path"]), os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED) if size else None
        finally:
            os.close(fd)
        views.append(
            None if mapping is None else torch.frombuffer(mapping, dtype=torch.uint8, count=size)
        )

    def tensors() -> Iterator[tuple[str, Any]]:
        for entry in layout["tensors"]:
            name = str(entry["name"])
            dtype = getattr(torch, str(entry["dtype"]))
            shape = [int(d) for d in entry["shape"]]
            if "cuda_ipc" in entry:
                tensor = open_cuda_ipc(str(entry["cuda_ipc"]), entry.get("device_uuid"))
                yield name, tensor.view(dtype).view(shape)
                continue
            numel = 1
            for d in shape:
                numel *= d
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            start = int(entry["offset"])
            flat = views[int(entry["segment"])]
            if flat is None or start < 0 or start + nbytes > flat.numel():
                raise ValueError(
                    f"tensor {name!r} ({nbytes} bytes at {start}) lies outside its segment"
                )
            yield name, flat[start : start + nbytes].view(dtype).view(shape)

    try:
        yield from with_tied_head(tensors(), tie_lm_head)
    finally:
        views.clear()  # the mappings go with the last view of them


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
        return self._polyrl_reload(lambda tied: iter_safetensors_dir(path, tie_lm_head=tied))

    def polyrl_load_shared(self, layout_json: str) -> dict[str, Any]:
        """Reload every weight in place from memory: shared-memory segments or CUDA IPC handles.

        ``layout_json`` is a layout (see the module doc) as JSON.

        Returns:
            ``{"tensors": count, "tied_lm_head": bool, "seconds": float}``.
        """
        layout = json.loads(layout_json)
        return self._polyrl_reload(lambda tied: iter_shared(layout, tie_lm_head=tied))

    def _polyrl_reload(self, source: Any) -> dict[str, Any]:
        """Feed ``source(tied)``'s ``(name, tensor)`` pairs to the runner's reload path."""
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
            for item in source(tied):
                count += 1
                yield item

        start = time.perf_counter()
        reload(weights_iterator=counted(), is_checkpoint_format=True)
        return {"tensors": count, "tied_lm_head": tied, "seconds": time.perf_counter() - start}
