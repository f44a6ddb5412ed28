"""verl's config keys, accepted as aliases of the polyrl options they mean.

A verl launch line (``python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.optim.lr=1e-6
...``) runs as ``polyrl train grpo actor_rollout_ref.actor.optim.lr=1e-6 ...``: the loader looks
every key that is not a polyrl option up in :data:`VERL_KEYS` (a key that is one, like
``data.train_files``, keeps its polyrl meaning; a few take verl-only values too, e.g.
``trainer.save_freq=-1``). The table is data, so ``docs/migrating_from_verl.md`` and
``polyrl config verl`` are generated from it.

The policy, one rule per kind of entry:

* ``alias`` -- same meaning: the value (converted where the spelling differs, e.g.
  ``rollout.name=hf`` is ``rollout.backend=native``) sets the polyrl option.
* ``derived`` -- same intent, other units: the polyrl value is computed once every override
  is in (``ppo_micro_batch_size_per_gpu`` becomes a token budget, ``custom_reward_function.path``
  and ``.name`` become ``reward.custom_function``); a polyrl option the user set explicitly wins.
* ``ignored`` -- tunes only speed or memory (FSDP offload, log-prob micro-batches, ...), or
  states what polyrl always does: accepted, changes nothing, and a note says so.
* ``off`` -- a verl feature polyrl does not have: accepted at its "off" value (``lora_rank=0``,
  ``algorithm.use_pf_ppo=False``), an error naming the missing feature otherwise.
* anything else under a verl-only group (``actor_rollout_ref.*``, ``custom_reward_function.*``,
  ``reward_model.*``, ...) is an error saying the verl option has no polyrl equivalent --
  never a "did you mean" pointing at an option that means something else.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any, Literal

__all__ = [
    "MULTI_TURN",
    "PRESET_ALGORITHM_KEYS",
    "SKIP",
    "VERL_DEFAULTS",
    "VERL_DIFFERENCES",
    "VERL_KEYS",
    "VERL_ONLY_ROOTS",
    "VerlKey",
    "VerlValueError",
    "defaults_markdown",
    "is_verl_group",
    "lookup",
    "markdown_table",
    "near_spelling",
    "near_spellings",
    "verl_base",
    "verl_output_dir",
]

Kind = Literal["alias", "derived", "ignored", "off"]

SKIP: Any = object()
"""Returned by a converter for a verl value that means "keep polyrl's default" (``null``)."""

#: Top-level groups polyrl does not have: an unknown key under one is a verl option.
VERL_ONLY_ROOTS = (
    "actor_rollout_ref",
    "custom_reward_function",
    "reward_model",
    "reward_manager",
    "global_profiler",
    "ray_kwargs",
    "ray_init",
    "transfer_queue",
    "distillation",
)


class VerlValueError(ValueError):
    """A verl value that has no polyrl meaning (the message says what to do instead)."""


Derive = Callable[[Mapping[str, Any], Any], dict[str, Any]]
"""``(verl values given, the config so far) -> {polyrl key: value}``."""


@dataclasses.dataclass(frozen=True)
class VerlKey:
    """One verl key (or, ending in ``.*``, a whole verl subtree) and what it means here."""

    verl: str
    kind: Kind
    polyrl: str = ""
    """The polyrl option it sets (or, for ``derived``, computes); empty when none."""
    note: str = ""
    convert: Callable[[Any], Any] | None = None
    """verl value -> polyrl value (``alias``), may return :data:`SKIP` or raise
    :class:`VerlValueError`."""
    off: Any = None
    """``off`` entries: the values accepted (a tuple of them)."""
    derive: Derive | None = None
    """``derived`` entries: computes the polyrl values once every override is applied."""
    force: bool = False
    """``derived``: wins over an explicitly set polyrl option too (verl's own precedence)."""


# ------------------------------------------------------------------------------- converters
def _null_to(default: Any) -> Callable[[Any], Any]:
    return lambda v: default if v is None else v


def _null_skip(v: Any) -> Any:
    return SKIP if v is None else v


def _minus_one_to_zero(v: Any) -> Any:
    return 0 if v == -1 or v is None else v


def _lower(v: Any) -> Any:
    return v.lower() if isinstance(v, str) else v


_ROLLOUT_NAMES = {"vllm": "vllm", "sglang": "sglang", "hf": "native"}


def _rollout_name(v: Any) -> Any:
    if v not in _ROLLOUT_NAMES:
        raise VerlValueError(
            f"rollout engine {v!r} has no polyrl backend; use vllm, sglang or hf "
            "(polyrl's native engine)"
        )
    return _ROLLOUT_NAMES[v]


_STRATEGIES = {"fsdp": "fsdp2", "fsdp2": "fsdp2", "megatron": "megatron"}


def _strategy(v: Any) -> Any:
    if v not in _STRATEGIES:
        raise VerlValueError(f"actor strategy {v!r} has no polyrl backend; use fsdp2 or megatron")
    return _STRATEGIES[v]


_LOGGERS = {"file": "jsonl"}


def _loggers(v: Any) -> Any:
    items = [v] if isinstance(v, str) else list(v or [])
    return [_LOGGERS.get(x, x) for x in items]


_LOSS_MODES = {
    "vanilla": "ppo_clip",
    "gspo": "gspo",
    "cispo": "cispo",
    "sapo": "sapo",
    "gmpo": "gmpo",
    "geo_mean": "gmpo",
    "gpg": "gpg",
    "clip_cov": "clip_cov",
    "clip-cov": "clip_cov",
    "kl_cov": "kl_cov",
    "kl-cov": "kl_cov",
}


def _loss_mode(v: Any) -> Any:
    if v not in _LOSS_MODES:
        known = ", ".join(_LOSS_MODES)
        raise VerlValueError(f"policy loss {v!r} has no polyrl equivalent ({known})")
    return _LOSS_MODES[v]


_AGENT_LOOPS = {"single_turn_agent": "single_turn", "tool_agent": "tool"}


def _agent_loop(v: Any) -> Any:
    return _AGENT_LOOPS.get(v, v)


def _top_k(v: Any) -> Any:
    return -1 if v in (0, None) else v  # verl's hf rollout reads 0 as "off"


def _resume_mode(v: Any) -> Any:
    return "never" if v == "disable" else v


def _rollout_is(v: Any) -> Any:
    return "none" if v is None else v


_RS_MODES = ("token", "sequence", "geometric")


def _rollout_rs(v: Any) -> Any:
    if v is None:
        return "none"
    if v not in _RS_MODES:
        raise VerlValueError(
            f"rollout_rs {v!r} has no polyrl equivalent (token, sequence, geometric or null)"
        )
    return v


def _router_replay_mode(v: Any) -> Any:
    if v in (None, "disabled"):
        return False
    if v == "R3":
        return True
    raise VerlValueError(f"router replay mode {v!r} has no polyrl equivalent (R3, disabled)")


# ----------------------------------------------------------------------------- derivations
def _micro_batch_budget(per_gpu: bool) -> Derive:
    key = "ppo_micro_batch_size_per_gpu" if per_gpu else "ppo_micro_batch_size"

    def derive(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
        micro = given.get(f"actor_rollout_ref.actor.{key}")
        if micro is None:
            return {}
        if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
            raise VerlValueError(f"expected a positive int, got {micro!r}")
        if not per_gpu:
            micro = max(1, micro // cfg.trainer.world_size)
        return {
            "actor.max_tokens_per_micro_batch": micro
            * (cfg.data.max_prompt_length + cfg.data.max_response_length)
        }

    return derive


def _reward_function(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    path = given.get("custom_reward_function.path")
    if not path:
        return {}
    name = given.get("custom_reward_function.name") or "compute_score"
    return {"reward.custom_function": f"{path}:{name}"}


def _rs_threshold(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    # verl: a null upper end of the rejection band is rollout_is_threshold.
    prefix = "algorithm.rollout_correction."
    if f"{prefix}rollout_rs_threshold" not in given:
        return {}
    value = given[f"{prefix}rollout_rs_threshold"]
    if value is None:
        value = cfg.algorithm.rollout_is_threshold
    return {"algorithm.rollout_rs_threshold": value}


_DISTILL = "distillation"
_DISTILL_LOSS = f"{_DISTILL}.distillation_loss"


def _distillation(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    # verl's teacher is an inference server (teacher_model.inference), like polyrl's server
    # source; distillation_loss_coef weighs the signal (verl: only beside task rewards).
    if given.get(f"{_DISTILL}.enabled") is not True:
        return {}
    coef = given.get(f"{_DISTILL_LOSS}.distillation_loss_coef", 1.0)
    return {"algorithm.distill_coef": coef, "algorithm.teacher_source": "server"}


def _distill_loss_mode(v: Any) -> Any:
    if v == "k1":
        return SKIP  # the sampled token's logp_student - logp_teacher in the advantage
    raise VerlValueError(
        f"distillation loss_mode {v!r} has no polyrl equivalent: polyrl's sampled-token signal "
        "is verl's k1 as a reward (use_policy_gradient=True); its top-k signal, "
        "algorithm.teacher_topk, is a reverse KL over the teacher's top-k, which no verl mode is"
    )


def _clip_ratio(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    ratio = given.get("actor_rollout_ref.actor.clip_ratio")
    if ratio is None:
        return {}
    return {"actor.clip_ratio_low": ratio, "actor.clip_ratio_high": ratio}


def _filter_overlong(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    return {"data.truncation": "filter"} if given.get("data.filter_overlong_prompts") else {}


def _reward_model(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    if given.get("reward_model.enable") is not True:
        return {}  # verl's default config names a model.path it does not use when disabled
    path = given.get("reward_model.model.path")
    if not path or not isinstance(path, str):
        raise VerlValueError(
            "reward_model.enable=True needs reward_model.model.path (a local directory of a "
            "num_labels=1 sequence-classification model, e.g. a polyrl rm export)"
        )
    # verl's reward manager returns the reward model's score in place of the rule score.
    return {"reward.model_path": path, "reward.rule_weight": 0.0}


def _overlong_buffer(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    root = "reward_model.overlong_buffer"
    if not given.get(f"{root}.enable"):
        return {}
    out = {}
    if given.get(f"{root}.len") is not None:
        out["reward.overlong_buffer_len"] = given[f"{root}.len"]
    if given.get(f"{root}.penalty_factor") is not None:
        out["reward.overlong_penalty_factor"] = given[f"{root}.penalty_factor"]
    return out


# verl's DAPO trainer judges a group by a reward-manager extra (acc, score) or by a sum over
# the response's tokens: seq_reward sums token_level_scores (the reward manager's reward, the
# overlong penalty included) -- polyrl's per-row score; seq_final_reward sums
# token_level_rewards, which differ from those only by the KL-in-reward penalty.
_FILTER_METRICS = {
    "acc": "acc",
    "score": "score",
    "seq_reward": "score",
    "seq_final_reward": "score",
}


def _filter_metric(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    metric = given.get("algorithm.filter_groups.metric")
    if metric is None:
        return {}
    if metric not in _FILTER_METRICS:
        raise VerlValueError(
            f"filter_groups metric {metric!r} has no polyrl equivalent "
            f"({', '.join(_FILTER_METRICS)})"
        )
    if metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise VerlValueError(
            "seq_final_reward with algorithm.use_kl_in_reward=True needs the KL penalty before "
            "filtering; polyrl applies it after (use seq_reward, the reward before the penalty)"
        )
    return {"algorithm.filter_groups_metric": _FILTER_METRICS[metric]}


def _gen_batches(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and v <= 0:
        raise VerlValueError(
            f"{v} (verl: no limit) has no polyrl equivalent; give the most generation rounds "
            "per step, e.g. 10"
        )
    return v


MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
"""verl's multi-turn group (its ``enable`` also lets a turn use the whole response budget)."""


def _multi_turn(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    if given.get(f"{MULTI_TURN}.enable") is not True:
        return {}
    # verl's multi-turn rollout is its tool agent loop; polyrl's is the tool loop.
    return {"agent.enable": True, "agent.default_loop": "tool"}


def _tool_config(given: Mapping[str, Any], cfg: Any) -> dict[str, Any]:
    path = given.get(f"{MULTI_TURN}.tool_config_path")
    if not path:
        return {}
    from polyrl.agent.tools import load_tool_config

    try:
        load_tool_config(path)  # a bad file or class fails here, not at the first rollout
    except ValueError as exc:
        raise VerlValueError(str(exc)) from None
    # verl offers the YAML's tools only.
    return {"agent.tool_config": str(path), "agent.tools": []}


def _target_modules(v: Any) -> Any:
    # verl takes "all-linear" or a list; polyrl's option is always a list.
    return [v] if isinstance(v, str) else v


# ----------------------------------------------------------------------------------- table
def _a(verl: str, polyrl: str = "", note: str = "", convert: Any = None) -> VerlKey:
    return VerlKey(verl, "alias", polyrl or verl, note, convert)


def _i(verl: str, note: str) -> VerlKey:
    return VerlKey(verl, "ignored", note=note)


def _o(verl: str, off: tuple[Any, ...], note: str) -> VerlKey:
    return VerlKey(verl, "off", note=note, off=off)


def _d(verl: str, polyrl: str, note: str, derive: Derive, force: bool = False) -> VerlKey:
    return VerlKey(verl, "derived", polyrl, note, derive=derive, force=force)


_PERF = "tunes speed or memory only; polyrl has no such knob"
_LOGPROB = "log-prob passes form micro-batches by actor.max_tokens_per_micro_batch"
_CRITIC_MB = "the critic forms micro-batches by actor.max_tokens_per_micro_batch"
_PAD = "polyrl always removes padding (token-budget micro-batches)"
_AR = "actor_rollout_ref"

VERL_KEYS: tuple[VerlKey, ...] = (
    # ---- model
    _a(f"{_AR}.model.path", "model.path"),
    _a(f"{_AR}.model.trust_remote_code", "model.trust_remote_code"),
    _a(
        f"{_AR}.model.enable_gradient_checkpointing",
        "actor.gradient_checkpointing",
        "also applies to the reference and critic engines",
    ),
    _i(f"{_AR}.model.use_remove_padding", _PAD),
    _i(f"{_AR}.model.use_fused_kernels", _PERF),
    _i(f"{_AR}.model.use_liger", _PERF),
    _i(f"{_AR}.model.use_shm", _PERF),
    _i(f"{_AR}.model.enable_activation_offload", _PERF),
    _a(f"{_AR}.model.lora_rank", "model.lora_rank", "LoRA through peft (actor and SFT)"),
    _a(f"{_AR}.model.lora_alpha", "model.lora_alpha"),
    _a(f"{_AR}.model.target_modules", "model.target_modules", convert=_target_modules),
    _o(f"{_AR}.model.external_lib", (None,), "use model.trust_remote_code for custom models"),
    _o(f"{_AR}.model.custom_chat_template", (None,), "the model directory's template is used"),
    _o(f"{_AR}.model.override_config", ({},), "edit the model's config.json instead"),
    _o(f"{_AR}.model.tokenizer_path", (None,), "the tokenizer is read from model.path"),
    _i(f"{_AR}.hybrid_engine", "rollout.placement=auto is hybrid on CUDA (verl's default)"),
    _i(f"{_AR}.nccl_timeout", _PERF),
    # ---- actor optimizer
    _a(f"{_AR}.actor.optim.lr", "actor.optim.lr"),
    _a(f"{_AR}.actor.optim.weight_decay", "actor.optim.weight_decay"),
    _a(f"{_AR}.actor.optim.lr_warmup_steps_ratio", "actor.optim.warmup_ratio"),
    _a(f"{_AR}.actor.optim.lr_scheduler_type", "actor.optim.lr_scheduler", convert=_lower),
    _a(f"{_AR}.actor.optim.warmup_style", "actor.optim.lr_scheduler", convert=_null_skip),
    _a(f"{_AR}.actor.optim.clip_grad", "actor.optim.grad_clip"),
    _a(f"{_AR}.actor.optim.optimizer", "actor.optim.optimizer", convert=_lower),
    _o(f"{_AR}.actor.optim.lr_warmup_steps", (-1, None), "use actor.optim.warmup_ratio"),
    _a(f"{_AR}.actor.optim.min_lr_ratio", "actor.optim.min_lr_ratio", convert=_null_skip),
    _i(f"{_AR}.actor.optim.total_training_steps", "polyrl schedules over the run's steps"),
    _a(f"{_AR}.actor.grad_clip", "actor.optim.grad_clip"),
    # ---- actor batching
    _a(
        f"{_AR}.actor.ppo_mini_batch_size",
        "actor.ppo_mini_batch_size",
        "same unit: prompts per optimizer step (times rollout.n rows)",
    ),
    _d(
        f"{_AR}.actor.ppo_micro_batch_size_per_gpu",
        "actor.max_tokens_per_micro_batch",
        "polyrl forms micro-batches by token budget: set to micro x (max_prompt_length + "
        "max_response_length); results do not depend on it",
        _micro_batch_budget(per_gpu=True),
    ),
    _d(
        f"{_AR}.actor.ppo_micro_batch_size",
        "actor.max_tokens_per_micro_batch",
        "global micro-batch / world size, as a token budget (see ppo_micro_batch_size_per_gpu)",
        _micro_batch_budget(per_gpu=False),
    ),
    _a(f"{_AR}.actor.ppo_max_token_len_per_gpu", "actor.max_tokens_per_micro_batch"),
    _i(f"{_AR}.actor.use_dynamic_bsz", "polyrl always forms micro-batches by token budget"),
    _a(f"{_AR}.actor.ppo_epochs", "actor.ppo_epochs"),
    _o(f"{_AR}.actor.shuffle", (False,), "mini-batches keep the batch order"),
    # ---- actor loss
    _d(
        f"{_AR}.actor.clip_ratio",
        "actor.clip_ratio_low",
        "sets actor.clip_ratio_low and actor.clip_ratio_high",
        _clip_ratio,
    ),
    _a(f"{_AR}.actor.clip_ratio_low", "actor.clip_ratio_low"),
    _a(f"{_AR}.actor.clip_ratio_high", "actor.clip_ratio_high"),
    _a(f"{_AR}.actor.clip_ratio_c", "actor.clip_ratio_c"),
    _a(f"{_AR}.actor.entropy_coeff", "actor.entropy_coeff"),
    _a(f"{_AR}.actor.use_kl_loss", "actor.use_kl_loss"),
    _a(f"{_AR}.actor.kl_loss_coef", "actor.kl_loss_coef"),
    _a(f"{_AR}.actor.kl_loss_type", "actor.kl_loss_type"),
    _a(f"{_AR}.actor.loss_agg_mode", "actor.loss_agg_mode"),
    _a(f"{_AR}.actor.router_replay.mode", "actor.router_replay", "R3 is true", _router_replay_mode),
    _a(
        f"{_AR}.actor.megatron.router_replay.mode",
        "actor.router_replay",
        "R3 is true",
        _router_replay_mode,
    ),
    _a(f"{_AR}.rollout.enable_rollout_routing_replay", "actor.router_replay"),
    _a(
        f"{_AR}.actor.policy_loss.loss_mode",
        "actor.policy_loss",
        "vanilla is ppo_clip, geo_mean is gmpo, clip-cov and kl-cov are clip_cov and kl_cov",
        _loss_mode,
    ),
    _a(f"{_AR}.actor.policy_loss.clip_cov_ratio", "actor.clip_cov_ratio"),
    _a(f"{_AR}.actor.policy_loss.clip_cov_lb", "actor.clip_cov_lb"),
    _a(f"{_AR}.actor.policy_loss.clip_cov_ub", "actor.clip_cov_ub"),
    _a(f"{_AR}.actor.policy_loss.kl_cov_ratio", "actor.kl_cov_ratio"),
    _a(f"{_AR}.actor.policy_loss.ppo_kl_coef", "actor.kl_cov_coef"),
    _a(f"{_AR}.actor.tau_pos", "actor.tau_pos"),
    _a(f"{_AR}.actor.tau_neg", "actor.tau_neg"),
    # ---- actor engine
    _a(
        f"{_AR}.actor.strategy",
        "actor.engine_backend",
        "fsdp and fsdp2 are the fsdp2 backend; megatron is Megatron-Core",
        _strategy,
    ),
    _a(
        f"{_AR}.actor.megatron.tensor_model_parallel_size",
        "actor.megatron.tensor_model_parallel_size",
    ),
    _a(
        f"{_AR}.actor.megatron.pipeline_model_parallel_size",
        "actor.megatron.pipeline_model_parallel_size",
    ),
    _a(
        f"{_AR}.actor.megatron.expert_model_parallel_size",
        "actor.megatron.expert_model_parallel_size",
    ),
    _a(
        f"{_AR}.actor.megatron.expert_tensor_parallel_size",
        "actor.megatron.expert_tensor_parallel_size",
    ),
    _a(f"{_AR}.actor.megatron.context_parallel_size", "actor.megatron.context_parallel_size"),
    _i(f"{_AR}.actor.megatron.*", _PERF),
    _a(f"{_AR}.actor.fsdp_config.param_offload", "actor.offload_params"),
    _a(f"{_AR}.actor.fsdp_config.optimizer_offload", "actor.offload_optimizer"),
    _i(f"{_AR}.actor.fsdp_config.*", _PERF),
    _i(f"{_AR}.actor.checkpoint.*", "checkpoints hold model, optimizer and sampler state"),
    _i(f"{_AR}.actor.use_torch_compile", _PERF),
    _i(f"{_AR}.actor.entropy_from_logits_with_chunking", _PERF),
    _i(f"{_AR}.actor.entropy_checkpointing", _PERF),
    _i(f"{_AR}.actor.profiler.*", _PERF),
    _a(
        f"{_AR}.actor.ulysses_sequence_parallel_size",
        "actor.ulysses_sequence_parallel_size",
        "Ulysses sequence parallelism in polyrl's engine; the reference uses it too",
    ),
    # ---- rollout
    _a(f"{_AR}.rollout.name", "rollout.backend", "hf is polyrl's native engine", _rollout_name),
    _i(f"{_AR}.rollout.mode", "rollout servers are always asynchronous"),
    _a(f"{_AR}.rollout.n", "rollout.n"),
    _a(f"{_AR}.rollout.temperature", "rollout.temperature"),
    _a(f"{_AR}.rollout.top_p", "rollout.top_p"),
    _a(f"{_AR}.rollout.top_k", "rollout.top_k", "0 and -1 both turn it off", _top_k),
    _a(f"{_AR}.rollout.response_length", "rollout.max_new_tokens"),
    _a(f"{_AR}.rollout.prompt_length", "data.max_prompt_length"),
    _a(f"{_AR}.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    _a(f"{_AR}.rollout.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
    _a(f"{_AR}.rollout.dtype", "rollout.dtype"),
    _a(f"{_AR}.rollout.enforce_eager", "rollout.enforce_eager"),
    _a(f"{_AR}.rollout.enable_prefix_caching", "rollout.enable_prefix_caching"),
    _a(f"{_AR}.rollout.max_num_seqs", "rollout.max_num_seqs"),
    _a(f"{_AR}.rollout.max_model_len", "rollout.max_model_len", convert=_null_to(0)),
    _i(f"{_AR}.rollout.free_cache_engine", "hybrid placement always frees the KV cache"),
    _i(f"{_AR}.rollout.max_num_batched_tokens", _PERF),
    _i(f"{_AR}.rollout.enable_chunked_prefill", _PERF),
    _i(f"{_AR}.rollout.load_format", _PERF),
    _i(f"{_AR}.rollout.disable_log_stats", _PERF),
    _i(f"{_AR}.rollout.cudagraph_capture_sizes", _PERF),
    _i(f"{_AR}.rollout.engine_kwargs.*", _PERF),
    _i(f"{_AR}.rollout.layered_summon", _PERF),
    _i(f"{_AR}.rollout.multi_stage_wake_up", _PERF),
    _o(
        f"{_AR}.rollout.over_sample_rate",
        (0, 0.0),
        "every request runs to the end (no over-sampling and aborting the slowest)",
    ),
    _o(f"{_AR}.rollout.ignore_eos", (False,), "generation always stops at EOS"),
    _i(f"{_AR}.rollout.calculate_log_probs", "rollouts always return their log-probs"),
    _i(f"{_AR}.rollout.log_prob_micro_batch_size_per_gpu", _LOGPROB),
    _i(f"{_AR}.rollout.log_prob_micro_batch_size", _LOGPROB),
    _i(f"{_AR}.rollout.log_prob_use_dynamic_bsz", _LOGPROB),
    _i(f"{_AR}.rollout.log_prob_max_token_len_per_gpu", _LOGPROB),
    _o(f"{_AR}.rollout.do_sample", (True,), "set rollout.temperature=0 for greedy decoding"),
    _o(f"{_AR}.rollout.data_parallel_size", (1,), "use rollout.replicas for more engines"),
    _o(f"{_AR}.rollout.expert_parallel_size", (1,), "no expert parallelism in rollout"),
    _o(f"{_AR}.rollout.pipeline_model_parallel_size", (1,), "no pipeline parallelism"),
    _a(f"{_AR}.rollout.val_kwargs.n", "rollout.val_n"),
    _a(f"{_AR}.rollout.val_kwargs.temperature", "rollout.val_temperature"),
    _i(f"{_AR}.rollout.val_kwargs.do_sample", "rollout.val_temperature=0 is greedy"),
    _o(f"{_AR}.rollout.val_kwargs.top_p", (1, 1.0), "validation samples with top_p 1"),
    _o(f"{_AR}.rollout.val_kwargs.top_k", (-1, 0), "validation samples without top_k"),
    _d(
        f"{_AR}.rollout.multi_turn.enable",
        "agent.enable",
        "True rolls out through the tool loop, and a turn may use all of data.max_response_length "
        "(rollout.max_new_tokens follows it), as in verl",
        _multi_turn,
    ),
    _d(
        f"{_AR}.rollout.multi_turn.tool_config_path",
        "agent.tool_config",
        "verl's tool YAML: its tools are offered, by their tool_schema (agent.tools=[]); "
        "verl.tools.gsm8k_tool.Gsm8kTool is polyrl's gsm8k_check, any other class_name is "
        "imported and must be a polyrl.agent.tools.Tool",
        _tool_config,
    ),
    _a(
        f"{_AR}.rollout.multi_turn.max_assistant_turns",
        "agent.max_turns",
        "null (verl: no limit but the response budget) keeps agent.max_turns",
        _null_skip,
    ),
    _a(
        f"{_AR}.rollout.multi_turn.max_tool_response_length",
        "agent.max_tool_response_tokens",
        "verl counts characters, polyrl tokens (a limit at least as loose)",
    ),
    _a(f"{_AR}.rollout.multi_turn.format", "agent.tool_parser"),
    _o(
        f"{_AR}.rollout.multi_turn.max_user_turns",
        (None,),
        "the tool loop ends at agent.max_turns model turns",
    ),
    _o(
        f"{_AR}.rollout.multi_turn.interaction_config_path",
        (None,),
        "no interaction agents; use an env loop (polyrl.agent.envs)",
    ),
    _o(f"{_AR}.rollout.multi_turn.num_repeat_rollouts", (None,), "use rollout.n"),
    _i(
        f"{_AR}.rollout.multi_turn.max_parallel_calls",
        "the tool loop runs up to 4 calls of a turn concurrently",
    ),
    _i(
        f"{_AR}.rollout.multi_turn.tool_response_truncate_side",
        "a long tool response is cut at its end (agent.max_tool_response_tokens)",
    ),
    _i(
        f"{_AR}.rollout.multi_turn.use_inference_chat_template",
        "tool responses are appended as the chat template's token delta",
    ),
    _i(
        f"{_AR}.rollout.multi_turn.tokenization_sanity_check_mode",
        "turns are kept token-exact; there is nothing to check",
    ),
    _a(f"{_AR}.rollout.agent.default_agent_loop", "agent.default_loop", convert=_agent_loop),
    _i(f"{_AR}.rollout.agent.num_workers", "see agent.max_concurrency"),
    # ---- reference
    _i(f"{_AR}.ref.log_prob_micro_batch_size_per_gpu", _LOGPROB),
    _i(f"{_AR}.ref.log_prob_micro_batch_size", _LOGPROB),
    _i(f"{_AR}.ref.log_prob_use_dynamic_bsz", _LOGPROB),
    _i(f"{_AR}.ref.log_prob_max_token_len_per_gpu", _LOGPROB),
    _i(f"{_AR}.ref.fsdp_config.*", _PERF),
    _i(f"{_AR}.ref.strategy", "polyrl's engine shards the model itself"),
    _i(f"{_AR}.ref.use_torch_compile", _PERF),
    _i(
        f"{_AR}.ref.ulysses_sequence_parallel_size",
        "the reference uses actor.ulysses_sequence_parallel_size",
    ),
    # ---- critic
    _a("critic.model.path", "critic.model_path"),
    _a("critic.optim.lr"),
    _a("critic.optim.weight_decay"),
    _a("critic.optim.clip_grad", "critic.optim.grad_clip"),
    _a("critic.optim.optimizer", convert=_lower),
    _a("critic.optim.lr_warmup_steps_ratio", "critic.optim.warmup_ratio"),
    _o("critic.optim.lr_warmup_steps", (-1, None), "use critic.optim.warmup_ratio"),
    _i("critic.optim.total_training_steps", "polyrl schedules over the run's steps"),
    _a("critic.grad_clip", "critic.optim.grad_clip"),
    _i(
        "critic.model.enable_gradient_checkpointing",
        "the critic follows actor.gradient_checkpointing",
    ),
    _i("critic.model.use_remove_padding", _PAD),
    _i("critic.model.trust_remote_code", "the critic follows model.trust_remote_code"),
    _i("critic.model.fsdp_config.*", _PERF),
    _i("critic.strategy", "polyrl's engine shards the model itself"),
    _i("critic.ppo_micro_batch_size_per_gpu", _CRITIC_MB),
    _i("critic.ppo_micro_batch_size", _CRITIC_MB),
    _i("critic.forward_micro_batch_size_per_gpu", _CRITIC_MB),
    _i("critic.forward_micro_batch_size", _CRITIC_MB),
    _i("critic.use_dynamic_bsz", _CRITIC_MB),
    _i("critic.ppo_max_token_len_per_gpu", _CRITIC_MB),
    _i("critic.forward_max_token_len_per_gpu", _CRITIC_MB),
    _o("critic.ppo_mini_batch_size", (None,), "the critic updates on actor.ppo_mini_batch_size"),
    _a("critic.ulysses_sequence_parallel_size", "critic.ulysses_sequence_parallel_size"),
    _o("critic.enable", (None,), "a critic runs exactly when algorithm.adv_estimator=gae"),
    # ---- algorithm
    _a("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef"),
    _a("algorithm.kl_ctrl.type", "algorithm.kl_ctrl"),
    _a("algorithm.kl_ctrl.target_kl", "algorithm.target_kl"),
    _a("algorithm.kl_ctrl.horizon", "algorithm.kl_horizon"),
    _a("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    _o("algorithm.use_pf_ppo", (False,), "no prioritized-replay PPO"),
    _a("algorithm.rollout_correction.rollout_is", "algorithm.rollout_is", convert=_rollout_is),
    _a("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_is_threshold"),
    _a(
        "algorithm.rollout_correction.rollout_rs",
        "algorithm.rollout_rs",
        "token, sequence, geometric; null is none",
        _rollout_rs,
    ),
    _d(
        "algorithm.rollout_correction.rollout_rs_threshold",
        "algorithm.rollout_rs_threshold",
        "null is rollout_is_threshold, as in verl",
        _rs_threshold,
    ),
    _a(
        "algorithm.rollout_correction.rollout_rs_threshold_lower",
        "algorithm.rollout_rs_threshold_lower",
        "null (1 / upper) is 0",
        _null_to(0.0),
    ),
    _a(
        "algorithm.rollout_correction.rollout_token_veto_threshold",
        "algorithm.rollout_token_veto_threshold",
        "null (off) is 0",
        _null_to(0.0),
    ),
    _o(
        "algorithm.rollout_correction.rollout_is_batch_normalize",
        (False, None),
        "importance weights are not normalised over the batch",
    ),
    _o("algorithm.rollout_correction.bypass_mode", (False,), "old log-probs are recomputed"),
    _a("algorithm.filter_groups.enable", "algorithm.filter_groups"),
    _d(
        "algorithm.filter_groups.metric",
        "algorithm.filter_groups_metric",
        "seq_reward (summed token scores, overlong penalty included) is score; so is "
        "seq_final_reward, without algorithm.use_kl_in_reward",
        _filter_metric,
    ),
    _a(
        "algorithm.filter_groups.max_num_gen_batches",
        "algorithm.max_gen_batches",
        "when the rounds find too few informative groups, verl stops with an error; polyrl "
        "fills the batch with uninformative ones. verl's 0 (no limit) is an error",
        _gen_batches,
    ),
    _a(
        "data.gen_batch_size",
        "algorithm.gen_batch_size",
        "prompts generated per dynamic-sampling round, before filtering",
    ),
    # ---- reward
    _d(
        "custom_reward_function.path",
        "reward.custom_function",
        "with .name (default compute_score) becomes 'path:name'",
        _reward_function,
    ),
    _d(
        "custom_reward_function.name",
        "reward.custom_function",
        "see custom_reward_function.path",
        _reward_function,
    ),
    _d(
        "reward_model.enable",
        "reward.model_path",
        "True with .model.path scores with that reward model alone (reward.rule_weight=0, "
        "as verl's reward manager does)",
        _reward_model,
    ),
    _d("reward_model.model.path", "reward.model_path", "see reward_model.enable", _reward_model),
    _i(
        "reward_model.model.input_tokenizer",
        "responses are decoded with the policy's tokenizer and rendered with the reward "
        "model's own chat template",
    ),
    _a("reward_model.micro_batch_size_per_gpu", "reward.model_batch_size", convert=_null_skip),
    _a("reward_model.max_length", "reward.model_max_length", convert=_null_skip),
    _o(
        "reward_model.reward_manager",
        ("naive", "dapo"),
        "polyrl's reward manager scores each response (naive); dapo's overlong penalty is "
        "reward.overlong_buffer_len",
    ),
    _i("reward_model.launch_reward_fn_async", "rewards are always scored in worker processes"),
    _d(
        "reward_model.overlong_buffer.enable",
        "reward.overlong_buffer_len",
        "with .len and .penalty_factor (DAPO)",
        _overlong_buffer,
    ),
    _d("reward_model.overlong_buffer.len", "reward.overlong_buffer_len", "", _overlong_buffer),
    _d(
        "reward_model.overlong_buffer.penalty_factor",
        "reward.overlong_penalty_factor",
        "",
        _overlong_buffer,
    ),
    _o("reward_manager.name", ("naive",), "polyrl's reward manager is verl's naive one"),
    # ---- data
    _a("data.train_files", note="a path, a list, or verl's \"['a','b']\" string"),
    _a("data.val_files", note="a path, a list, or verl's \"['a','b']\" string"),
    _a("data.train_batch_size"),
    _a("data.val_batch_size", convert=_null_skip),
    _a("data.max_prompt_length"),
    _a(
        "data.max_response_length",
        note="also sets rollout.max_new_tokens unless that is given (verl generates this long)",
    ),
    _a("data.prompt_key"),
    _a("data.image_key", note="read when the model is a vision-language model"),
    _a("data.video_key", note="videos as frame lists"),
    _a("data.truncation", note="verl's middle has no polyrl equivalent"),
    _a("data.shuffle"),
    _a("data.seed", convert=_null_skip),
    _a(
        "data.apply_chat_template_kwargs",
        note="the dataset and every agent loop pass it to apply_chat_template",
        convert=_null_skip,
    ),
    _d(
        "data.filter_overlong_prompts",
        "data.truncation",
        "true sets data.truncation=filter (whatever data.truncation says, as in verl)",
        _filter_overlong,
        force=True,
    ),
    _i("data.filter_overlong_prompts_workers", _PERF),
    _i("data.dataloader_num_workers", _PERF),
    _i("data.use_shm", _PERF),
    _i("data.return_raw_chat", "prompts are rendered with the chat template on the driver"),
    _i("data.return_raw_input_ids", "prompts are rendered with the chat template on the driver"),
    _i("data.return_full_prompt", "prompts are rendered with the chat template on the driver"),
    _o("data.tokenizer", (None,), "the tokenizer is read from model.path"),
    _o("data.reward_fn_key", ("data_source",), "scorers are picked by the data_source column"),
    _o("data.train_max_samples", (-1, None), "subset the files instead"),
    _o("data.val_max_samples", (-1, None), "subset the files instead"),
    _o("data.custom_cls.path", (None,), "polyrl reads parquet/jsonl rows"),
    _o("data.validation_shuffle", (False,), "validation keeps the file order"),
    # ---- trainer
    _a("trainer.logger", "trainer.loggers", "file is jsonl", _loggers),
    _a("trainer.total_epochs"),
    _a("trainer.total_training_steps", "trainer.total_steps", "null is 0", _null_to(0)),
    _a("trainer.default_local_dir", "trainer.output_dir"),
    _a("trainer.save_freq", note="-1 is 0 (never)", convert=_minus_one_to_zero),
    _a("trainer.test_freq", note="-1 is 0 (never)", convert=_minus_one_to_zero),
    _a("trainer.resume_mode", note="disable is never", convert=_resume_mode),
    _a("trainer.resume_from_path", "trainer.resume_mode", "a checkpoint path", _null_skip),
    _a("trainer.max_actor_ckpt_to_keep", "trainer.max_ckpt_to_keep", convert=_null_skip),
    _a("trainer.max_critic_ckpt_to_keep", "trainer.max_ckpt_to_keep", convert=_null_skip),
    _a("trainer.n_gpus_per_node"),
    _a("trainer.nnodes"),
    _a("trainer.project_name"),
    _a("trainer.experiment_name"),
    _a("trainer.val_before_train"),
    _a("trainer.critic_warmup"),
    _a("trainer.device"),
    _i("trainer.balance_batch", "tunes speed only (token balance over ranks)"),
    _i("trainer.log_val_generations", "validation generations are not logged"),
    _i("trainer.use_legacy_worker_impl", "polyrl has one worker implementation"),
    _i("trainer.ray_wait_register_center_timeout", _PERF),
    _i("trainer.del_local_ckpt_after_load", "checkpoints are kept (trainer.max_ckpt_to_keep)"),
    _i("trainer.esi_redundant_time", _PERF),
    _o("trainer.val_only", (False,), "validate with trainer.total_steps=0 and test_freq"),
    _o("trainer.default_hdfs_dir", (None,), "checkpoints go to trainer.output_dir"),
    _o("trainer.rollout_data_dir", (None,), "rollouts are not dumped"),
    _o("trainer.validation_data_dir", (None,), "validation generations are not dumped"),
    # ---- on-policy distillation (verl's `distillation` group)
    _d(
        f"{_DISTILL}.enabled",
        "algorithm.distill_coef",
        "true: distill_coef from distillation_loss_coef (1.0) and teacher_source=server (verl's "
        "teacher is an inference server)",
        _distillation,
    ),
    _a(f"{_DISTILL}.teacher_model.model_path", "algorithm.teacher_model_path"),
    _i(
        f"{_DISTILL}.teacher_model.inference.*",
        "a teacher the run starts takes the rollout.* options; a larger one: its server's URL "
        "in algorithm.teacher_model_path",
    ),
    _o(
        f"{_DISTILL}.teacher_model.enable_resource_pool",
        (False,),
        "no separate teacher pool: run the teacher's server on its own GPUs and give its URL",
    ),
    _o(f"{_DISTILL}.teacher_model.n_gpus_per_node", (0, None), "see enable_resource_pool"),
    _o(f"{_DISTILL}.teacher_model.nnodes", (0, None), "see enable_resource_pool"),
    _i(f"{_DISTILL}.num_workers", "teacher requests run concurrently over HTTP; " + _PERF),
    _a(
        f"{_DISTILL_LOSS}.loss_mode",
        "algorithm.teacher_topk",
        "k1 only (the sampled-token reverse KL in the advantage); other modes are refused",
        _distill_loss_mode,
    ),
    _i(f"{_DISTILL_LOSS}.topk", "read by verl's top-k loss modes only, which are refused"),
    _o(
        f"{_DISTILL_LOSS}.use_task_rewards",
        (True,),
        "the task reward's advantage always stays; a reward of 0 gives pure distillation",
    ),
    _d(
        f"{_DISTILL_LOSS}.distillation_loss_coef",
        "algorithm.distill_coef",
        "read with distillation.enabled",
        _distillation,
    ),
    _o(f"{_DISTILL_LOSS}.loss_max_clamp", (None,), "the per-token KL is not clamped"),
    _o(f"{_DISTILL_LOSS}.log_prob_min_clamp", (None,), "log-probs are not clamped"),
    _o(
        f"{_DISTILL_LOSS}.use_policy_gradient",
        (True,),
        "the sampled-token KL is a reward; the supervised top-k loss is algorithm.teacher_topk",
    ),
    _o(f"{_DISTILL_LOSS}.policy_loss_mode", ("vanilla",), "the actor's policy loss applies"),
    _i(f"{_DISTILL_LOSS}.clip_ratio", "the actor's clip_ratio_low / _high apply"),
    _i(f"{_DISTILL_LOSS}.clip_ratio_low", "the actor's clip_ratio_low applies"),
    _i(f"{_DISTILL_LOSS}.clip_ratio_high", "the actor's clip_ratio_high applies"),
    # ---- ray, profiling, transfer
    _a("ray_kwargs.ray_init.num_cpus", "ray.num_cpus", convert=_null_to(0)),
    _a("ray_init.num_cpus", "ray.num_cpus", convert=_null_to(0)),
    _i("ray_kwargs.timeline_json_file", _PERF),
    _i("global_profiler.*", _PERF),
    _a("transfer_queue.enable", "transfer.enable"),
)

_EXACT = {e.verl: e for e in VERL_KEYS if not e.verl.endswith(".*")}
_SUBTREES = [e for e in VERL_KEYS if e.verl.endswith(".*")]


def lookup(key: str) -> VerlKey | None:
    """Return the entry of verl ``key`` (exact, or under a ``.*`` subtree), or ``None``."""
    entry = _EXACT.get(key)
    if entry is not None:
        return entry
    for sub in _SUBTREES:
        if key.startswith(sub.verl[:-1]):
            return sub
    return None


def is_verl_only(key: str) -> bool:
    """Whether ``key`` lies under a group that only verl has (``actor_rollout_ref``, ...)."""
    return key.split(".", 1)[0] in VERL_ONLY_ROOTS


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _fmt_off(values: tuple[Any, ...]) -> str:
    return ", ".join("null" if v is None else str(v) for v in values)


def markdown_table() -> str:
    """Return :data:`VERL_KEYS` as a Markdown table: verl key, polyrl key, note."""
    rows = ["| verl key | polyrl key | note |", "| --- | --- | --- |"]
    for e in VERL_KEYS:
        if e.kind == "alias":
            target = "(same key)" if e.polyrl == e.verl else f"`{e.polyrl}`"
            note = e.note
        elif e.kind == "derived":
            target = f"`{e.polyrl}` (derived)"
            note = e.note
        elif e.kind == "ignored":
            target = "ignored"
            note = e.note
        else:
            target = f"only {_fmt_off(e.off)}"
            note = f"other values are an error: {e.note}"
        rows.append(f"| `{e.verl}` | {target} | {_cell(note)} |")
    return "\n".join(rows) + "\n"


# ------------------------------------------------------------------- verl's defaults
#: verl's defaults (``ppo_trainer.yaml``) where polyrl's own defaults differ: a launch line in
#: verl's keys starts from polyrl's defaults plus these, so an option it leaves unset means
#: what it means in verl. ``trainer.output_dir`` follows verl's
#: ``checkpoints/<project_name>/<experiment_name>`` (see :func:`verl_output_dir`).
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    "actor.ppo_mini_batch_size": 256,
    "actor.optim.weight_decay": 0.01,
    "actor.kl_loss_type": "low_var_kl",
    "actor.gradient_checkpointing": True,
    "critic.optim.weight_decay": 0.01,
    "trainer.total_epochs": 30,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.resume_mode": "auto",
}

#: Options a verl line leaves unset that still differ from verl: ``(polyrl key, verl's value,
#: polyrl's value, why)``. ``docs/migrating_from_verl.md`` lists them (:func:`defaults_markdown`).
VERL_DIFFERENCES: tuple[tuple[str, str, str, str], ...] = (
    (
        "algorithm.adv_estimator",
        "gae",
        "the preset's (grpo for `grpo`, gae for `ppo`, ...)",
        "the preset names the algorithm (verl's GRPO lines set it anyway)",
    ),
    (
        "trainer.loggers",
        "[console, wandb]",
        "[console]",
        "wandb needs `pip install polyrl[tracking]` and a login; name it to use it",
    ),
    (
        "trainer.n_gpus_per_node",
        "8",
        "1",
        "set your GPU count; trainer.device=auto (verl: cuda) picks CUDA when present",
    ),
    (
        "rollout.tensor_parallel_size",
        "2",
        "1",
        "polyrl's native engine has no tensor parallelism; set it for vLLM/SGLang",
    ),
    ("rollout.dtype", "bfloat16", "auto", "auto is bfloat16 on CUDA, model.dtype on CPU"),
    ("rollout.max_num_seqs", "1024", "256", "tunes speed or memory only"),
    ("data.val_batch_size", "null (all at once)", "64", "tunes speed or memory only"),
    (
        "data.seed",
        "1",
        "-1 (the run's seed)",
        "the samplers differ anyway, so the prompt order is not verl's",
    ),
)

#: A bundled preset's keys that name its algorithm: a verl line keeps these from the preset
#: it runs under and takes verl's defaults for everything else.
PRESET_ALGORITHM_KEYS = (
    "algorithm.adv_estimator",
    "algorithm.filter_groups",
    "algorithm.filter_groups_metric",
    "agent.enable",
    "agent.default_loop",
    "algorithm.distill_coef",
    "prime",
)


def _get(data: Mapping[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return SKIP
        node = node[part]
    return node


def _put(data: dict[str, Any], key: str, value: Any) -> None:
    *groups, name = key.split(".")
    node = data
    for part in groups:
        node = node.setdefault(part, {})
    node[name] = value


def verl_base(preset: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Return the base a verl launch line runs on, and the preset keys it keeps.

    The base is polyrl's defaults plus :data:`VERL_DEFAULTS`, plus the preset's
    :data:`PRESET_ALGORITHM_KEYS` (``polyrl train ppo`` still means GAE).
    """
    data: dict[str, Any] = {}
    for key, value in VERL_DEFAULTS.items():
        _put(data, key, value)
    kept = []
    for key in PRESET_ALGORITHM_KEYS:
        value = _get(preset, key)
        if value is not SKIP:
            _put(data, key, value)
            kept.append(f"{key}={value}")
    return data, kept


def verl_output_dir(project: str, experiment: str) -> str:
    """Return verl's ``trainer.default_local_dir``: ``checkpoints/<project>/<experiment>``."""
    return f"checkpoints/{project}/{experiment}"


def defaults_markdown() -> str:
    """Return, as Markdown, what a verl line's unset options are where polyrl's differ."""
    rows = [
        "| option | verl's default | a verl line gets |",
        "| --- | --- | --- |",
        *(f"| `{key}` | {value} | the same |" for key, value in VERL_DEFAULTS.items()),
        "| `trainer.output_dir` | checkpoints/<project_name>/<experiment_name> | the same |",
        *(
            f"| `{key}` | {verl} | **{ours}**: {_cell(why)} |"
            for key, verl, ours, why in VERL_DIFFERENCES
        ),
    ]
    kept = ", ".join(f"`{k}`" for k in PRESET_ALGORITHM_KEYS[1:])
    rows.append(
        f"| {kept} | verl's recipe flags | **the preset's**: what `polyrl train PRESET` names |"
    )
    return "\n".join(rows) + "\n"


# ----------------------------------------------------------------------- typos
def _same_word(a: str, b: str) -> bool:
    return a == b or difflib.SequenceMatcher(None, a, b).ratio() >= 0.75


def near_spelling(typo: str, name: str) -> bool:
    """Whether ``typo`` misspells ``name``, without naming another option.

    Word by word (``_``-separated): the same words up to one misspelt word
    (``temprature``), a missing or extra ``_`` (``ppo_mini_batchsize``), or the words'
    initials (``learning_rate`` is ``lr``). A different word is another meaning
    (``gen_batch_size`` is not ``train_batch_size``, ``ppo_micro_`` is not ``ppo_mini_``).
    """
    a, b = typo.lower(), name.lower()
    if a == b:
        return False
    if a.replace("_", "") == b.replace("_", ""):
        return True
    wa, wb = a.split("_"), b.split("_")
    if len(wa) > 1 and "".join(w[:1] for w in wa) == b:
        return True
    if len(wa) != len(wb):
        return False
    differ = [(x, y) for x, y in zip(wa, wb, strict=True) if x != y]
    return len(differ) == 1 and _same_word(*differ[0])


def near_spellings(key: str) -> list[str]:
    """Return the verl keys of ``key``'s group that it misspells (see :func:`near_spelling`)."""
    parent, _, leaf = key.rpartition(".")
    out = []
    for name in _EXACT:
        group, _, other = name.rpartition(".")
        if group == parent and near_spelling(leaf, other) and name not in out:
            out.append(name)
    return out


def is_verl_group(group: str) -> bool:
    """Whether verl options live directly in ``group`` (``critic.model``, ``data``, ...)."""
    return any(name.rpartition(".")[0] == group for name in _EXACT) or any(
        sub.verl[:-2] == group for sub in _SUBTREES
    )
