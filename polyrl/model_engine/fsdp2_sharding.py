"""Sharding a model with FSDP2, and whole Hugging Face-named tensors back out of it.

:func:`shard_model` makes each decoder layer one FSDP unit and the root module another, with
gradients summed (not averaged) over ranks.  :func:`named_full_tensors` and
:func:`adapter_full_tensors` yield what the engine's ``named_tensors`` (weight sync, export) and
``adapter_tensors`` give: one parameter or buffer at a time, gathered from its shards, under the
name a Hugging Face checkpoint uses (no wrapper prefixes; a LoRA layer's frozen weight under its
base name).  The iterators are collective: all ranks must exhaust them, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from polyrl.model_engine.heads import no_split_module_classes
from polyrl.model_engine.lora import LoraLayout, merge_lora_weight
from polyrl.model_engine.vision import vision_info

__all__ = [
    "adapter_full_tensors",
    "build_mesh",
    "clean_name",
    "full_tensor",
    "named_full_tensors",
    "shard_model",
]

# Wrapper prefixes that must not leak into Hugging Face parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def build_mesh(device: torch.device, world: int, fsdp_size: int) -> DeviceMesh:
    """Return the device mesh: shard groups of ``fsdp_size`` ranks, replicated across groups.

    Raises:
        ValueError: ``fsdp_size`` does not divide ``world``.
    """
    if fsdp_size > world or world % fsdp_size:
        raise ValueError(
            f"ParallelismConfig.fsdp_size={fsdp_size} must divide the world size {world}"
        )
    if fsdp_size == world:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return init_device_mesh(
        device.type, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "fsdp")
    )


def shard_model(
    model: torch.nn.Module,
    mesh: DeviceMesh,
    reshard: bool,
    policy: MixedPrecisionPolicy,
    ignored: set[torch.nn.Parameter] | None = None,
) -> None:
    """Shard ``model`` in place: each decoder layer one FSDP unit, then the root module.

    A vision-language model's vision blocks are units too (they are among its no-split module
    classes, or its family names them), and so is the tower's projection (Qwen2-VL's patch
    merger, SmolVLM's connector), so the tower is never gathered whole.

    ``ignored`` parameters stay as they are (expert-parallel shards, which FSDP must not split).
    """
    layer_classes = no_split_module_classes(model)
    kwargs = {"reshard_after_forward": reshard, "mp_policy": policy}
    if ignored:
        kwargs["ignored_params"] = ignored
    family = vision_info(model)
    units = family.shard_units(model) if family is not None else []
    # A no-split module inside a family unit (SmolVLM's vision attention inside its encoder
    # layer) is gathered with that unit, not on its own.
    inside = {id(m) for unit in units for m in unit.modules() if m is not unit}
    for module in list(model.modules()):
        if layer_classes and isinstance(module, layer_classes) and id(module) not in inside:
            fully_shard(module, mesh=mesh, **kwargs)
    for unit in units:
        fully_shard(unit, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # Sum (not average) gradients over ranks: losses are already normalised by
            # mini-batch-wide counts.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def clean_name(name: str) -> str:
    """Return ``name`` without the activation-checkpoint / compile / FSDP wrapper prefixes."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return the whole tensor behind a (maybe sharded) parameter; collective for DTensors."""
    if isinstance(tensor, DTensor):
        # On one rank the local shard is the whole tensor: skip the gather's copy.
        single = tensor.device_mesh.size() == 1
        tensor = tensor.to_local() if single else tensor.full_tensor()
    return tensor.detach()


def _convert(
    tensor: torch.Tensor, dtype: torch.dtype | None, device: torch.device | str | None
) -> torch.Tensor:
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    if device is not None:
        tensor = tensor.to(device)
    return tensor


def named_full_tensors(
    model: torch.nn.Module,
    lora: LoraLayout | None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    merge_adapter: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for the model's parameters and buffers.

    Tied tensors appear once, under their first name.  With a LoRA ``lora`` layout the adapter
    tensors are skipped and an adapted layer's weight is ``W + scale * B @ A`` (or, without
    ``merge_adapter``, the frozen ``W``), under the base model's name.  Floating-point tensors are
    cast to ``dtype``; all are moved to ``device`` (each when given).
    """
    seen: set[int] = set()
    state = model.state_dict(keep_vars=True)
    for raw, tensor in state.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        name = clean_name(raw)
        full: torch.Tensor | None = None
        if lora is not None:
            if lora.is_adapter(name):
                continue
            base = lora.base_of(name)
            if base is not None:
                layer, leaf = base
                name = f"{layer}.{leaf}"
                if merge_adapter and leaf == "weight":
                    # Every rank gathers W, A and B in this same order.
                    a_name, b_name = LoraLayout.adapter_names(raw[: -len(".base_layer.weight")])
                    full = merge_lora_weight(
                        full_tensor(tensor),
                        full_tensor(state[a_name]),
                        full_tensor(state[b_name]),
                        lora.scaling[layer],
                    )
        if full is None:
            full = full_tensor(tensor)
        yield name, _convert(full, dtype, device)


def adapter_full_tensors(
    model: torch.nn.Module,
    lora: LoraLayout,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full_tensor)`` of the LoRA A/B weights, cast and moved as asked."""
    for raw, tensor in model.state_dict(keep_vars=True).items():
        name = clean_name(raw)
        if lora.is_adapter(name):
            yield name, _convert(full_tensor(tensor), dtype, device)
