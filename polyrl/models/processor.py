"""A vision-language model's processor: images and videos in, token ids and pixel tensors out.

:class:`VisionProcessor` is what polyrl uses where a text model uses its tokenizer. It holds the
tokenizer and the model's image processor (``AutoImageProcessor``: the fast one when
torchvision is installed, the Pillow one otherwise) and leaves the model-family part to the
model's :class:`~polyrl.models.vision_family.VisionFamily`: which token stands for an image,
what one placeholder expands to, how video frames become temporal patches. transformers'
``AutoProcessor`` for Qwen2-VL also needs a video processor, which needs torchvision (SmolVLM's
also needs num2words); doing the expansion here keeps a CPU-only install working and gives the
same ids and pixels (tests compare them with the stock processor's parts).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from polyrl.core.multimodal import (
    DEFAULT_LIMITS,
    MediaLimits,
    MultiModalInputError,
    MultiModalInputs,
    decode_image,
    decode_video,
    encode_png,
    expand_placeholders,
    image_digest,
)
from polyrl.models.vision_family import VISION_FAMILIES as FAMILIES
from polyrl.models.vision_family import VisionFamily, vision_family

__all__ = [
    "VISION_FAMILIES",
    "VisionProcessor",
    "is_vision_model",
    "load_vision_processor",
    "qwen2_vl_image_processor",
]

#: Model types whose processing this module implements (see :mod:`.vision_family`).
VISION_FAMILIES: tuple[str, ...] = tuple(FAMILIES)


def _has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def qwen2_vl_image_processor(
    patch_size: int = 14, min_pixels: int | None = None, max_pixels: int | None = None, **kw: Any
) -> Any:
    """Qwen2-VL's image processor (the Pillow backend when torchvision is missing)."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    if _has_torchvision():
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as cls,
        )
    else:
        cls = pil.Qwen2VLImageProcessorPil
    args: dict[str, Any] = {"patch_size": patch_size, **kw}
    if min_pixels is not None:
        args["min_pixels"] = min_pixels
    if max_pixels is not None:
        args["max_pixels"] = max_pixels
    return cls(**args)


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def is_vision_model(model_dir: str | os.PathLike[str]) -> bool:
    """Whether the HF model in ``model_dir`` has a vision tower (its config has one)."""
    return "vision_config" in _read_config(Path(model_dir))


