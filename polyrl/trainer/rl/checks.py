"""The RL trainer's checks of its config, in one place: what cannot run together, refused.

:func:`check_config` runs when an :class:`~polyrl.trainer.rl.RLTrainer` is made, before
anything starts; each refusal is a :class:`~polyrl.config.ConfigError` naming the option to
change. The checks of single options and of one group's fields live with the schema
(:func:`~polyrl.config.schema.validate_tree`, run first here).
"""

from __future__ import annotations

from pathlib import Path

from polyrl.config import ConfigError, PolyRLConfig, response_cap
from polyrl.config.schema import validate_tree
from polyrl.trainer.common import check_devices
from polyrl.trainer.rl.settings import RunSettings, settings_for

__all__ = [
    "check_config",
    "check_engine_installed",
    "check_linked_samples",
    "check_mode",
    "check_teachers",
]


def check_mode(cfg: PolyRLConfig, settings: RunSettings | None = None) -> None:
    """Refuse what ``trainer.mode=one_step_off|async`` cannot run with, naming the option.

    ``settings``: the run's resolved settings (resolved from ``cfg`` when not given).
    """
    mode = cfg.trainer.mode
    if mode == "sync":
        return
    run = settings_for(cfg, settings)
    refused = [
        (
            run.sleeps_during_training,
            "rollout.sleep_during_training",
            "the rollout replicas must keep serving while the engines train; set "
            "rollout.sleep_during_training=false (and rollout.placement=separate on GPUs)",
        ),
        (
            cfg.transfer.enable,
            "transfer.enable",
            "the rollout runs ahead in the driver's rollout thread, not in transfer-queue "
            "workers; set transfer.enable=false",
        ),
        (
            cfg.algorithm.filter_groups,
            "algorithm.filter_groups",
            "dynamic sampling draws extra prompts per step, which the staleness gate does not "
            "count; turn it off",
        ),
        (
            cfg.async_rl.partial_rollout == "resume" and cfg.agent.enable,
            "async_rl.partial_rollout",
            "resume continues single-turn samples from their partial tokens; agent loops "
            "continue on the new weights (use continue)",
        ),
    ]
    for bad, key, why in refused:
        if bad:
            raise ConfigError(f"trainer.mode={mode}: {why}", key=key)


def check_linked_samples(cfg: PolyRLConfig) -> None:
    """Refuse what cannot take an agent's linked samples (``agent.non_extending=split``).

    An ``openai_agent`` episode whose calls do not extend one another becomes several rows
    sharing one episode and one advantage: the estimator must give one number per episode,
    the episode's reward must be its rows' one score (no per-token KL in the reward), and a
    step's rows are no longer ``n`` per prompt (DAPO's group filter and the transfer queue's
    rollout workers count on that).
    """
    from polyrl.trainer.rl.advantage import EPISODE_ESTIMATORS

    agent, algo = cfg.agent, cfg.algorithm
    if not agent.entrypoint or agent.non_extending != "split":
        return
    clashes = {
        "algorithm.adv_estimator": algo.adv_estimator not in EPISODE_ESTIMATORS,
        "algorithm.use_kl_in_reward": algo.use_kl_in_reward,
        "algorithm.filter_groups": algo.filter_groups,
        "transfer.enable": cfg.transfer.enable,
    }
    for key, clash in clashes.items():
        if clash:
            raise ConfigError(
                f"cannot take linked samples (agent.non_extending=split splits an agent "
                f"episode whose calls do not extend one another into several rows sharing its "
                f"advantage; that needs adv_estimator in {', '.join(EPISODE_ESTIMATORS)}, no "
                f"KL in the reward, no filter_groups, no transfer queue); change {key} or set "
                "agent.non_extending=refuse",
                key=key,
            )


