"""Prompt datasets: rows -> chat-templated token ids -> left-padded ``Batch``."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from polyrl.core.columns import MULTI_MODAL
from polyrl.core.multimodal import MultiModalInputError, expand_placeholders

# TRUNCATION_POLICIES and PromptTooLongError stay importable from here (polyrl.data's names).
from polyrl.core.prompts import (  # noqa: F401
    TEXT_PROMPT_KEY,
    TRUNCATION_POLICIES,
    PromptTooLongError,
    check_template_kwargs,
    check_truncation,
    fit_prompt,
    render_chat,
)
from polyrl.data.io import read_rows
from polyrl.data.media import media_messages, resolve_media_paths, row_media
from polyrl.data.schema import (
    RowValidationError,
    complete_row,
    ground_truth_of,
    row_uid,
    validate_row,
)

if TYPE_CHECKING:
    from polyrl.core.batch import Batch

logger = logging.getLogger(__name__)

TruncationPolicy = Literal["error", "filter", "left", "right"]


def _load_with_dirs(rows_or_paths: Any) -> tuple[list[tuple[dict[str, Any], Path]], list[int]]:
    """Return the rows with the folder their relative image paths are read from, and counts.

    The folder is the row's file's (the working directory for rows given); the counts say how
    many rows came from each file.
    """
    if isinstance(rows_or_paths, str | os.PathLike):
        base = Path(rows_or_paths).resolve().parent
        rows = [(row, base) for row in read_rows(rows_or_paths)]
        return rows, [len(rows)]
    if isinstance(rows_or_paths, Mapping) or not isinstance(rows_or_paths, Sequence):
        raise TypeError(
            "rows_or_paths must be a path, a list of paths or a list of row dicts, got "
            f"{type(rows_or_paths).__name__}"
        )
    items = list(rows_or_paths)
    if all(isinstance(x, Mapping) for x in items):
        cwd = Path.cwd()
        return [(dict(x), cwd) for x in items], [len(items)]
    if all(isinstance(x, str | os.PathLike) for x in items):
        rows: list[tuple[dict[str, Any], Path]] = []
        sizes = []
        for p in items:
            part, _ = _load_with_dirs(p)
            rows.extend(part)
            sizes.append(len(part))
        return rows, sizes
    kinds = sorted({type(x).__name__ for x in items})
    raise TypeError(f"rows_or_paths must be all row dicts or all file paths, got a mix of {kinds}")


class RLDataset(Dataset):
    """Rows tokenized through the tokenizer's chat template, with a prompt-length policy.

    Each prompt is rendered with ``tokenizer.apply_chat_template(messages,
    add_generation_prompt=True, tools=row["extra_info"].get("tools"), tokenize=False,
    **apply_chat_template_kwargs)`` and then encoded without extra special tokens (the template
    already places them). With ``template_string_prompts=False`` a prompt given as a plain
    string (TRL's "standard" format) is tokenized as it is, ``tokenizer.encode(prompt,
    add_special_tokens=False)``, as TRL does; chat-message prompts are always templated.  All
    rows are tokenized up front so the length policy (:func:`polyrl.core.prompts.fit_prompt`,
    which the agent loops apply again to the prompt they send) is applied once:

    * ``"error"``: a prompt longer than ``max_prompt_length`` raises :class:`PromptTooLongError`
      naming the row and its length;
    * ``"filter"``: such rows are dropped; :attr:`num_filtered` counts them and a log line
      ``"filtered N of M prompts longer than L tokens"`` is emitted;
    * ``"left"``: keep the last ``max_prompt_length`` tokens (drop from the start);
    * ``"right"``: keep the first ``max_prompt_length`` tokens (drop from the end).

    ``dataset[i]`` is a fresh copy of the row's own fields plus ``input_ids`` (1-D
    ``torch.long``, unpadded), ``raw_prompt`` (the chat messages), ``uid`` (stable string id
    of the prompt, see :func:`polyrl.data.schema.row_uid`; made unique within the dataset) and
    ``source_row`` (the row as it was given, before any field was filled in or converted: what
    batched, TRL-style reward functions receive). An item whose plain-string prompt was
    tokenized without the template also has :data:`~polyrl.core.prompts.TEXT_PROMPT_KEY`
    (``"text_prompt"``): that string (``raw_prompt`` still wraps it as one user message).

    Images and videos (see :mod:`polyrl.data.media` for the verl and TRL row layouts): with a
    ``processor`` (the model's :class:`~polyrl.models.processor.VisionProcessor`, from
    :func:`~polyrl.models.processor.load_vision_processor`), a row's media are decoded and
    processed **eagerly, here**, so an unusable image fails at load time with a
    :class:`~polyrl.core.multimodal.MultiModalInputError` naming the row and the field (``"row 3:
    field 'images': image 0: not a readable image ..."``) -- or, under ``truncation="filter"``,
    the row is dropped and counted in :attr:`num_bad_media` (with a log line), never mid-step.
    The processed inputs are kept in memory (one per prompt), which suits datasets of small
    images; the prompt's ``input_ids`` hold each item's full run of placeholder tokens, so the
    length policy counts them, and truncation that would cut into the image or video tokens is
    refused like ``"error"`` (or the row dropped under ``"filter"``). Without a processor a row
    with media is an error (the model cannot see them).

    Args:
        rows_or_paths: Row dicts, or one or more ``.parquet`` / ``.jsonl`` / ``.json`` files.
        tokenizer: A Hugging Face tokenizer with a chat template.
        max_prompt_length: Token budget for a prompt.
        prompt_key: Row field holding the chat messages (a bare string is taken as one user
            message).
        truncation: One of ``"error"``, ``"filter"``, ``"left"``, ``"right"``.
        apply_chat_template_kwargs: Extra keyword arguments for ``apply_chat_template``
            (``data.apply_chat_template_kwargs``, e.g. ``{"enable_thinking": False}``); the
            agent loops get the same (:func:`polyrl.core.prompts.check_template_kwargs` refuses
            the arguments the dataset sets itself).
        require_reward_fields: When false (a custom reward function scores every row), a row
            needs only its prompt: see :func:`polyrl.data.schema.complete_row`.
        template_string_prompts: When true (polyrl's default), a plain-string prompt becomes one
            user message rendered through the chat template; when false (the TRL-style
            trainers), it is tokenized as it is.
        processor: The vision model's processor; ``None`` for a text model.
        image_key: Row column holding the images (``data.image_key``; TRL's one-image ``image``
            column is read when a row lacks it).
        video_key: Row column holding the videos as frame lists (``data.video_key``).
    """

    def __init__(
        self,
        rows_or_paths: Sequence[Mapping[str, Any]] | str | os.PathLike[str] | Sequence[str | Path],
        tokenizer: Any,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: TruncationPolicy = "error",
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        require_reward_fields: bool = True,
        template_string_prompts: bool = True,
        processor: Any = None,
        image_key: str = "images",
        video_key: str = "videos",
    ) -> None:
        check_truncation(max_prompt_length, truncation)
        kwargs = check_template_kwargs(apply_chat_template_kwargs)
        if not hasattr(tokenizer, "apply_chat_template"):
            raise TypeError(
                f"tokenizer must provide apply_chat_template, got {type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.prompt_key = prompt_key
        self.truncation: str = truncation
        self.apply_chat_template_kwargs = kwargs
        self.require_reward_fields = require_reward_fields
        self.template_string_prompts = template_string_prompts
        self.processor = processor
        self.image_key = image_key
        self.video_key = video_key
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_token_id: int | None = pad

        loaded, sizes = _load_with_dirs(rows_or_paths)
        raw_rows = [row for row, _ in loaded]
        self.num_rows_total = len(raw_rows)
        # Which input file each input row came from (data.train_file_weights mixes by it).
        file_of_row = [f for f, size in enumerate(sizes) for _ in range(size)]
        self.rows: list[dict[str, Any]] = []
        self.source_rows: list[dict[str, Any]] = []  # each kept row as it was given
        self.input_ids: list[list[int]] = []
        # Each kept row's prompt string when it was tokenized without the template, else None.
        self.text_prompts: list[str | None] = []
        self.source_indices: list[int] = []  # position of each kept row in the input
        self.filtered_indices: list[int] = []
        # Each kept row's processed images/videos (None for a text row); see the class docs.
        self.multi_modal: list[Any] = []
        self.bad_media_indices: list[int] = []  # rows dropped for unusable media ("filter")
        self.num_truncated = 0
        for i, row in enumerate(raw_rows):
            row = self._prepare(row, i)
            given = raw_rows[i].get(self.prompt_key)
            text = given if isinstance(given, str) and not template_string_prompts else None
            images, videos = row_media(raw_rows[i], image_key, video_key)
            mm = None
            if images or videos:
                try:
                    full, mm = self._tokenize_media(row, i, images, videos, loaded[i][1])
                except MultiModalInputError as err:
                    if truncation != "filter":
                        raise
                    # The first few are named; the count below covers the rest.
                    if len(self.bad_media_indices) < 5:
                        logger.warning("dropping row %d: %s", i, err)
                    self.bad_media_indices.append(i)
                    continue
            else:
                full = self._tokenize(row, i) if text is None else self._encode(text, i)
            ids = self._fit(full, mm, i, row)
            if ids is None:
                self.filtered_indices.append(i)
                continue
            if len(ids) < len(full):
                self.num_truncated += 1
            self.rows.append(row)
            self.source_rows.append(dict(raw_rows[i]))
            self.input_ids.append(ids)
            self.text_prompts.append(text if mm is None else None)
            self.source_indices.append(i)
            self.multi_modal.append(mm)
        self.num_filtered = len(self.filtered_indices)
        self.num_bad_media = len(self.bad_media_indices)
        if self.num_bad_media:
            logger.warning(
                "dropped %d of %d rows whose images or videos are unusable",
                self.num_bad_media,
                self.num_rows_total,
            )
        #: The input file (0 for rows given) of each kept row.
        self.file_indices: list[int] = [file_of_row[i] for i in self.source_indices]
        if truncation == "filter":
            log = logger.warning if self.num_filtered else logger.info
            log(
                "filtered %d of %d prompts longer than %d tokens",
                self.num_filtered,
                self.num_rows_total,
                max_prompt_length,
            )
        self.uids = self._unique_uids()

    def _prepare(self, row: Any, index: int) -> dict[str, Any]:
        if not isinstance(row, Mapping):
            raise RowValidationError(f"row {index} must be a dict, got {type(row).__name__}")
        if not self.require_reward_fields:
            row = complete_row(row, prompt_key=self.prompt_key)
            extra = row.get("extra_info")
            if isinstance(extra, dict):
                # complete_row copies extra columns into extra_info; image bytes do not belong
                # in what reward functions receive.
                for key in (self.image_key, self.video_key, "image"):
                    if key in extra and key in row and extra[key] is row[key]:
                        row["extra_info"] = extra = {k: v for k, v in extra.items() if k != key}
        elif self.prompt_key in row and ("data_source" not in row or "reward_model" not in row):
            missing = [f for f in ("data_source", "reward_model") if f not in row]
            raise RowValidationError(
                f"row {index} is missing required field(s) {missing}; it has {sorted(row)} (a "
                "row needs only its prompt when a reward function scores it: pass reward_funcs= "
                "or set reward.custom_function)"
            )
        else:
            row = dict(row)
        if isinstance(row.get(self.prompt_key), str):
            row[self.prompt_key] = [{"role": "user", "content": row[self.prompt_key]}]
        validate_row(row, index, prompt_key=self.prompt_key)
        if row.get("extra_info") is None:
            row["extra_info"] = {}
        return row

    def _tokenize_media(
        self,
        row: dict[str, Any],
        index: int,
        images: list[Any],
        videos: list[Any],
        base_dir: Path,
    ) -> tuple[list[int], Any]:
        if self.processor is None:
            raise RowValidationError(
                f"row {index} has {len(images)} image(s) and {len(videos)} video(s) but the "
                "model is not a vision-language model (its config has no vision_config); "
                "train a VLM or drop the image columns"
            )
        # The row's prompt becomes content parts, so raw_prompt shows the rollout where each
        # image goes; the row as given stays in source_row.
        row[self.prompt_key] = media_messages(row[self.prompt_key], len(images), len(videos))
        ids = self._tokenize(row, index)
        field = self.image_key if images else self.video_key
        # Training data is the user's own: image paths may point anywhere on this machine
        # (the rollout server, which serves requests, keeps its allowed_dir).
        return self.processor.encode(
            ids,
            resolve_media_paths(images, base_dir),
            resolve_media_paths(videos, base_dir),
            what=f"row {index}: field {field!r}",
            allowed_dir="/",
        )

    def _fit(
        self, full: list[int], mm: Any, index: int, row: Mapping[str, Any]
    ) -> list[int] | None:
        what = f"row {index} (data_source={row['data_source']!r})"
        ids = fit_prompt(full, self.max_prompt_length, self.truncation, what)
        if ids is None or mm is None or len(ids) == len(full):
            return ids
        media = set(self.processor.token_ids.values())
        kept = sum(t in media for t in ids)
        total = sum(t in media for t in full)
        if kept == total and _expansions_intact(ids, self.processor.token_ids, mm):
            return ids
        # A cut image run no longer matches its pixels; refuse as "error" would.
        raise PromptTooLongError(
            f"{what}: prompt is {len(full)} tokens ({total} of them image/video tokens), longer "
            f"than max_prompt_length={self.max_prompt_length}, and truncating it would cut its "
            "image/video tokens; raise data.max_prompt_length, lower data.image_max_pixels or "
            "set data.truncation to filter"
        )

    def _tokenize(self, row: Mapping[str, Any], index: int) -> list[int]:
        try:
            text = render_chat(
                self.tokenizer,
                row[self.prompt_key],
                add_generation_prompt=True,
                tools=row["extra_info"].get("tools"),
                template_kwargs=self.apply_chat_template_kwargs,
            )
        except Exception as err:
            raise ValueError(
                f"row {index}: the chat template failed on this prompt: {err}"
            ) from err
        return self._encode(text, index)

    def _encode(self, text: str, index: int) -> list[int]:
        # No special tokens added: the template places its own, and TRL encodes a plain-text
        # prompt the same way.
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise ValueError(f"row {index}: the prompt tokenized to zero tokens")
        return ids

    def _unique_uids(self) -> list[str]:
        seen: dict[str, int] = {}
        uids = []
        for row, src in zip(self.rows, self.source_indices, strict=True):
            uid = row_uid(row, src)
            count = seen.get(uid, 0)
            seen[uid] = count + 1
            uids.append(uid if count == 0 else f"{uid}#{count}")
        return uids

    @property
    def prompt_lengths(self) -> list[int]:
        """Token count of each kept prompt (after truncation)."""
        return [len(ids) for ids in self.input_ids]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Return the row's fields plus ``input_ids`` (1-D long tensor), ``raw_prompt``, ``uid``."""
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"RLDataset index must be an int, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for RLDataset of length {len(self)}")
        # A deep copy: agent loops append to the messages and edit extra_info in place, which
        # must not leak into the next epoch's prompts.
        item = copy.deepcopy(self.rows[index])
        item["input_ids"] = torch.tensor(self.input_ids[index], dtype=torch.long)
        item["raw_prompt"] = copy.deepcopy(item[self.prompt_key])
        item["uid"] = self.uids[index]
        item["source_row"] = copy.deepcopy(self.source_rows[index])
        if self.text_prompts[index] is not None:
            item[TEXT_PROMPT_KEY] = self.text_prompts[index]
        if self.processor is not None:
            # Not copied: every sample of the prompt shares the one processed object.
            item[MULTI_MODAL] = self.multi_modal[index]
        return item

    def collate(self, items: Sequence[Mapping[str, Any]]) -> Batch:
        """``collate_fn`` for a ``DataLoader``: :func:`collate_prompts` with this pad token."""
        if self.pad_token_id is None:
            raise ValueError(
                "the tokenizer has neither pad_token_id nor eos_token_id; call "
                "collate_prompts(items, pad_token_id=...) with an explicit pad id"
            )
        return collate_prompts(items, self.pad_token_id)


def _object_array(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def collate_prompts(items: Sequence[Mapping[str, Any]], pad_token_id: int) -> Batch:
    """Stack dataset items into a left-padded prompt :class:`~polyrl.core.batch.Batch`.

    Tensors (all ``(B, L)`` with ``L`` the longest prompt, ``torch.long``):
    ``input_ids`` left-padded with ``pad_token_id``; ``attention_mask`` 1 on real tokens, 0 on
    padding; ``position_ids`` counting 0, 1, ... from each prompt's first real token (0 on
    padding).  Non-tensor columns: ``data_source``, ``ground_truth`` (from ``reward_model``),
    ``extra_info``, ``raw_prompt``, ``uid``, ``ability``, and ``multi_modal``
    (:data:`~polyrl.core.columns.MULTI_MODAL`: each row's
    :class:`~polyrl.core.multimodal.MultiModalInputs` or ``None``) when any item has it.

    Args:
        items: Items from :class:`RLDataset` (or dicts with the same fields).
        pad_token_id: Token id used for padding.

    Raises:
        ValueError: On an empty list, an empty prompt, or a missing field (naming the item).
    """
    from polyrl.core.batch import Batch  # deferred: keeps `import polyrl.data` light

    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int | np.integer):
        raise TypeError(f"pad_token_id must be an int, got {pad_token_id!r}")
    items = list(items)
    if not items:
        raise ValueError("collate_prompts needs at least one item, got an empty list")
    seqs: list[torch.Tensor] = []
    for i, item in enumerate(items):
        for field in ("input_ids", "data_source", "reward_model", "raw_prompt", "uid"):
            if field not in item:
                raise ValueError(f"item {i} has no {field!r} field; got {sorted(item)}")
        ids = torch.as_tensor(item["input_ids"], dtype=torch.long)
        if ids.ndim != 1 or ids.numel() == 0:
            raise ValueError(
                f"item {i}: input_ids must be a non-empty 1-D sequence, got shape "
                f"{tuple(ids.shape)}"
            )
        seqs.append(ids)
    length = max(len(s) for s in seqs)
    batch_size = len(seqs)
    input_ids = torch.full((batch_size, length), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, length - len(s) :] = s
        attention_mask[i, length - len(s) :] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    non_tensors = {
        "data_source": _object_array([it["data_source"] for it in items]),
        "ground_truth": _object_array([ground_truth_of(it) for it in items]),
        "extra_info": _object_array([it.get("extra_info") or {} for it in items]),
        "raw_prompt": _object_array([it["raw_prompt"] for it in items]),
        "uid": _object_array([str(it["uid"]) for it in items]),
        "ability": _object_array([it.get("ability", "unknown") for it in items]),
    }
    if any(MULTI_MODAL in it for it in items):
        non_tensors[MULTI_MODAL] = _object_array([it.get(MULTI_MODAL) for it in items])
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }
    return Batch(tensors, non_tensors, meta={})


def _expansions_intact(ids: list[int], token_ids: Mapping[str, int], mm: Any) -> bool:
    """Return whether every item's expansion is whole in ``ids``.

    SmolVLM's markers are not image tokens: a cut may keep every image token and still lose an
    expansion's first marker.
    """
    try:
        return expand_placeholders(ids, token_ids, mm) == ids
    except MultiModalInputError:
        return False
