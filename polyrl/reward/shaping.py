"""Reward shaping applied on top of the scorers' rewards (pure functions)."""

from __future__ import annotations

import torch

__all__ = ["overlong_penalty"]


def overlong_penalty(
    response_length: torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, one value per response (0 or negative).

    Responses up to ``max_response_length - buffer_length`` tokens get 0; beyond that the
    penalty grows linearly to ``-penalty_factor`` at ``max_response_length`` (and stays there),
    so a response that runs into the length cap is discouraged before it is cut.

    Raises:
        ValueError: ``buffer_length`` is not in ``1..max_response_length``.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(
            f"overlong buffer of {buffer_length} tokens; expected 1..{max_response_length} "
            "(the maximum response length)"
        )
    exceed = (response_length.float() - (max_response_length - buffer_length)).clamp(min=0)
    return -(exceed / buffer_length).clamp(max=1.0) * penalty_factor
