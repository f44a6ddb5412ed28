"""What the prompt dataset and the agent loops must agree on about a prompt.

* :func:`fit_prompt`: the prompt-length rule (``data.max_prompt_length`` with
  ``data.truncation``). The prompt dataset applies it to each row when it is loaded; the agent
  loops apply it again to the prompt they actually send, which may be longer than what the
  dataset measured (the tool loop re-renders the prompt with its tool schemas in the system
  turn, the environment loop adds the first observation). One function, so a prompt is cut,
  dropped or refused the same way wherever it is built.
* :data:`TEXT_PROMPT_KEY`: the item field that marks a plain-text prompt the dataset tokenized
  as it is, without the chat template (``data.template_string_prompts=false``, TRL's
  "standard" format); a loop that must render the conversation through the template refuses
  such a prompt instead of templating what the dataset did not.
* :func:`render_chat`: the one call of the tokenizer's chat template (dataset, agent loops,
  agent proxy, SFT and preference data), so the same messages render the same way everywhere.
* :func:`check_template_kwargs`: the extra ``apply_chat_template`` arguments
  (``data.apply_chat_template_kwargs``, e.g. ``{"enable_thinking": False}``) that the dataset
  and every agent loop pass when they render a prompt, so a loop's prompt differs from the
  dataset's only by what the loop adds (tool schemas, observations), never by thinking on/off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "TEXT_PROMPT_KEY",
    "RESERVED_TEMPLATE_KWARGS",
    "TRUNCATION_POLICIES",
    "PromptTooLongError",
    "check_template_kwargs",
    "check_truncation",
    "fit_prompt",
    "render_chat",
]

#: Item field holding a plain-text prompt that was tokenized as it is (no chat template).
TEXT_PROMPT_KEY = "text_prompt"

#: What to do with a prompt longer than the limit: raise, drop it, keep its last tokens
#: (``left``: cut from the start) or its first tokens (``right``: cut from the end).
TRUNCATION_POLICIES: tuple[str, ...] = ("error", "filter", "left", "right")


#: ``apply_chat_template`` arguments the dataset and the agent loops set themselves; letting
#: callers override them would silently change what the prompt looks like (or what type comes
#: back), and ``tools`` is the row's or the loop's own.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "tokenize", "return_dict", "return_tensors", "add_generation_prompt", "tools"}
)


class PromptTooLongError(ValueError):
    """A prompt is longer than ``max_prompt_length`` under ``truncation="error"``."""


def check_truncation(max_prompt_length: int, truncation: str) -> None:
    """Check a limit and a policy.

    Raises:
        TypeError: ``max_prompt_length`` is not an int.
        ValueError: it is below 1, or ``truncation`` is not one of :data:`TRUNCATION_POLICIES`.
    """
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int):
        raise TypeError(f"max_prompt_length must be an int, got {max_prompt_length!r}")
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
    if truncation not in TRUNCATION_POLICIES:
        raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a copy of extra ``apply_chat_template`` arguments after checking them.

    Raises:
        TypeError: ``kwargs`` is not a mapping with string keys.
        ValueError: it sets one of :data:`RESERVED_TEMPLATE_KWARGS` (the message names it).
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(
            f"apply_chat_template_kwargs must be a mapping of names to values, got {kwargs!r}"
        )
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise ValueError(
            f"apply_chat_template_kwargs may not set {reserved}: polyrl sets them itself when "
            "it renders a prompt"
        )
    return dict(kwargs)


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Render chat ``messages`` to text with the tokenizer's chat template.

    ``template_kwargs`` are the extra arguments (``data.apply_chat_template_kwargs``, checked
    by :func:`check_template_kwargs`); ``tools`` the function schemas, if any.

    Raises:
        TypeError: the template returned something other than a string.
    """
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **(template_kwargs or {}),
    )
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}")
    return text


def fit_prompt(
    ids: Sequence[int], max_prompt_length: int, truncation: str, what: str
) -> list[int] | None:
    """Apply the prompt-length rule to one prompt's token ids.

    Args:
        ids: the prompt's token ids.
        max_prompt_length: the token budget of a prompt.
        truncation: one of :data:`TRUNCATION_POLICIES`.
        what: names the prompt in the error (``"row 3 (data_source='gsm8k')"``).

    Returns:
        The ids unchanged when they fit; else the last (``left``) or first (``right``)
        ``max_prompt_length`` of them; ``None`` under ``filter`` (the caller drops the prompt
        and counts it).

    Raises:
        PromptTooLongError: the prompt is too long under ``truncation="error"``; the message
            names ``what``, the prompt's length and the limit.
    """
    ids = list(ids)
    if len(ids) <= max_prompt_length:
        return ids
    if truncation == "error":
        raise PromptTooLongError(
            f"{what}: prompt is {len(ids)} tokens, longer than max_prompt_length="
            f"{max_prompt_length}; raise data.max_prompt_length or set data.truncation to filter, "
            "left or right"
        )
    if truncation == "filter":
        return None
    if truncation == "left":
        return ids[-max_prompt_length:]
    if truncation == "right":
        return ids[:max_prompt_length]
    raise ValueError(f"truncation must be one of {TRUNCATION_POLICIES}, got {truncation!r}")
