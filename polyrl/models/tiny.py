"""Tiny random-init causal LMs with a locally trained tokenizer, saved as plain HF directories.

Command line::

    python -m polyrl.models.tiny --arch qwen2 --out /tmp/tiny-qwen2 [--size nano|micro|small]
        [--hidden H --layers L --heads N --kv-heads K --intermediate I --head-dim D
         --vocab-extra E --max-position P --experts X --experts-per-tok T --moe-intermediate M
         --no-tie-embeddings] [--seed S] [--force]

The directory it writes loads with the stock ``AutoModelForCausalLM.from_pretrained(DIR)`` and
``AutoTokenizer.from_pretrained(DIR)`` without network. A ``polyrl_tiny_spec.json`` file
records what was built; asking for the same spec again reuses the directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from polyrl.models.archs import TINY_ARCHS
from polyrl.models.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    GENERIC_TOKENIZER_CLASS,
    IMAGE_PAD_TOKEN,
    PAD_TOKEN,
    SMOLVLM_IMAGE_TOKEN,
    TOKENIZER_VOCAB_SIZE,
    VIDEO_PAD_TOKEN,
    VISION_END_TOKEN,
    VISION_START_TOKEN,
    VISION_TOKENS,
    build_tokenizer,
    save_tokenizer,
    tokenizer_recipe_hash,
)

__all__ = [
    "SPEC_FILE",
    "TINY_ARCHS",
    "TINY_SIZES",
    "VISION_ARCHS",
    "build_tiny_model",
    "count_parameters",
    "main",
    "resolve_tiny_spec",
    "tiny_config",
    "tiny_tokenizer",
]


#: Architectures with a vision tower (built with the vision tokens and an image processor).
VISION_ARCHS: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm")
#: The Qwen-VL architectures (patch-merging tower, M-RoPE, Qwen's vision tokens).
QWEN_VL_ARCHS: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

#: Size presets. Parameter counts (tied embeddings, 1024-token vocabulary, all experts counted):
#: nano ~0.31M, micro ~2.56M, small ~97.5M for every architecture.
TINY_SIZES: dict[str, dict[str, int]] = {
    "nano": {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 256},
    "micro": {"hidden": 192, "layers": 6, "heads": 6, "kv_heads": 2, "intermediate": 512},
    "small": {"hidden": 768, "layers": 12, "heads": 12, "kv_heads": 4, "intermediate": 2816},
}

#: Parameter counts the presets aim at (the tests check they land within 40%).
TINY_TARGET_PARAMS: dict[str, int] = {"nano": 300_000, "micro": 2_500_000, "small": 100_000_000}

SPEC_FILE = "polyrl_tiny_spec.json"
_INIT_LOCK = threading.Lock()
_SPEC_FORMAT = 1

# Defaults for the keys presets do not set; MoE experts split the dense MLP width between them
# so a MoE preset has about the same total parameter count as the dense one.
_DEFAULTS: dict[str, Any] = {
    "head_dim": None,
    "vocab_extra": 0,
    "max_position": 8192,
    "tie_embeddings": True,
    "experts": 4,
    "experts_per_tok": 2,
    "moe_intermediate": None,
    "vision_depth": 2,
    "vision_dim": 64,
    "vision_heads": 4,
    "patch_size": 14,
    "image_size": 56,
    "tile_size": None,
}
_MOE_KEYS = ("experts", "experts_per_tok", "moe_intermediate")
#: The vision tower's keys (vision archs only). qwen2_vl resizes images to about
#: image_size**2 pixels; smolvlm resizes their longest edge to image_size and cuts them into
#: tile_size tiles (patch_size 8, scale factor 2: 4 tokens per 32-pixel tile).
_VISION_KEYS = ("vision_depth", "vision_dim", "vision_heads", "patch_size", "image_size")
_SMOLVLM_DEFAULTS: dict[str, int] = {"patch_size": 8, "image_size": 64, "tile_size": 32}
#: Qwen3-VL's patches are 16 pixels (Qwen2-VL's 14): a 64-pixel image is 2 x 2 merged tokens.
_QWEN3_VL_DEFAULTS: dict[str, int] = {"patch_size": 16, "image_size": 64}
_INT_KEYS = (
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "intermediate",
    "head_dim",
    "vocab_extra",
    "max_position",
    "experts",
    "experts_per_tok",
    "moe_intermediate",
    *_VISION_KEYS,
    "tile_size",
)
OVERRIDE_KEYS: tuple[str, ...] = (*TINY_SIZES["nano"].keys(), *_DEFAULTS.keys())


def resolve_tiny_spec(
    arch: str, size: str = "nano", seed: int = 0, **overrides: Any
) -> dict[str, Any]:
    """Validate the request and return the full spec that determines the built directory.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        size: one of :data:`TINY_SIZES`; explicit ``overrides`` win over the preset.
        seed: seed of the random weight initialisation.
        **overrides: any of ``hidden, layers, heads, kv_heads, intermediate, head_dim,
            vocab_extra, max_position, tie_embeddings`` and, for ``qwen3_moe`` only,
            ``experts, experts_per_tok, moe_intermediate``. ``None`` means "use the preset".

    Raises:
        ValueError: unknown arch, size or override key, or dimensions that do not fit together.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(TINY_ARCHS)}")
    if size not in TINY_SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {', '.join(TINY_SIZES)}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    unknown = sorted(set(overrides) - set(OVERRIDE_KEYS))
    if unknown:
        raise ValueError(
            f"unknown override(s) {unknown}; expected some of {', '.join(OVERRIDE_KEYS)}"
        )
    given = {k: v for k, v in overrides.items() if v is not None}
    if arch != "qwen3_moe":
        moe_given = sorted(k for k in _MOE_KEYS if k in given)
        if moe_given:
            raise ValueError(f"{moe_given} only apply to arch 'qwen3_moe', not {arch!r}")
    if arch != "smolvlm" and "tile_size" in given:
        raise ValueError(f"tile_size only applies to arch 'smolvlm', not {arch!r}")
    if arch not in VISION_ARCHS:
        vision_given = sorted(k for k in _VISION_KEYS if k in given)
        if vision_given:
            raise ValueError(
                f"{vision_given} only apply to vision archs {VISION_ARCHS}, not {arch!r}"
            )

    arch_defaults = {"smolvlm": _SMOLVLM_DEFAULTS, "qwen3_vl": _QWEN3_VL_DEFAULTS}.get(arch, {})
    dims: dict[str, Any] = {**TINY_SIZES[size], **_DEFAULTS, **arch_defaults, **given}
    for key in _INT_KEYS:
        value = dims[key]
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{key} must be an int, got {value!r}")
        minimum = 0 if key == "vocab_extra" else 1
        if value < minimum:
            raise ValueError(f"{key} must be >= {minimum}, got {value}")
    if not isinstance(dims["tie_embeddings"], bool):
        raise ValueError(f"tie_embeddings must be a bool, got {dims['tie_embeddings']!r}")

    if dims["heads"] % dims["kv_heads"]:
        raise ValueError(
            f"heads ({dims['heads']}) must be a multiple of kv_heads ({dims['kv_heads']})"
        )
    natural_head_dim = dims["hidden"] // dims["heads"]
    if dims["head_dim"] is None:
        if dims["hidden"] % dims["heads"]:
            raise ValueError(
                f"hidden ({dims['hidden']}) must be divisible by heads ({dims['heads']}) "
                "unless head_dim is given"
            )
        dims["head_dim"] = natural_head_dim
    elif arch == "qwen2" and dims["head_dim"] * dims["heads"] != dims["hidden"]:
        raise ValueError(
            f"qwen2 derives head_dim from hidden/heads; head_dim={dims['head_dim']} "
            f"does not equal {dims['hidden']}/{dims['heads']}"
        )
    if dims["head_dim"] % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {dims['head_dim']}")

    if arch == "qwen3_moe":
        if dims["moe_intermediate"] is None:
            dims["moe_intermediate"] = max(1, dims["intermediate"] // dims["experts"])
        if dims["experts_per_tok"] > dims["experts"]:
            raise ValueError(
                f"experts_per_tok ({dims['experts_per_tok']}) must be <= experts "
                f"({dims['experts']})"
            )
    else:
        for key in _MOE_KEYS:
            dims.pop(key)
    if arch in VISION_ARCHS:
        if dims["vision_dim"] % dims["vision_heads"]:
            raise ValueError(
                f"vision_dim ({dims['vision_dim']}) must be divisible by vision_heads "
                f"({dims['vision_heads']})"
            )
        if arch != "smolvlm" and (dims["head_dim"] // 2) < 3:
            raise ValueError(f"head_dim must be >= 6 for M-RoPE, got {dims['head_dim']}")
        # Qwen2-VL merges 2x2 patches, SmolVLM pixel-shuffles 2x2: a side (a tile's for
        # SmolVLM) must span an even number of patches.
        side, side_name = (
            (dims["tile_size"], "tile_size")
            if arch == "smolvlm"
            else (dims["image_size"], "image_size")
        )
        if side % (2 * dims["patch_size"]):
            raise ValueError(
                f"{side_name} ({side}) must be a multiple of 2 * patch_size "
                f"({2 * dims['patch_size']})"
            )
        if arch == "smolvlm" and dims["image_size"] % dims["tile_size"]:
            raise ValueError(
                f"image_size ({dims['image_size']}) must be a multiple of tile_size "
                f"({dims['tile_size']})"
            )
    else:
        for key in _VISION_KEYS:
            dims.pop(key)
    if arch != "smolvlm":
        dims.pop("tile_size")

    return {
        "format": _SPEC_FORMAT,
        "arch": arch,
        "size": size,
        "seed": seed,
        "dims": dims,
        "tokenizer": tokenizer_recipe_hash(TOKENIZER_VOCAB_SIZE),
    }


def tiny_tokenizer(spec: dict[str, Any]) -> PreTrainedTokenizerFast:
    """Build the tokenizer of a resolved spec (trained vocabulary plus ``vocab_extra`` reserved)."""
    dims = spec["dims"]
    return build_tokenizer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        reserved_tokens=dims["vocab_extra"],
        model_max_length=dims["max_position"],
        vision=("smolvlm" if spec["arch"] == "smolvlm" else True)
        if spec["arch"] in VISION_ARCHS
        else False,
    )


def tiny_config(spec: dict[str, Any], tokenizer: PreTrainedTokenizerFast) -> PretrainedConfig:
    """Build the HF model config of a resolved spec; vocabulary and ids come from ``tokenizer``."""
    dims = spec["dims"]
    arch = spec["arch"]
    ids = {
        "bos_token_id": tokenizer.convert_tokens_to_ids(BOS_TOKEN),
        "eos_token_id": tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    }
    kwargs: dict[str, Any] = {
        # The model's vocabulary is exactly the tokenizer's: every sampled id decodes.
        "vocab_size": len(tokenizer),
        "hidden_size": dims["hidden"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["kv_heads"],
        "intermediate_size": dims["intermediate"],
        "max_position_embeddings": dims["max_position"],
        "tie_word_embeddings": dims["tie_embeddings"],
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "dtype": "float32",
        # Read by AutoTokenizer when tokenizer_config.json lacks it; see polyrl.models.tokenizer.
        "tokenizer_class": GENERIC_TOKENIZER_CLASS,
        **ids,
    }
    if arch in QWEN_VL_ARCHS:
        return _qwen2_vl_config(dims, kwargs, tokenizer, arch)
    if arch == "smolvlm":
        return _smolvlm_config(dims, kwargs, tokenizer)
    if arch != "qwen2":
        kwargs["head_dim"] = dims["head_dim"]
    if arch == "qwen3_moe":
        kwargs.update(
            num_experts=dims["experts"],
            num_experts_per_tok=dims["experts_per_tok"],
            moe_intermediate_size=dims["moe_intermediate"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return AutoConfig.for_model(arch, **kwargs)


def _mrope_section(head_dim: int) -> list[int]:
    # Rotary frequencies split over (temporal, height, width); Qwen2-VL's 7B uses 16/24/24
    # of 64, i.e. a quarter to time and the rest shared by the two spatial axes.
    half = head_dim // 2
    temporal = max(1, half // 4)
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def _qwen2_vl_config(
    dims: dict[str, Any],
    text: dict[str, Any],
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "qwen2_vl",
) -> PretrainedConfig:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = {
        **text,
        "head_dim": dims["head_dim"],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": _mrope_section(dims["head_dim"]),
        },
    }
    vision = {
        "depth": dims["vision_depth"],
        "embed_dim": dims["vision_dim"],
        "num_heads": dims["vision_heads"],
        # The merger's output width: what the language model receives per image token.
        "hidden_size": dims["hidden"],
        "mlp_ratio": 2,
        "patch_size": dims["patch_size"],
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "initializer_range": 0.02,
    }
    if arch == "qwen2_5_vl":
        # Qwen2.5-VL's tower: an explicit MLP width, windowed attention (windows of 2 x 2
        # merged patches) in every block but the last, which attends to the whole image.
        vision = {
            **{k: v for k, v in vision.items() if k not in ("embed_dim", "mlp_ratio")},
            "hidden_size": dims["vision_dim"],
            "intermediate_size": 2 * dims["vision_dim"],
            "out_hidden_size": dims["hidden"],
            "window_size": 2 * 2 * dims["patch_size"],
            "fullatt_block_indexes": [dims["vision_depth"] - 1],
        }
    if arch == "qwen3_vl":
        # Qwen3-VL's tower: learned position embeddings resampled to each image's grid (a
        # square table, here one image_size image's patches), and DeepStack: the first
        # block's features, merged like the output, are added to the language model's hidden
        # states at the image tokens after its first decoder layer. Its text model is Qwen3's
        # (q/k norms) with interleaved M-RoPE.
        side = dims["image_size"] // dims["patch_size"]
        vision = {
            **{k: v for k, v in vision.items() if k not in ("embed_dim", "mlp_ratio")},
            "hidden_size": dims["vision_dim"],
            "intermediate_size": 2 * dims["vision_dim"],
            "out_hidden_size": dims["hidden"],
            "num_position_embeddings": side * side,
            "deepstack_visual_indexes": [0],
        }
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    return AutoConfig.for_model(
        arch,
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD_TOKEN],
        video_token_id=ids[VIDEO_PAD_TOKEN],
        vision_start_token_id=ids[VISION_START_TOKEN],
        vision_end_token_id=ids[VISION_END_TOKEN],
        tie_word_embeddings=dims["tie_embeddings"],
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        tokenizer_class=GENERIC_TOKENIZER_CLASS,
        dtype="float32",
    )


def _smolvlm_config(
    dims: dict[str, Any], text: dict[str, Any], tokenizer: PreTrainedTokenizerFast
) -> PretrainedConfig:
    text = {**text, "model_type": "llama", "head_dim": dims["head_dim"]}
    vision = {
        "hidden_size": dims["vision_dim"],
        "intermediate_size": 2 * dims["vision_dim"],
        "num_hidden_layers": dims["vision_depth"],
        "num_attention_heads": dims["vision_heads"],
        "num_channels": 3,
        # The vision encoder sees one tile at a time.
        "image_size": dims["tile_size"],
        "patch_size": dims["patch_size"],
        "initializer_range": 0.02,
    }
    return AutoConfig.for_model(
        "smolvlm",
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids(SMOLVLM_IMAGE_TOKEN),
        tie_word_embeddings=dims["tie_embeddings"],
        bos_token_id=text["bos_token_id"],
        eos_token_id=text["eos_token_id"],
        pad_token_id=text["pad_token_id"],
        tokenizer_class=GENERIC_TOKENIZER_CLASS,
        dtype="float32",
    )


def tiny_image_processor(spec: dict[str, Any]) -> Any:
    """Build the image processor of a vision spec.

    Qwen-VL archs: every image resized to about ``image_size**2`` pixels. smolvlm: the longest edge
    resized to ``image_size``, then cut into ``tile_size`` tiles plus the global view (the
    Pillow backend's class: it saves the same ``preprocessor_config.json`` as the fast one).
    """
    dims = spec["dims"]
    if spec["arch"] == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import (
            SmolVLMImageProcessorPil,
        )

        return SmolVLMImageProcessorPil(
            size={"longest_edge": dims["image_size"]},
            max_image_size={"longest_edge": dims["tile_size"]},
            do_image_splitting=True,
        )
    from polyrl.models.processor import qwen2_vl_image_processor

    return qwen2_vl_image_processor(
        patch_size=dims["patch_size"],
        min_pixels=dims["image_size"] ** 2,
        max_pixels=dims["image_size"] ** 2,
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Count distinct parameters (tied embeddings are counted once)."""
    return sum(p.numel() for p in model.parameters())


def _read_spec(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / SPEC_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _spec_key(spec: dict[str, Any]) -> dict[str, Any]:
    # num_parameters is a result, not part of the request.
    return {k: v for k, v in spec.items() if k != "num_parameters"}


def _spec_diff(found: dict[str, Any], wanted: dict[str, Any]) -> str:
    def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        items: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                items.update(flat(v, f"{prefix}{k}."))
            else:
                items[f"{prefix}{k}"] = v
        return items

    a, b = flat(_spec_key(found)), flat(_spec_key(wanted))
    keys = sorted(set(a) | set(b))
    return ", ".join(
        f"{k}: {a.get(k)!r} there, {b.get(k)!r} wanted" for k in keys if a.get(k) != b.get(k)
    )


def _is_complete(directory: Path) -> bool:
    names = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    if _read_spec(directory) and (_read_spec(directory) or {}).get("arch") in VISION_ARCHS:
        names = (*names, "preprocessor_config.json")
    has_weights = any(directory.glob("*.safetensors"))
    return has_weights and all((directory / n).is_file() for n in names)


def _reusable(directory: Path, spec: dict[str, Any]) -> bool:
    found = _read_spec(directory)
    return found is not None and _spec_key(found) == _spec_key(spec) and _is_complete(directory)


def _write_model(spec: dict[str, Any], target: Path) -> int:
    dims = spec["dims"]
    tokenizer = tiny_tokenizer(spec)
    config = tiny_config(spec, tokenizer)
    # fork_rng keeps the caller's global RNG untouched while making init depend on seed only;
    # the lock stops two threads of one process from interleaving draws from that global RNG.
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec["seed"])
        auto = AutoModelForImageTextToText if spec["arch"] in VISION_ARCHS else AutoModelForCausalLM
        model: PreTrainedModel = auto.from_config(config, dtype=torch.float32)
    # The text config holds the ids (SmolVLM's top-level pad_token_id is deprecated).
    ids_config = config.get_text_config()
    model.generation_config = GenerationConfig(
        bos_token_id=ids_config.bos_token_id,
        eos_token_id=ids_config.eos_token_id,
        pad_token_id=ids_config.pad_token_id,
    )
    num_params = count_parameters(model)
    model.save_pretrained(str(target))
    save_tokenizer(tokenizer, target)
    if spec["arch"] in VISION_ARCHS:
        tiny_image_processor(spec).save_pretrained(str(target))
    if spec["arch"] == "smolvlm":
        # What SmolVLMProcessor reads besides the image processor: the tokens per tile
        # (AutoProcessor needs torchvision and num2words for it; polyrl does not).
        seq_len = (dims["tile_size"] // dims["patch_size"]) ** 2 // 4
        (target / "processor_config.json").write_text(
            json.dumps({"image_seq_len": seq_len, "processor_class": "SmolVLMProcessor"}, indent=2)
            + "\n"
        )
    record = {**spec, "num_parameters": num_params}
    # Written last: its presence marks a complete directory.
    (target / SPEC_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return num_params


def build_tiny_model(
    arch: str,
    out_dir: str | os.PathLike[str],
    size: str = "nano",
    seed: int = 0,
    overwrite: bool = False,
    **overrides: Any,
) -> Path:
    """Build a tiny random-init model and its tokenizer into ``out_dir`` (or reuse it).

    Idempotent: when ``out_dir`` already holds a complete model built from the same spec it is
    returned untouched. The directory is written under a temporary name and renamed into
    place, so concurrent builders of the same spec never see a half-written directory.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        out_dir: directory to create.
        size: preset from :data:`TINY_SIZES`.
        seed: weight initialisation seed.
        overwrite: replace ``out_dir`` when it holds something else; otherwise that is an error.
        **overrides: dimension overrides, see :func:`resolve_tiny_spec`.

    Returns:
        The resolved path of the model directory.

    Raises:
        ValueError: bad arch, size or overrides.
        FileExistsError: ``out_dir`` holds other content and ``overwrite`` is false.
    """
    spec = resolve_tiny_spec(arch, size=size, seed=seed, **overrides)
    out = Path(out_dir).expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir():
        if _reusable(out, spec):
            return out
        if any(out.iterdir()) and not overwrite:
            found = _read_spec(out)
            if found is None:
                what = "other files (no " + SPEC_FILE + ")"
            elif _spec_key(found) == _spec_key(spec):
                what = "an incomplete tiny model"
            else:
                what = f"a tiny model with a different spec ({_spec_diff(found, spec)})"
            raise FileExistsError(
                f"{out} already holds {what}. Pass overwrite=True (CLI: --force) to replace "
                "it, or choose another directory"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the final directory should not be
    try:
        _write_model(spec, tmp)
        if out.is_dir():
            if _reusable(out, spec):  # another process finished the same build first
                return out
            if any(out.iterdir()):
                shutil.rmtree(out)
            else:
                out.rmdir()
        try:
            tmp.rename(out)
        except OSError:
            if _reusable(out, spec):  # lost a rename race against an identical build
                return out
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m polyrl.models.tiny",
        description="Build a tiny random-init causal LM plus a locally trained tokenizer.",
    )
    p.add_argument("--arch", required=True, choices=TINY_ARCHS)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--size", default="nano", choices=tuple(TINY_SIZES))
    p.add_argument("--seed", type=int, default=0)
    for flag, help_text in (
        ("--hidden", "hidden size"),
        ("--layers", "number of decoder layers"),
        ("--heads", "attention heads"),
        ("--kv-heads", "key/value heads (GQA)"),
        ("--intermediate", "MLP width"),
        ("--head-dim", "attention head size (default hidden/heads)"),
        ("--vocab-extra", "reserved special tokens appended to the vocabulary"),
        ("--max-position", "max_position_embeddings"),
        ("--experts", "qwen3_moe: number of experts"),
        ("--experts-per-tok", "qwen3_moe: experts routed per token"),
        ("--moe-intermediate", "qwen3_moe: MLP width of one expert"),
        ("--vision-depth", "vision archs: vision transformer blocks"),
        ("--vision-dim", "vision archs: vision transformer width"),
        ("--vision-heads", "vision archs: vision attention heads"),
        ("--patch-size", "vision archs: patch side in pixels"),
        ("--image-size", "vision archs: image side (smolvlm: longest edge) after resizing"),
        ("--tile-size", "smolvlm: side of the tiles an image is cut into"),
    ):
        p.add_argument(flag, type=int, default=None, help=help_text)
    p.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share input and output embeddings (default: yes)",
    )
    p.add_argument("--force", action="store_true", help="replace a directory with other content")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    args = _parser().parse_args(argv)
    overrides = {
        key: getattr(args, key) for key in OVERRIDE_KEYS if getattr(args, key, None) is not None
    }
    try:
        path = build_tiny_model(
            args.arch,
            args.out,
            size=args.size,
            seed=args.seed,
            overwrite=args.force,
            **overrides,
        )
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    spec = _read_spec(path) or {}
    dims = spec.get("dims", {})
    print(
        f"{spec.get('arch')} {spec.get('size')}: {spec.get('num_parameters', 0):,} parameters "
        f"(hidden={dims.get('hidden')} layers={dims.get('layers')} heads={dims.get('heads')} "
        f"kv_heads={dims.get('kv_heads')} intermediate={dims.get('intermediate')}) -> {path}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