class VisionProcessor:
    """Tokenizer plus image processor of a vision-language model (a family polyrl runs).

    Args:
        tokenizer: the model's tokenizer (with the vision tokens).
        image_processor: the model's image processor.
        config: the model's ``config.json`` as a dict.
        min_pixels / max_pixels: bounds on an image's area after resizing (verl's
            ``data.image_min_pixels`` / ``image_max_pixels``); ``None`` keeps the processor's.
            How a family applies them: :meth:`~.vision_family.VisionFamily.resize_kwargs`.
        limits: bounds on what is decoded at all.

    Raises:
        ValueError: a model type polyrl does not run, or pixel bounds the family refuses.
    """

    def __init__(
        self,
        tokenizer: Any,
        image_processor: Any,
        config: Mapping[str, Any],
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        limits: MediaLimits = DEFAULT_LIMITS,
    ):
        # A config.json without a vision_config is no VLM: family lookup says so by name.
        family = vision_family(
            {**config, "vision_config": config.get("vision_config", {})}, tokenizer
        )
        if family is None:  # pragma: no cover - the dict above always has a vision_config
            raise ValueError("VisionProcessor needs a vision-language model's config")
        #: The family's rules (placeholders, expansion, positions).
        self.family: VisionFamily = family
        self.model_type = family.model_type
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.limits = limits
        self.token_ids: dict[str, int] = dict(family.token_ids)
        #: The ``(min_pixels, max_pixels)`` given (``None``: the model's own).
        self.pixel_bounds: tuple[int | None, int | None] = (min_pixels, max_pixels)
        self._resize = family.resize_kwargs(image_processor, min_pixels, max_pixels)
        self._resize_by_bounds: dict[tuple[int | None, int | None], Any] = {
            self.pixel_bounds: self._resize
        }

    def _resize_for(self, bounds: tuple[int | None, int | None] | None) -> Any:
        """Return the family's resize arguments for ``bounds`` (``None``: this processor's)."""
        if bounds is None:
            return self._resize
        if bounds not in self._resize_by_bounds:
            self._resize_by_bounds[bounds] = self.family.resize_kwargs(
                self.image_processor, *bounds
            )
        return self._resize_by_bounds[bounds]

    @property
    def merge_size(self) -> int:
        """Qwen2-VL family: the vision tower's spatial patch merge factor."""
        return int(getattr(self.family, "merge_size", 1))

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike[str],
        tokenizer: Any = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        limits: MediaLimits = DEFAULT_LIMITS,
    ) -> VisionProcessor:
        """Load the processor of the model in ``model_dir`` (local files only)."""
        directory = Path(model_dir)
        config = _read_config(directory)
        if tokenizer is None:
            from polyrl.models.loader import load_tokenizer

            tokenizer = load_tokenizer(directory)
        if (directory / "preprocessor_config.json").is_file():
            # The model's own settings, all of them (resample, rescale, mean/std, pixel bounds);
            # transformers picks the Pillow backend itself when torchvision is missing.
            from transformers import AutoImageProcessor

            image_processor = AutoImageProcessor.from_pretrained(
                str(directory), local_files_only=True
            )
        elif config.get("model_type") in ("qwen2_vl", "qwen2_5_vl"):
            image_processor = qwen2_vl_image_processor()
        else:
            raise FileNotFoundError(
                f"{directory} has no preprocessor_config.json: the image processor of a "
                f"{config.get('model_type')!r} model cannot be guessed"
            )
        return cls(tokenizer, image_processor, config, min_pixels, max_pixels, limits)

    # -------------------------------------------------------------------------- media

    def process_media(
        self,
        images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
        order: Sequence[str] | None = None,
        what: str = "prompt",
        allowed_dir: str | os.PathLike[str] | None = None,
        pixel_bounds: tuple[int | None, int | None] | None = None,
    ) -> MultiModalInputs | None:
        """Decode and process a prompt's images and videos.

        Args:
            images: images in any form :func:`~polyrl.core.multimodal.decode_image` takes.
            videos: videos as frame lists.
            order: the kinds in prompt order (default: all images, then all videos).
            what: how errors name the prompt.
            allowed_dir: directory that image paths must lie in.
            pixel_bounds: ``(min_pixels, max_pixels)`` for this call (a rollout server
                repeating the trainer's processing); ``None``: this processor's own.

        Returns:
            The processed inputs, or ``None`` when there are no images and no videos.
        """
        images = list(images or ())
        videos = list(videos or ())
        if not images and not videos:
            return None
        if len(images) + len(videos) > self.limits.max_items:
            raise MultiModalInputError(
                f"{what}: {len(images) + len(videos)} images/videos, more than the limit of "
                f"{self.limits.max_items}"
            )
        decoded = [
            decode_image(im, what=f"{what}: image {i}", allowed_dir=allowed_dir, limits=self.limits)
            for i, im in enumerate(images)
        ]
        clips = [
            decode_video(v, what=f"{what}: video {i}", allowed_dir=allowed_dir, limits=self.limits)
            for i, v in enumerate(videos)
        ]
        tensors: dict[str, torch.Tensor] = {}
        counts: dict[str, list[int]] = {"image": [], "video": []}
        digests: dict[str, list[str]] = {"image": [], "video": []}
        expansions: list[tuple[int, ...]] | None = None
        family = self.family
        resize = self._resize_for(pixel_bounds)
        if decoded:
            image_tensors, counts["image"], expansions = family.process_images(
                self.image_processor, self.tokenizer, decoded, resize
            )
            tensors.update(image_tensors)
            digests["image"] = [image_digest(im) for im in decoded]
        if clips:
            video_tensors, counts["video"] = family.process_videos(
                self.image_processor, clips, resize
            )
            tensors.update(video_tensors)
            digests["video"] = [
                image_digest(c[0])[:16] + str(len(c)) + "".join(image_digest(f)[:4] for f in c)
                for c in clips
            ]
        kinds = (
            list(order) if order is not None else ["image"] * len(images) + ["video"] * len(videos)
        )
        if sorted(kinds) != sorted(["image"] * len(images) + ["video"] * len(videos)):
            raise MultiModalInputError(f"{what}: the media order does not match the items given")
        sources = {
            "image": [encode_png(im) for im in decoded],
            "video": [[encode_png(f) for f in c] for c in clips],
        }
        taken = {"image": 0, "video": 0}
        flat_digests, flat_counts, flat_sources = [], [], []
        for kind in kinds:
            flat_digests.append(digests[kind][taken[kind]])
            flat_counts.append(counts[kind][taken[kind]])
            flat_sources.append(sources[kind][taken[kind]])
            taken[kind] += 1
        return MultiModalInputs(
            tensors=tensors,
            kinds=tuple(kinds),
            digests=tuple(flat_digests),
            token_counts=tuple(flat_counts),
            sources=tuple(flat_sources),
            # Only image-only families have explicit expansions: they are in image order.
            expansions=tuple(expansions) if expansions is not None else (),
            pixel_bounds=self.pixel_bounds if pixel_bounds is None else pixel_bounds,
        )

    # -------------------------------------------------------------------------- tokens

    def media_order(self, ids: Sequence[int]) -> list[str]:
        """Return the kinds of the items whose placeholders ``ids`` holds, in order."""
        return self.family.media_order(ids)

    def expand(self, ids: Sequence[int], inputs: MultiModalInputs | None) -> list[int]:
        """Expand the placeholders of ``ids`` for ``inputs`` (checks their number)."""
        if inputs is None:
            found = self.media_order(ids)
            if found:
                raise MultiModalInputError(
                    f"the prompt has {len(found)} media placeholder(s) but no images or "
                    "videos were given"
                )
            return list(ids)
        return expand_placeholders(ids, self.token_ids, inputs)

    def encode(
        self,
        ids: Sequence[int],
        images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
        what: str = "prompt",
        allowed_dir: str | os.PathLike[str] | None = None,
        pixel_bounds: tuple[int | None, int | None] | None = None,
    ) -> tuple[list[int], MultiModalInputs | None]:
        """Process the media of token ids with one placeholder (or a full run) per item.

        ``pixel_bounds`` as in :meth:`process_media`.
        """
        order = self.media_order(ids)
        if (order.count("image"), order.count("video")) != (len(images), len(videos)):
            raise MultiModalInputError(
                f"{what}: {len(order)} media placeholder(s) ({order.count('image')} image, "
                f"{order.count('video')} video) but {len(images)} image(s) and {len(videos)} "
                "video(s) were given; put one placeholder per image or video"
            )
        inputs = (
            self.process_media(
                images,
                videos,
                order=order if images or videos else None,
                what=what,
                allowed_dir=allowed_dir,
                pixel_bounds=pixel_bounds,
            )
            if (images or videos)
            else None
        )
        if inputs is None and not order:
            return list(ids), None
        if inputs is not None and list(inputs.kinds) != order:
            raise MultiModalInputError(
                f"{what}: the prompt has {order.count('image')} image and "
                f"{order.count('video')} video placeholder(s) but {len(images)} image(s) and "
                f"{len(videos)} video(s) were given"
            )
        return self.expand(ids, inputs), inputs

    def encode_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        images: Sequence[Any] = (),
        videos: Sequence[Any] = (),
        add_generation_prompt: bool = True,
        what: str = "prompt",
        **template_kwargs: Any,
    ) -> tuple[list[int], MultiModalInputs | None]:
        """Render chat messages (with image/video content parts) and process their media."""
        ids = self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=False,
            **template_kwargs,
        )
        if isinstance(ids, Mapping):
            ids = ids["input_ids"]
        return self.encode(list(ids), images, videos, what=what)

    def positions(
        self, ids: Sequence[int], inputs: MultiModalInputs | None
    ) -> tuple[torch.Tensor, int] | None:
        """Return one expanded sequence's M-RoPE positions ``(3, len)`` and delta.

        ``None``: the family uses plain 1-D positions.
        """
        return self.family.positions(ids, inputs)

    def save_pretrained(self, out_dir: str | os.PathLike[str]) -> None:
        """Write the image processor's and tokenizer's files (what ``from_pretrained`` reads)."""
        self.image_processor.save_pretrained(str(out_dir))


def load_vision_processor(
    model_dir: str | os.PathLike[str], tokenizer: Any = None, **kw: Any
) -> VisionProcessor | None:
    """Load the model's :class:`VisionProcessor`, or ``None`` for a text-only model."""
    if not is_vision_model(model_dir):
        return None
    return VisionProcessor.from_pretrained(model_dir, tokenizer=tokenizer, **kw)
