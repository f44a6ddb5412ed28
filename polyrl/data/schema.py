"""The row schema shared by every dataset, task generator and reward function.

A row is a plain dict, in the layout verl users already know::

    {"data_source": "arithmetic",
     "prompt": [{"role": "user", "content": "12+7="}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "19"},
     "extra_info": {"split": "train", "index": 0}}

``prompt`` is a list of chat messages, ``reward_model.ground_truth`` is whatever the reward
function for ``data_source`` expects (a string, a number, a dict ...), and ``extra_info`` is a
free-form dict that may carry ``tools`` (JSON schemas handed to the chat template),
``tools_kwargs`` or ``agent_name`` for the agent loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REQUIRED_FIELDS: tuple[str, ...] = ("data_source", "prompt", "reward_model")
"""Fields every row must have."""

OPTIONAL_FIELDS: dict[str, Any] = {"ability": "unknown", "extra_info": {}}
"""Fields a row may omit, with the value :func:`normalize_row` fills in."""

CUSTOM_DATA_SOURCE = "custom"
"""``data_source`` of rows that name none, under a custom reward function (:func:`complete_row`)."""

MESSAGE_ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})
"""Chat roles accepted in ``prompt`` messages."""


class RowValidationError(ValueError):
    """A row does not follow the schema; the message names the row and the field."""


def _where(index: int | None, field: str) -> str:
    prefix = f"row {index}" if index is not None else "row"
    return f"{prefix}: field {field!r}"


def validate_messages(messages: Any, *, index: int | None = None, field: str = "prompt") -> None:
    """Check that ``messages`` is a non-empty list of ``{"role", "content"}`` chat messages.

    ``content`` is a string or a list of content parts (``{"type": "text", "text": ...}``,
    ``{"type": "image"}``, ``{"type": "video"}``), the layout of multi-modal chats.

    Args:
        messages: The value to check.
        index: Row index used in the error message.
        field: Field name used in the error message.

    Raises:
        RowValidationError: Naming the row, the field and the message at fault.
    """
    where = _where(index, field)
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise RowValidationError(
            f"{where} must be a list of chat messages, got {type(messages).__name__}"
        )
    if len(messages) == 0:
        raise RowValidationError(f"{where} must hold at least one chat message, got an empty list")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise RowValidationError(
                f"{where}[{i}] must be a dict with 'role' and 'content', got {type(msg).__name__}"
            )
        role = msg.get("role")
        if role not in MESSAGE_ROLES:
            raise RowValidationError(
                f"{where}[{i}]['role'] must be one of {sorted(MESSAGE_ROLES)}, got {role!r}"
            )
        content = msg.get("content")
        # Assistant messages that only carry tool calls may have empty/None content.
        if content is None and role == "assistant" and msg.get("tool_calls"):
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, Sequence) and not isinstance(content, bytes):
            _validate_parts(content, f"{where}[{i}]['content']")
            continue
        raise RowValidationError(
            f"{where}[{i}]['content'] must be a string or a list of content parts, got "
            f"{type(content).__name__}"
        )


CONTENT_PART_TYPES: frozenset[str] = frozenset({"text", "image", "video"})
"""``type`` values of the content parts a message may hold (multi-modal chats)."""


def _validate_parts(parts: Sequence[Any], where: str) -> None:
    # The chat templates of vision models render {"type": "image"} parts as the image
    # placeholder; the images themselves travel in the row's image column, in order.
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in CONTENT_PART_TYPES:
            raise RowValidationError(
                f"{where}[{j}] must be a content part dict with 'type' one of "
                f"{sorted(CONTENT_PART_TYPES)}, got {part!r:.80}"
            )
        if kind == "text" and not isinstance(part.get("text"), str):
            raise RowValidationError(f"{where}[{j}]: a text part needs a string 'text'")


def validate_row(row: Any, index: int | None = None, *, prompt_key: str = "prompt") -> None:
    """Check one row against the schema.

    Args:
        row: The row to check.
        index: Position of the row in its dataset, used in error messages.
        prompt_key: Field holding the chat messages (``"prompt"`` in the standard schema).

    Raises:
        RowValidationError: Naming the row index and the field that is missing or malformed,
            and what was expected instead.
    """
    label = f"row {index}" if index is not None else "row"
    if not isinstance(row, Mapping):
        raise RowValidationError(f"{label} must be a dict, got {type(row).__name__}")
    required = ("data_source", prompt_key, "reward_model")
    missing = [f for f in required if f not in row]
    if missing:
        raise RowValidationError(
            f"{label} is missing required field(s) {missing}; it has {sorted(row)}"
        )
    data_source = row["data_source"]
    if not isinstance(data_source, str) or not data_source:
        raise RowValidationError(
            f"{_where(index, 'data_source')} must be a non-empty string, got {data_source!r}"
        )
    validate_messages(row[prompt_key], index=index, field=prompt_key)
    reward_model = row["reward_model"]
    if not isinstance(reward_model, Mapping):
        raise RowValidationError(
            f"{_where(index, 'reward_model')} must be a dict with 'ground_truth', "
            f"got {type(reward_model).__name__}"
        )
    if "ground_truth" not in reward_model:
        raise RowValidationError(
            f"{_where(index, 'reward_model')} must have a 'ground_truth' key; "
            f"it has {sorted(reward_model)}"
        )
    style = reward_model.get("style", "rule")
    if not isinstance(style, str):
        raise RowValidationError(
            f"{_where(index, 'reward_model.style')} must be a string, got {type(style).__name__}"
        )
    if "ability" in row and not isinstance(row["ability"], str):
        raise RowValidationError(
            f"{_where(index, 'ability')} must be a string, got {type(row['ability']).__name__}"
        )
    if "extra_info" in row and row["extra_info"] is not None:
        extra = row["extra_info"]
        if not isinstance(extra, Mapping):
            raise RowValidationError(
                f"{_where(index, 'extra_info')} must be a dict, got {type(extra).__name__}"
            )
        tools = extra.get("tools")
        if tools is not None and (
            not isinstance(tools, Sequence)
            or isinstance(tools, str)
            or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise RowValidationError(
                f"{_where(index, 'extra_info.tools')} must be a list of tool schema dicts, "
                f"got {tools!r}"
            )


def validate_rows(rows: Iterable[Any], *, prompt_key: str = "prompt") -> None:
    """Validate every row, reporting the first bad one by its index.

    Raises:
        RowValidationError: For the first row that does not follow the schema.
    """
    for i, row in enumerate(rows):
        validate_row(row, i, prompt_key=prompt_key)


def normalize_row(row: Mapping[str, Any]) -> dict[str, Any]:
    """Return a validated shallow copy of ``row`` with optional fields filled in.

    ``ability`` defaults to ``"unknown"``, ``extra_info`` to ``{}``, ``reward_model.style``
    to ``"rule"``.
    """
    validate_row(row)
    out = dict(row)
    if "ability" not in out:
        out["ability"] = OPTIONAL_FIELDS["ability"]
    if out.get("extra_info") is None:
        out["extra_info"] = {}
    reward_model = dict(out["reward_model"])
    reward_model.setdefault("style", "rule")
    out["reward_model"] = reward_model
    return out


def complete_row(row: Mapping[str, Any], *, prompt_key: str = "prompt") -> dict[str, Any]:
    """Fill in what a row needs when a custom reward function scores it (TRL-style rows).

    Such a row needs only its prompt: ``data_source`` defaults to :data:`CUSTOM_DATA_SOURCE`,
    ``reward_model`` to ``{"ground_truth": row.get("ground_truth")}``, and every column that is
    not a schema field (``answer``, ``solution``, ...) is also put into ``extra_info`` (where
    ``extra_info`` does not already have that key), so a verl-style ``compute_score(...,
    extra_info)`` sees it. Returns a shallow copy; fields the row has are kept as they are.
    """
    out = dict(row)
    schema_fields = {prompt_key, *REQUIRED_FIELDS, *OPTIONAL_FIELDS}
    columns = {k: v for k, v in row.items() if k not in schema_fields}
    if columns:
        extra = out.get("extra_info")
        if extra is None or isinstance(extra, Mapping):
            merged = dict(extra or {})
            for key, value in columns.items():
                merged.setdefault(key, value)
            out["extra_info"] = merged
    out.setdefault("data_source", CUSTOM_DATA_SOURCE)
    if "reward_model" not in out:
        out["reward_model"] = {"ground_truth": row.get("ground_truth")}
    return out


def make_row(
    data_source: str,
    prompt: str | list[dict[str, str]],
    ground_truth: Any,
    *,
    ability: str = "unknown",
    system_prompt: str | None = None,
    style: str = "rule",
    extra_info: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a schema row.

    Args:
        data_source: Name that selects the reward function.
        prompt: A user message string, or a ready list of chat messages.
        ground_truth: What the reward function compares the response against.
        ability: Free label for the kind of skill (``"math"``, ``"string"`` ...).
        system_prompt: Prepended as a system message when ``prompt`` is a string.
        style: ``reward_model.style``.
        extra_info: Free-form metadata; copied.

    Returns:
        A row that passes :func:`validate_row`.
    """
    if isinstance(prompt, str):
        messages: list[dict[str, str]] = []
        if system_prompt is not None:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": prompt})
    else:
        if system_prompt is not None:
            raise ValueError("system_prompt is only accepted when prompt is a string")
        messages = [dict(m) for m in prompt]
    row = {
        "data_source": data_source,
        "prompt": messages,
        "ability": ability,
        "reward_model": {"style": style, "ground_truth": ground_truth},
        "extra_info": dict(extra_info or {}),
    }
    validate_row(row)
    return row


def ground_truth_of(row: Mapping[str, Any]) -> Any:
    """Return ``row["reward_model"]["ground_truth"]``, with a clear error if absent."""
    try:
        return row["reward_model"]["ground_truth"]
    except (KeyError, TypeError) as err:
        raise RowValidationError(
            f"row has no reward_model.ground_truth (keys: {sorted(row)})"
        ) from err


def row_uid(row: Mapping[str, Any], fallback_index: int) -> str:
    """Return a stable string id for a row's prompt.

    ``"{data_source}/{split}-{index}"`` from ``extra_info`` when it has an ``index``
    (``split`` defaults to ``"data"``), otherwise ``"{data_source}/row-{fallback_index}"``.
    The id only depends on the row (and its position when it lacks an index), so it survives
    checkpoint/resume and lets GRPO group the responses of one prompt.
    """
    extra = row.get("extra_info") or {}
    source = row.get("data_source", "data")
    if "index" in extra and extra["index"] is not None:
        return f"{source}/{extra.get('split') or 'data'}-{extra['index']}"
    return f"{source}/row-{fallback_index}"
