"""The names of an RL step's batch columns, spelled once.

A step's rows travel as one :class:`~polyrl.core.batch.Batch` (or, with the transfer queue,
as stored fields) from the rollout through the engine workers and the advantage phase to the
losses; each stage reads columns another wrote. The workers (which add the engines' outputs),
the trainer and the rollout layout import the names from here, so a column's name is written
in one place and a misspelling is an ``AttributeError`` at import, not a ``KeyError`` mid-run.
"""

from __future__ import annotations

__all__ = [
    "ACC",
    "ADVANTAGES",
    "ATTENTION_MASK",
    "BASELINE",
    "ENTROPY",
    "EPISODE",
    "FINISH_REASON",
    "IMPLICIT_REWARDS",
    "INPUT_IDS",
    "LOSS_MASK",
    "MULTI_MODAL",
    "OLD_LOG_PROBS",
    "POSITION_IDS",
    "PROMPT_IDS",
    "PROMPT_LENGTH",
    "PRM_LOG_PROBS",
    "REF_LOG_PROBS",
    "TEACHER_LOG_PROBS",
    "TEACHER_TOPK_IDS",
    "TEACHER_TOPK_LOG_PROBS",
    "RESPONSE_IDS",
    "RESPONSE_LENGTH",
    "RESPONSE_MASK",
    "RETURNS",
    "ROLLOUT_LOG_PROBS",
    "ROUTED_EXPERTS",
    "SCORE",
    "TOKEN_LEVEL_REWARDS",
    "TOKEN_LEVEL_SCORES",
    "UID",
    "VALUES",
    "WEIGHT_VERSION_FIRST",
    "WEIGHT_VERSION_LAST",
]

# ---------------------------------------------------------------- the rollout layout
# Written by :func:`~polyrl.core.rollout_batch.build_rollout_batch`: ``(B, P + R)`` tensors with
# prompts left-padded and responses right-padded, and ``(B,)`` lengths.
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
#: 1 on the response tokens a loss counts (0 on prompts, padding and tool output).
LOSS_MASK = "loss_mask"
PROMPT_LENGTH = "prompt_length"
RESPONSE_LENGTH = "response_length"
#: An object column: each row's :class:`~polyrl.core.multimodal.MultiModalInputs` (or
#: ``None`` for a text row). The ``n`` samples of a prompt hold the same object, so a pickled
#: batch carries each prompt's pixels once.
MULTI_MODAL = "multi_modal"
#: The rollout server's per-token log-probs, aligned like the engines'.
ROLLOUT_LOG_PROBS = "rollout_log_probs"
#: MoE routing replay: ``(B, P + R, layers, k)`` int expert ids the rollout chose for each
#: token (aligned with ``input_ids``); -1 where nothing was recorded (e.g. prompt tokens from
#: the prefix cache), which route normally in the engines.
ROUTED_EXPERTS = "routed_experts"

# ---------------------------------------------------------------- the transfer queue's fields
# A stored sample is ragged: its own prompt and response tokens, rebuilt into the layout above.
PROMPT_IDS = "prompt_ids"
RESPONSE_IDS = "response_ids"
#: A stored sample's loss mask over its response tokens (``loss_mask`` once rebuilt).
RESPONSE_MASK = "response_mask"

# ---------------------------------------------------------------- generation and scoring
#: The prompt group a row belongs to (group-relative estimators normalise within it).
UID = "uid"
#: The episode a row came from, an int unique within its :data:`UID` group (the index of the
#: sample in its rollout call). An agent's episode whose calls do not extend one another is
#: several rows, its *linked samples*, sharing one episode (and one advantage).
EPISODE = "episode"
#: The reward of a row, ``(B,)``.
SCORE = "score"
#: Whether a row's answer is right, ``(B,)`` (the reward's accuracy, for metrics and DAPO).
ACC = "acc"
#: ReMax's greedy-response reward, the baseline of its group.
BASELINE = "baseline"
#: Why a row's generation stopped (``"length"``: cut at the length cap), when known.
FINISH_REASON = "finish_reason"
#: The weight versions that generated a sample's first and last tokens (the async modes).
WEIGHT_VERSION_FIRST = "weight_version_first"
WEIGHT_VERSION_LAST = "weight_version_last"

# ---------------------------------------------------------------- the engine workers' outputs
#: The actor's token log-probs before this step's update (the proximal policy).
OLD_LOG_PROBS = "old_log_probs"
#: The actor's token entropy (on request, beside :data:`OLD_LOG_PROBS`).
ENTROPY = "entropy"
#: The reference model's token log-probs.
REF_LOG_PROBS = "ref_log_probs"
#: On-policy distillation, a teacher served by a rollout server: its token log-probs
#: (aligned as :data:`REF_LOG_PROBS`; with the teacher as the reference role that column is it).
TEACHER_LOG_PROBS = "teacher_log_probs"
#: ... and its ``k`` most likely tokens at each position ``(B, T, k)`` with their log-probs: the
#: distribution that predicted token ``t`` (top-k distillation, ``algorithm.teacher_topk``).
TEACHER_TOPK_IDS = "teacher_topk_ids"
TEACHER_TOPK_LOG_PROBS = "teacher_topk_log_probs"
#: The critic's per-token values.
VALUES = "values"
#: PRIME's process reward model's token log-probs.
PRM_LOG_PROBS = "prm_log_probs"

# ---------------------------------------------------------------- the advantage phase
#: The score placed on each response's last token.
TOKEN_LEVEL_SCORES = "token_level_scores"
#: The token scores with the KL penalty folded in (when it is in the reward).
TOKEN_LEVEL_REWARDS = "token_level_rewards"
#: PRIME: the PRM's token rewards, measured against the reference.
IMPLICIT_REWARDS = "implicit_rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"