def check_engine_installed(backend: str) -> None:
    """Refuse ``rollout.backend=vllm|sglang`` when its virtual environment is missing.

    Both engines run from a venv of their own (found the way their backends find it); without
    this check the run would build its workers first and end in the engine server's remote
    traceback.
    """
    if backend == "vllm":
        from polyrl.rollout.vllm_backend import default_vllm_venv, vllm_available

        venv, found, setup = default_vllm_venv(), vllm_available, " (or make test-vllm)"
    elif backend == "sglang":
        from polyrl.rollout.sglang_backend import default_sglang_venv, sglang_available

        venv, found, setup = default_sglang_venv(), sglang_available, ""
    else:
        return
    if not found(venv):
        raise ConfigError(
            f"is {backend}, but {venv} holds no {backend} installation; create it with "
            f"scripts/setup_{backend}_venv.sh{setup}, or use rollout.backend=native",
            key="rollout.backend",
        )


def check_config(
    cfg: PolyRLConfig,
    has_rows: bool = False,
    has_model: bool = False,
    settings: RunSettings | None = None,
) -> None:
    """Refuse settings that cannot run together, naming the option to change.

    ``has_rows`` / ``has_model``: the caller passes prompt rows / a model directory itself.
    ``settings``: the run's resolved settings (resolved from ``cfg`` when not given).
    """
    from polyrl.trainer.tracking import check_trackers

    validate_tree(cfg)  # cross-field checks, also after options were assigned one by one
    check_devices(cfg, ("trainer.device", "rollout.device"))
    check_trackers(cfg.trainer.loggers)
    check_engine_installed(cfg.rollout.backend)
    algo, actor = cfg.algorithm, cfg.actor
    if not has_rows and not cfg.data.task and not cfg.data.train_files:
        raise ConfigError(
            "no training data: set data.task (a generated task) or data.train_files",
            key="data.train_files",
        )
    if cfg.critic.model_path and not cfg.model.path and not has_model:
        role = (
            "the critic's start"
            if algo.adv_estimator == "gae"
            else f"unused: {algo.adv_estimator} trains no critic"
        )
        raise ConfigError(
            f"is empty, so the policy would be a freshly built random model, while "
            f"critic.model_path={cfg.critic.model_path!r} ({role}); set model.path (verl: "
            "actor_rollout_ref.model.path) to the policy model",
            key="model.path",
        )
    if algo.adv_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline", "prime") and (
        cfg.rollout.n < 2
    ):
        raise ConfigError(
            f"{algo.adv_estimator} compares the responses of one prompt and needs rollout.n >= 2, "
            f"got {cfg.rollout.n}",
            key="rollout.n",
        )
    if algo.filter_groups and (cfg.rollout.n < 2 or algo.adv_estimator == "remax"):
        raise ConfigError(
            "algorithm.filter_groups keeps prompts whose responses differ: it needs rollout.n >= "
            f"2 and an estimator other than remax (got n={cfg.rollout.n}, "
            f"{algo.adv_estimator})",
            key="algorithm.filter_groups",
        )
    drawn = algo.gen_batch_size * algo.max_gen_batches  # 0: rounds of data.train_batch_size
    if algo.filter_groups and 0 < drawn < cfg.data.train_batch_size:
        # Even with every group informative, the rounds could not fill the step's batch.
        raise ConfigError(
            f"algorithm.gen_batch_size={algo.gen_batch_size} x algorithm.max_gen_batches="
            f"{algo.max_gen_batches} rounds draw fewer prompts than data.train_batch_size="
            f"{cfg.data.train_batch_size}; raise one of them",
            key="algorithm.gen_batch_size",
        )
    if algo.filter_groups and cfg.transfer.enable:
        raise ConfigError(
            "algorithm.filter_groups is not supported with transfer.enable (the rollout workers "
            "stream fixed prompt sets); turn one of them off",
            key="algorithm.filter_groups",
        )
    check_linked_samples(cfg)
    run = settings_for(cfg, settings)
    check_mode(cfg, run)
    reward = cfg.reward
    if reward.rule_weight == 0.0 and not reward.model_path and not reward.judge_template:
        raise ConfigError(
            "is 0 and neither reward.model_path nor reward.judge_template is set: nothing "
            "would score the responses",
            key="reward.rule_weight",
        )
    if reward.model_path and not Path(reward.model_path, "config.json").is_file():
        raise ConfigError(
            f"{reward.model_path!r} is not a Hugging Face model directory (no config.json); "
            "expected a *ForSequenceClassification checkpoint with num_labels=1",
            key="reward.model_path",
        )
    check_teachers(cfg)
    if cfg.data.curriculum != "none" and cfg.transfer.enable:
        raise ConfigError(
            "data.curriculum records each prompt's outcome in the driver; it is not supported "
            "with transfer.enable (the rollout workers score the prompts); turn one of them off",
            key="data.curriculum",
        )
    if algo.overlong_filter and cfg.transfer.enable:
        raise ConfigError(
            "algorithm.overlong_filter masks rows in the driver's batch; it is not supported with "
            "transfer.enable (the ranks rebuild their masks from the queue); turn one of them off",
            key="algorithm.overlong_filter",
        )
    for key, kind in (
        ("algorithm.kl_penalty", algo.kl_penalty if algo.use_kl_in_reward else ""),
        ("actor.kl_loss_type", actor.kl_loss_type if actor.use_kl_loss else ""),
    ):
        if kind == "full":
            raise ConfigError(
                "'full' (the exact KL of the whole next-token distributions) needs the policy's "
                "and the reference's log-probabilities over the whole vocabulary at every "
                "response token, but the engines hand each other one log-prob per token (the "
                "whole distributions would be B x T x vocabulary floats per step); use k3 / "
                "low_var_kl, k1, k2 or abs here, or call polyrl.algo.kl_penalty(logp, ref_logp, "
                "'full') on log_softmax outputs in a loop of your own",
                key=key,
            )
    response = response_cap(cfg)
    if cfg.reward.overlong_buffer_len > response:
        raise ConfigError(
            f"{cfg.reward.overlong_buffer_len} exceeds the maximum response length ({response}); "
            "the buffer is the last part of the allowed length",
            key="reward.overlong_buffer_len",
        )
    batch = cfg.data.train_batch_size
    if actor.ppo_mini_batch_size and batch % actor.ppo_mini_batch_size:
        raise ConfigError(
            f"{actor.ppo_mini_batch_size} must divide data.train_batch_size ({batch})",
            key="actor.ppo_mini_batch_size",
        )
    world = cfg.trainer.world_size
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        tp, sp = section.tensor_parallel_size, section.ulysses_sequence_parallel_size
        if world % (tp * sp):
            raise ConfigError(
                f"{role}.tensor_parallel_size ({tp}) x {role}.ulysses_sequence_parallel_size "
                f"({sp}) must divide trainer.world_size ({world}): the data-parallel size is "
                "world / (tp * sp)",
                key=f"{role}.tensor_parallel_size",
            )
    if actor.engine_backend == "megatron":
        # Megatron's initialize_model_parallel refuses these too, but only in the started workers.
        mg = actor.megatron
        tp = mg.tensor_model_parallel_size
        if world % tp:
            raise ConfigError(
                f"actor.megatron.tensor_model_parallel_size ({tp}) must divide trainer.world_size "
                f"({world}): the data-parallel size is world / tp",
                key="actor.megatron.tensor_model_parallel_size",
            )
        ep, etp = mg.expert_model_parallel_size, mg.expert_tensor_parallel_size
        if world % (ep * etp):
            raise ConfigError(
                f"actor.megatron.expert_model_parallel_size ({ep}) x expert_tensor_parallel_size "
                f"({etp}) must divide trainer.world_size ({world})",
                key="actor.megatron.expert_model_parallel_size",
            )
    minis = run.num_mini_batches
    if (batch * cfg.rollout.n) // world < minis:
        raise ConfigError(
            f"{batch} prompts x {cfg.rollout.n} responses over {world} ranks leave fewer rows per "
            f"rank than the {minis} mini-batches; raise data.train_batch_size",
            key="actor.ppo_mini_batch_size",
        )
    if cfg.transfer.enable and (batch * cfg.rollout.n) % world:
        raise ConfigError(
            f"with transfer.enable the {batch} prompts x {cfg.rollout.n} responses must split "
            f"evenly over the {world} ranks (each rank fetches its own rows, unpadded)",
            key="data.train_batch_size",
        )
    prime = cfg.prime
    if algo.adv_estimator == "prime":
        if prime.mini_batch_size and batch % prime.mini_batch_size:
            raise ConfigError(
                f"{prime.mini_batch_size} must divide data.train_batch_size ({batch})",
                key="prime.mini_batch_size",
            )
        prm_minis = run.prm_mini_batches
        if (batch * cfg.rollout.n) // world < prm_minis:
            raise ConfigError(
                f"{batch} prompts x {cfg.rollout.n} responses over {world} ranks leave fewer "
                f"rows per rank than the {prm_minis} PRM mini-batches; raise it or "
                "data.train_batch_size",
                key="prime.mini_batch_size",
            )
        if prime.update == "none" and not prime.model_path:
            raise ConfigError(
                "is none (a frozen PRM) but prime.model_path is empty: a PRM started from the "
                "policy equals the reference, so every implicit reward would be 0; set "
                "prime.model_path to a trained PRM or use before/after",
                key="prime.update",
            )
    if actor.router_replay:
        # The routes travel only in the single-turn batch of the native rollout backend.
        blocked = [
            (cfg.rollout.backend != "native", f"rollout.backend={cfg.rollout.backend}"),
            (cfg.agent.enable, "agent.enable=true"),
            (cfg.transfer.enable, "transfer.enable=true"),
        ]
        reasons = [why for bad, why in blocked if bad]
        if reasons:
            raise ConfigError(
                f"routing replay needs the native rollout backend's single-turn batches; "
                f"unsupported with {', '.join(reasons)}",
                key="actor.router_replay",
            )
    if actor.max_tokens_per_micro_batch < cfg.data.max_prompt_length + response:
        raise ConfigError(
            f"{actor.max_tokens_per_micro_batch} is below the longest sequence "
            f"({cfg.data.max_prompt_length} prompt + {response} response tokens)",
            key="actor.max_tokens_per_micro_batch",
        )


def _is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def check_teachers(cfg: PolyRLConfig) -> None:
    """Check the on-policy distillation options (``algorithm.distill_coef`` and its teachers).

    Raises:
        ConfigError: a distillation without a teacher, a teacher that is neither a model
            directory nor (server source) a URL, or a server-only option with the engine role.
    """
    algo = cfg.algorithm
    server = algo.teacher_source == "server"
    if algo.distill_coef > 0 and not (algo.teacher_model_path or algo.teachers):
        raise ConfigError(
            "on-policy distillation (algorithm.distill_coef > 0) needs a teacher: set "
            "algorithm.teacher_model_path (or, with teacher_source=server, algorithm.teachers)",
            key="algorithm.teacher_model_path",
        )
    if not server:
        for key, value, what in (
            ("algorithm.teachers", algo.teachers, "several teachers by data_source"),
            ("algorithm.teacher_topk", algo.teacher_topk, "the teacher's top-k distribution"),
        ):
            if value:
                raise ConfigError(
                    f"{what} come from teacher rollout servers (their prompt log-probs), not "
                    "from the reference engine role: set algorithm.teacher_source=server",
                    key=key,
                )
    if (server or algo.teacher_topk or algo.teachers) and cfg.transfer.enable:
        raise ConfigError(
            "a teacher served by a rollout server scores the driver's batch; it is not "
            "supported with transfer.enable; use teacher_source=engine or turn the queue off",
            key="algorithm.teacher_source",
        )
    if server and cfg.rollout.backend == "sglang":
        raise ConfigError(
            "a teacher's server scores samples with prompt log-probs, which the sglang backend "
            "does not return: run the teachers on the native or vllm backend (give their URLs)",
            key="algorithm.teacher_source",
        )
    specs = [("algorithm.teacher_model_path", algo.teacher_model_path)] + [
        (f"algorithm.teachers.{source}", spec) for source, spec in algo.teachers.items()
    ]
    for key, spec in specs:
        if not spec or (server and _is_url(spec)):
            continue
        if not (Path(spec) / "config.json").is_file():
            also = " or the URL of a running rollout server" if server else ""
            raise ConfigError(
                f"{spec!r} is not a Hugging Face model directory (no config.json); expected "
                f"the teacher's model directory{also}",
                key=key,
            )
