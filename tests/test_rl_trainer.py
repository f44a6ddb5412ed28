"""The RL trainer: batch assembly, engine losses, config checks, and end-to-end runs.

The end-to-end tests start real rollout server subprocesses, real reward worker processes and
real engine workers (Ray actors, or local processes), on the nano tiny model.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.core.batch import Batch
from polyrl.core.rollout_batch import build_rollout_batch, rollout_widths, widen_rollout_batch
from polyrl.model_engine.engine import GLOBAL_SEQS_KEY, GLOBAL_TOKENS_KEY
from polyrl.trainer.rl import RLTrainer
from polyrl.trainer.rl.advantage import place_on_last_token
from polyrl.trainer.rl.asynchronous import AheadRollout
from polyrl.trainer.rl.rollout import group_varies, select_groups
from polyrl.trainer.rl.settings import resolved_config
from polyrl.trainer.rl_losses import actor_loss, critic_loss, state_values

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ pure parts
def test_build_rollout_batch_left_pads_prompts_and_right_pads_responses():
    batch = build_rollout_batch(
        [[5, 6, 7], [8]],
        [[1, 2], [3, 4, 9]],
        pad_token_id=0,
        rollout_log_probs=[[-0.5, -0.25], [-1.0, -2.0, -3.0]],
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch["rollout_log_probs"][1].tolist() == [0, 0, 0, -1.0, -2.0, -3.0]
    assert batch["response_length"].tolist() == [2, 3]
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        build_rollout_batch([[]], [[1]], 0)


def test_widen_rollout_batch_equals_building_at_the_wider_layout():
    prompts, responses = [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]]
    lps = [[-0.5, -0.25], [-1.0, -2.0, -3.0]]
    narrow = build_rollout_batch(prompts, responses, 0, lps)
    narrow.non_tensors["uid"] = ["a", "b"]
    assert rollout_widths(narrow) == (3, 3)
    wide = widen_rollout_batch(narrow, 5, 4, pad_token_id=99)
    want = build_rollout_batch(prompts, responses, 99, lps, width_prompt=5, width_response=4)
    assert rollout_widths(wide) == (5, 4)
    for key in want.tensor_keys:
        # Padding ids differ only where the mask is 0 (the narrow batch's own pads were 0).
        got, ref = wide[key], want[key]
        if key == "input_ids":
            got, ref = got * wide["attention_mask"], ref * want["attention_mask"]
        assert torch.equal(got, ref), key
    assert list(wide.non_tensors["uid"]) == ["a", "b"]
    assert widen_rollout_batch(narrow, 3, 3, 0) is narrow
    with pytest.raises(ValueError, match="cannot narrow"):
        widen_rollout_batch(narrow, 2, 3, 0)


def test_inline_plane_joins_only_the_named_output_column():
    from polyrl.core.columns import ENTROPY, LOSS_MASK, OLD_LOG_PROBS, VALUES
    from polyrl.trainer.rl.dataplane import InlinePlane

    rows = Batch(tensors={"x": torch.arange(3.0), LOSS_MASK: torch.ones(3, 2)})
    calls = []

    def method(batch: Batch, **kwargs) -> Batch:
        calls.append((len(batch), kwargs))  # padded to the data-parallel size
        return Batch(tensors={OLD_LOG_PROBS: batch["x"] * 2, ENTROPY: batch["x"]})

    plane = InlinePlane(load_config("demo"), world_size=2)
    out = plane.infer(method, rows, OLD_LOG_PROBS, share_prefix=True)
    assert calls == [(4, {"share_prefix": True})]
    assert set(out.keys()) == {"x", LOSS_MASK, OLD_LOG_PROBS}  # not the entropy nobody asked for
    assert torch.equal(out[OLD_LOG_PROBS], torch.tensor([0.0, 2.0, 4.0]))
    with pytest.raises(KeyError, match=VALUES):
        plane.infer(method, rows, VALUES)


def test_group_varies_and_select_groups_prefer_informative_groups():
    acc = torch.tensor([1, 1, 0, 1, 0, 0, 1, 0, 1, 1, 1, 1], dtype=torch.float32)
    varies = group_varies(acc, 2)  # groups: [1,1] [0,1] [0,0] [1,0] [1,1] [1,1]
    assert varies.tolist() == [False, True, False, True, False, False]
    assert select_groups(varies, 2).tolist() == [1, 3]
    # Fewer informative groups than needed: the earliest uninformative ones fill the rest.
    assert select_groups(varies, 4).tolist() == [0, 1, 2, 3]
    assert group_varies(torch.tensor([0.5, 0.5 + 1e-9]), 2).tolist() == [False]
    with pytest.raises(ValueError, match="groups of 4"):
        group_varies(acc[:6], 4)
    with pytest.raises(ValueError, match="7 needed"):
        select_groups(varies, 7)


def test_place_on_last_token_handles_empty_responses():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    out = place_on_last_token(torch.tensor([2.0, 5.0, -1.0]), mask)
    assert out.tolist() == [[0, 0, 2.0, 0], [0, 0, 0, 0], [0, 0, 0, -1.0]]


class _Output:
    """Stand-in for the engine's ModelOutput: per-token tensors a loss reads (no model)."""

    def __init__(self, log_probs=None, entropy=None, values=None):
        self.log_probs = log_probs
        self._entropy = entropy
        self.values = values

    def log_probs_and_entropy(self):
        return self.log_probs, self._entropy


class _HealthTable:
    """A rollout client whose replicas answer ``/health`` from a table (others refuse)."""

    def __init__(self, versions: dict[str, int]) -> None:
        self.versions = versions

    async def health(self, url: str, timeout: float | None = None) -> dict:
        if url not in self.versions:
            raise httpx.ConnectError(f"{url} refused the connection")
        return {"status": "ok", "weight_version": self.versions[url]}


def test_replicas_ask_weight_versions_through_the_producers_client_from_any_thread():
    from types import SimpleNamespace

    from polyrl.trainer.rl.generation import Replicas
    from polyrl.trainer.rl.rollout import RolloutProducer

    cfg = load_config("demo", ["trainer.device=cpu"])
    loop = asyncio.new_event_loop()
    rewards = SimpleNamespace(attach_rollout=lambda client: None)
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    producer = RolloutProducer(cfg, _HealthTable({"http://a": 3}), tokenizer, rewards, loop)
    replicas = Replicas(cfg, ["http://a"], producer, ("shm", {}))
    try:
        assert replicas._weight_version("http://a") == 3
        assert replicas._weight_version("http://b") is None  # does not answer
        # During a generation the loop runs, and the watch's thread asks through it.
        asked = producer.run(asyncio.to_thread(replicas._weight_version, "http://a"))
        assert asked == 3
    finally:
        loop.close()


def _rl_batch(adv, mask, **extra):
    return Batch(tensors={"advantages": adv, "loss_mask": mask, **extra})


def test_actor_loss_on_policy_is_minus_mean_advantage_and_split_invariant():
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 0], [1, 1, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([[0, 1.0, 1.0, 1.0], [0, 0, -2.0, 0], [0.5, 0.5, 0, 0]])
    logp = torch.full((3, 4), -1.0, requires_grad=True)
    whole, metrics = actor_loss(_Output(logp), _rl_batch(adv, mask), clip_ratio_c=None)
    # Ratio 1 everywhere: token-mean of -A over the 6 masked tokens.
    assert whole.item() == pytest.approx(-(3 * 1.0 - 2.0 + 2 * 0.5) / 6)
    assert metrics["pg_clipfrac"] == 0.0
    # Two micro-batches with the mini-batch-wide counts add up to the whole loss, per mode.
    for mode in (
        "token-mean",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ):
        ref, _ = actor_loss(_Output(logp), _rl_batch(adv, mask), loss_agg_mode=mode, horizon=4)
        parts = []
        for rows in ([0], [1, 2]):
            mb = _rl_batch(adv[rows], mask[rows])
            mb.meta[GLOBAL_TOKENS_KEY] = 6.0
            mb.meta[GLOBAL_SEQS_KEY] = 3.0
            parts.append(actor_loss(_Output(logp[rows]), mb, loss_agg_mode=mode, horizon=4)[0])
        assert sum(parts).item() == pytest.approx(ref.item(), abs=1e-6), mode


def test_actor_loss_weights_advantages_by_the_rollout_correction():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, 0.0]])
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    rollout = torch.log(torch.tensor([[0.25, 0.5, 0.5]]))  # token 0: weight 2, truncated to 1.5
    logp = old.clone().requires_grad_(True)
    batch = _rl_batch(adv, mask, old_log_probs=old, rollout_log_probs=rollout)
    plain, _ = actor_loss(_Output(logp), batch, clip_ratio_c=None)
    loss, m = actor_loss(
        _Output(logp), batch, clip_ratio_c=None, rollout_is="token", rollout_is_threshold=1.5
    )
    # Ratio 1: token-mean of -w A = -(1.5 * 1 + 1 * -1) / 2, against -(1 - 1) / 2 without.
    assert plain.item() == pytest.approx(0.0)
    assert loss.item() == pytest.approx(-0.25)
    assert m["rollout_is_mean"] == pytest.approx(1.5) and m["rollout_is_clipfrac"] == 0.5
    with pytest.raises(KeyError, match="rollout_log_probs"):
        actor_loss(_Output(logp), _rl_batch(adv, mask), rollout_is="sequence")


def test_actor_loss_clips_and_adds_kl_and_entropy_terms():
    mask = torch.ones(1, 2)
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    logp = torch.log(torch.tensor([[0.9, 0.5]]))  # ratio 1.8 on token 0, 1 on token 1
    adv = torch.tensor([[1.0, 1.0]])
    batch = _rl_batch(adv, mask, old_log_probs=old, ref_log_probs=logp.clone())
    loss, m = actor_loss(_Output(logp), batch, clip_ratio_high=0.2, clip_ratio_c=None)
    assert loss.item() == pytest.approx(-(1.2 + 1.0) / 2)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    ent = torch.tensor([[2.0, 4.0]])
    loss2, m2 = actor_loss(
        _Output(logp, entropy=ent),
        batch,
        clip_ratio_high=0.2,
        clip_ratio_c=None,
        entropy_coeff=0.1,
        use_kl_loss=True,
        kl_loss_coef=0.5,
    )
    # KL to an identical reference is 0; the entropy bonus subtracts 0.1 * mean(2, 4).
    assert loss2.item() == pytest.approx(loss.item() - 0.3)
    assert m2["kl_loss"] == pytest.approx(0.0) and m2["entropy_loss"] == pytest.approx(3.0)
    with pytest.raises(KeyError, match="ref_log_probs"):
        actor_loss(_Output(logp), _rl_batch(adv, mask), use_kl_loss=True)


def test_critic_loss_reads_state_aligned_values():
    assert state_values(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[0.0, 1.0, 2.0]]
    mask = torch.tensor([[0, 1.0, 1.0]])
    # The head's outputs at positions 0 and 1 are the values of response tokens 1 and 2.
    head = torch.tensor([[0.5, 1.5, 9.0]], requires_grad=True)
    batch = Batch(
        tensors={
            "loss_mask": mask,
            "returns": torch.tensor([[0, 1.0, 1.0]]),
            "values": torch.tensor([[0, 0.5, 1.5]]),
        }
    )
    loss, metrics = critic_loss(_Output(values=head), batch, cliprange_value=10.0)
    assert loss.item() == pytest.approx(0.5 * ((0.5 - 1) ** 2 + (1.5 - 1) ** 2) / 2)
    assert metrics["vpred_mean"] == pytest.approx(1.0)


def test_engine_actor_loss_does_not_depend_on_micro_batching(tiny_qwen2_dir):
    from polyrl.model_engine import EngineConfig, build_engine
    from polyrl.trainer.rl_losses import actor_loss as loss_fn

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(20, 200, (n,), generator=gen).tolist() for n in (3, 5, 2, 4)]
    responses = [torch.randint(20, 200, (n,), generator=gen).tolist() for n in (4, 1, 6, 3)]
    batch = build_rollout_batch(prompts, responses, 0)
    batch["advantages"] = torch.randn(batch["loss_mask"].shape, generator=gen) * batch["loss_mask"]
    losses = []
    for budget in (64, 12):
        engine = build_engine(
            str(tiny_qwen2_dir), EngineConfig(device="cpu", max_tokens_per_micro_batch=budget)
        )
        try:
            with engine.eval_mode():
                out = engine.forward_backward(batch, loss_fn, forward_only=True)
            losses.append((out["loss"], out.get("num_micro_batches")))
        finally:
            engine.close()
    assert losses[0][1] != losses[1][1]
    assert losses[0][0] == pytest.approx(losses[1][0], abs=1e-6)


def test_rl_config_errors_name_the_option():
    with pytest.raises(ConfigError, match="rollout.n"):
        RLTrainer(load_config("demo", ["rollout.n=1"]))
    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size"):
        RLTrainer(load_config("demo", ["actor.ppo_mini_batch_size=5"]))
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        RLTrainer(load_config("demo", ["actor.max_tokens_per_micro_batch=8"]))
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        load_config("demo", ["actor.clip_ratio_c=0.5"])
    with pytest.raises(ConfigError, match="algorithm.filter_groups"):
        RLTrainer(load_config("dapo", ["algorithm.adv_estimator=remax"]))
    with pytest.raises(ConfigError, match="algorithm.filter_groups"):
        RLTrainer(load_config("dapo", ["transfer.enable=true"]))
    with pytest.raises(ConfigError, match="reward.overlong_buffer_len"):
        RLTrainer(load_config("dapo", ["reward.overlong_buffer_len=17"]))


def test_log_prob_temperature_is_the_rollouts_never_validations():
    from polyrl.trainer.rl.generation import log_prob_temperature

    def temperature(*overrides: str) -> float:
        return log_prob_temperature(load_config("demo", list(overrides)))

    assert temperature("rollout.temperature=0.7", "rollout.val_temperature=1.3") == 0.7
    assert temperature("rollout.temperature=0.7", "rollout.val_temperature=0") == 0.7
    # Greedy sampling: the servers report temperature-1 log-probs, the engines compute those.
    assert temperature("rollout.temperature=0", "rollout.val_temperature=0.6") == 1.0


def test_rl_trainer_seeds_the_policy_loss_from_the_step():
    def seed_of(step: int) -> int:
        trainer = RLTrainer(load_config("demo", ["actor.policy_loss=clip_cov"]))
        return trainer._actor_loss_kwargs(step)["policy_loss_options"]["seed"]

    # A resumed run (a new trainer) gives a step the seed the first run gave it (clip_cov's
    # draws, see test_clip_cov_draws_from_its_seed_not_the_global_rng); each step its own.
    assert seed_of(3) == seed_of(3) != seed_of(4)


# ------------------------------------------------------------------------------ end to end
SHORT_TEXT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Dense and easy to learn from a random model: shorter decoded text scores higher.
    return -len(solution_str) / 50.0
"""


def _e2e_overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    reward = tmp_path / "reward.py"
    reward.write_text(SHORT_TEXT_REWARD)
    return [
        f"trainer.output_dir={tmp_path / name}",
        f"reward.custom_function={reward}:compute_score",
        "data.num_train=64",
        "data.num_val=8",
        "data.train_batch_size=8",
        "data.val_batch_size=8",
        "rollout.n=4",
        "rollout.max_new_tokens=8",
        "data.max_response_length=8",
        "trainer.loggers=[jsonl]",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "reward.num_workers=1",
        *extra,
    ]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def assert_policy_updated(out: Path, model_dir: Path, steps: int) -> None:
    """Each of ``steps`` steps had a gradient, and the exported policy is not the initial one.

    For end-to-end runs that check little else: ``steps == N`` alone passes without updates.
    """
    from safetensors.torch import load_file

    norms = [r["actor/grad_norm"] for r in _records(out) if "actor/grad_norm" in r]
    assert len(norms) == steps and all(n > 0 and math.isfinite(n) for n in norms), norms
    (start,) = model_dir.glob("*.safetensors")
    (end,) = (out / "hf_model").glob("*.safetensors")
    before, after = load_file(start), load_file(end)
    moved = [k for k in before.keys() & after.keys() if not torch.equal(before[k], after[k])]
    assert moved, "the exported policy has the initial weights"


@pytest.mark.slow
def test_grpo_on_ray_raises_the_reward(tmp_path, ray_session):
    cfg = load_config(
        "demo",
        _e2e_overrides(
            tmp_path,
            "grpo",
            "trainer.worker_backend=ray",
            "trainer.total_steps=10",
            "actor.lr=0.01",
            "trainer.test_freq=5",
            "trainer.val_before_train=true",
            "rollout.n=8",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_epochs=2",
            "rollout.sleep_during_training=true",
            "trainer.n_gpus_per_node=2",  # two CPU ranks (gloo): data-parallel updates
        ),
    )
    summary = RLTrainer(cfg).fit()
    records = [r for r in _records(tmp_path / "grpo") if "critic/score/mean" in r]
    assert [r["step"] for r in records] == list(range(1, 11))
    scores = [r["critic/score/mean"] for r in records]
    # Four optimizer steps per RL step (2 mini-batches x 2 epochs) on a dense reward.
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 0.05, scores
    assert records[-1]["actor/num_updates"] == 4
    for key in (
        "actor/pg_loss",
        "actor/grad_norm",
        "actor/entropy",
        "timing_s/gen",
        "timing_s/update_actor",
        "perf/throughput",
        "response_length/mean",
    ):
        assert all(key in r for r in records), key
    assert records[-1]["rollout/weight_version"] == 9  # generated by the weights of step 9
    assert summary["first_val_acc"] is not None and Path(summary["plot"]).is_file()


@pytest.mark.slow
def test_ppo_with_critic_on_ray_separate_placement(tmp_path, ray_session):
    cfg = load_config(
        "ppo",
        _e2e_overrides(
            tmp_path,
            "ppo",
            "trainer.worker_backend=ray",
            "trainer.total_steps=3",
            "trainer.placement=separate",
            "model.tiny_size=nano",
            "actor.ppo_mini_batch_size=4",
            "trainer.save_freq=2",
            "trainer.max_ckpt_to_keep=1",
            "actor.lr=0.001",
        ),
    )
    free_before = ray_session.available_resources().get("CPU", 0.0)
    RLTrainer(cfg).fit()
    # The trainer gives its placement-group reservations back when it closes.
    deadline = time.monotonic() + 30
    while ray_session.available_resources().get("CPU", 0.0) < free_before - 1e-6:
        assert time.monotonic() < deadline, ray_session.available_resources()
        time.sleep(0.5)
    records = [r for r in _records(tmp_path / "ppo") if "critic/score/mean" in r]
    assert len(records) == 3
    for r in records:
        for key in (
            "critic/vf_loss",
            "critic/values/mean",
            "actor/reward_kl_penalty",
            "actor/ppo_kl",
            "timing_s/update_critic",
            "timing_s/values",
        ):
            assert key in r and r[key] == r[key], key  # present and not NaN
    assert records[-1]["critic/vf_loss"] != records[0]["critic/vf_loss"]
    # Saved at steps 2 and 3, one kept: the trainer prunes the critic after the actor's save.
    for role in ("actor", "critic"):
        kept = sorted(p.name for p in (tmp_path / "ppo" / "checkpoints" / role).glob("global_*"))
        assert kept == ["global_step_3"], (role, kept)


def _train_cmd(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "polyrl.cli", "train", "demo", *overrides]


@pytest.mark.slow
def test_killed_run_resumes_with_identical_metrics(tmp_path):
    common = [
        "trainer.worker_backend=local",
        "trainer.total_steps=4",
        "trainer.save_freq=2",
        "actor.ppo_epochs=2",
        "actor.lr=0.003",
        "algorithm.use_kl_in_reward=true",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    full = _e2e_overrides(tmp_path, "full", *common)
    subprocess.run(
        _train_cmd(full), check=True, env=env, cwd=tmp_path, timeout=600, stdout=subprocess.DEVNULL
    )
    broken = _e2e_overrides(tmp_path, "broken", *common)
    proc = subprocess.Popen(
        _train_cmd(broken),
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = tmp_path / "broken" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    # Kill it (with its rollout server and reward workers) once step 3 has been logged: after
    # the step-2 checkpoint, before the step-4 one.
    while time.monotonic() < deadline:
        if marker.exists() and '"step": 3' in marker.read_text():
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    subprocess.run(
        _train_cmd([*broken, "trainer.resume_mode=auto"]),
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
        stdout=subprocess.DEVNULL,
    )

    def comparable(path: Path) -> dict[int, dict]:
        out = {}
        for r in _records(path):
            out[r["step"]] = {
                k: v
                for k, v in r.items()
                if not k.startswith(("timing_s/", "perf/throughput")) and k != "time"
            }
        return out

    a, b = comparable(tmp_path / "full"), comparable(tmp_path / "broken")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        # The server's own log-probs depend (in the last bits) on which requests it happened to
        # batch together; everything the trainer computes must match exactly.
        gap_a, gap_b = a[step].pop("rollout/log_prob_gap"), b[step].pop("rollout/log_prob_gap")
        assert gap_a == pytest.approx(gap_b, abs=1e-6)
        assert a[step] == b[step], step


@pytest.mark.slow
@pytest.mark.parametrize(
    "axis", ["actor.tensor_parallel_size=2", "actor.ulysses_sequence_parallel_size=2"]
)
def test_grpo_on_a_tp_or_sp_mesh_resumes_exactly(tmp_path, axis):
    # Two CPU ranks form one tensor- (or sequence-) parallel group: both get the same rows, the
    # reference engine takes the actor's mesh, the weights pushed to the rollout server are
    # gathered whole, and a checkpoint of that mesh resumes to what the uninterrupted run logs.
    common = [
        axis,
        "trainer.worker_backend=local",
        "trainer.n_gpus_per_node=2",
        "trainer.total_steps=2",
        "trainer.save_freq=1",
        "actor.ppo_epochs=2",  # old log-probs recomputed: the rollout log-prob gap is reported
        "actor.lr=0.003",
        "data.num_train=16",
        "data.train_batch_size=4",
    ]
    full = load_config("demo", _e2e_overrides(tmp_path, "full", *common))
    RLTrainer(full).fit()
    step_1 = tmp_path / "full" / "checkpoints" / "actor" / "global_step_1"
    resumed_cfg = load_config(
        "demo", _e2e_overrides(tmp_path, "resumed", *common, f"trainer.resume_mode={step_1}")
    )
    summary = RLTrainer(resumed_cfg).fit()
    assert summary["resumed_from"] == str(step_1)

    def comparable(path: Path) -> dict[int, dict]:
        return {
            r["step"]: {
                k: v
                for k, v in r.items()
                if not k.startswith(("timing_s/", "perf/throughput")) and k != "time"
            }
            for r in _records(path)
        }

    a, b = comparable(tmp_path / "full"), comparable(tmp_path / "resumed")
    assert sorted(a) == [1, 2] and sorted(b) == [2]
    # Step 2 samples with the weights step 1 pushed: the server's log-probs agree with the
    # engine's, so what it received was every whole tensor (not one rank's shard).
    gap_a, gap_b = a[2].pop("rollout/log_prob_gap"), b[2].pop("rollout/log_prob_gap")
    assert gap_a < 1e-4 and gap_a == pytest.approx(gap_b, abs=1e-6)
    assert a[2]["actor/grad_norm"] > 0 and a[2] == b[2]
    # And the exported policies of the two runs are the same tensors.
    from safetensors.torch import load_file

    (end_a,) = (tmp_path / "full" / "hf_model").glob("*.safetensors")
    (end_b,) = (tmp_path / "resumed" / "hf_model").glob("*.safetensors")
    wa, wb = load_file(end_a), load_file(end_b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
def test_compute_dtype_sets_the_engines_mixed_precision(tmp_path, full_forward_steps):
    # The old log-probs are recomputed by the actor engine (two epochs); at step 1 the rollout
    # server holds the same fp32 weights, so with fp32 rollout matmuls their gap to the server's
    # log-probs is the engine's compute precision: rounding noise in fp32, bf16 rounding with
    # bfloat16 compute. rollout.matmul_dtype=auto follows the compute dtype, which changes the
    # server's log-probs (same seeds otherwise, so an ignored option would give the same gap).
    # float32 with auto matmuls is the full_forward_steps run (its step 1 is the same as a
    # one-step run's: the gap is measured before the first update).
    records = {"float32-auto": full_forward_steps[0]}
    for dtype, rollout_matmul in (("bfloat16", "float32"), ("bfloat16", "auto")):
        name = f"{dtype}-{rollout_matmul}"
        cfg = load_config(
            "demo",
            _e2e_overrides(
                tmp_path,
                name,
                "trainer.worker_backend=local",
                "trainer.total_steps=1",
                "actor.ppo_epochs=2",
                f"model.compute_dtype={dtype}",
                f"rollout.matmul_dtype={rollout_matmul}",
            ),
        )
        RLTrainer(cfg).fit()
        (records[name],) = [r for r in _records(tmp_path / name) if "critic/score/mean" in r]
    gaps = {}
    for name, record in records.items():
        assert math.isfinite(record["actor/pg_loss"]) and math.isfinite(record["actor/grad_norm"])
        gaps[name] = record["rollout/log_prob_gap"]
    assert gaps["float32-auto"] < 1e-5 and gaps["bfloat16-float32"] > 1e-4, gaps
    assert gaps["bfloat16-auto"] != gaps["bfloat16-float32"] and gaps["bfloat16-auto"] < 1e-2, gaps


def test_rollout_matmul_dtype_follows_the_training_compute_dtype():
    from polyrl.config import ConfigError
    from polyrl.trainer.rl import rollout_matmul_dtype

    def resolved(*overrides: str) -> str:
        return rollout_matmul_dtype(load_config("demo", ["trainer.device=cpu", *overrides]))

    assert resolved() == "float32"
    assert resolved("model.compute_dtype=bfloat16") == "bfloat16"
    assert resolved("model.compute_dtype=bfloat16", "rollout.matmul_dtype=float32") == "float32"
    assert resolved("model.dtype=bfloat16") == "bfloat16"
    with pytest.raises(ConfigError, match="matmul_dtype.*native backend only"):
        load_config("demo", ["rollout.backend=vllm", "rollout.matmul_dtype=bfloat16"])


@pytest.mark.slow
def test_python_api_trains_from_rows_with_a_named_reward(tmp_path, tiny_qwen2_dir):
    from polyrl import GRPOTrainer, RLConfig
    from polyrl.config import load_config
    from polyrl.data.tasks import TASKS

    assert RLConfig is type(load_config("demo"))
    rows = TASKS["string_reverse"](24, seed=1, alphabet="abcjoqxz", max_length=4)
    config = load_config(
        "demo",
        [
            f"trainer.output_dir={tmp_path / 'api'}",
            "trainer.total_steps=2",
            "trainer.test_freq=1",
            "data.train_batch_size=4",
            "data.val_batch_size=8",
            "rollout.n=2",
            "trainer.loggers=[jsonl]",
            # A random policy never reverses a string: every advantage is 0, and without the
            # entropy bonus's gradient no weight would move (checked below).
            "actor.entropy_coeff=0.01",
        ],
    )
    trainer = GRPOTrainer(
        model=str(tiny_qwen2_dir),
        config=config,
        reward_fn="string_reverse",  # a registered scorer, by name
        train_dataset=rows[:16],
        eval_dataset=rows[16:],
    )
    assert trainer.config.data.task == "" and trainer.config.algorithm.adv_estimator == "grpo"
    summary = trainer.train()
    assert summary["steps"] == 2 and summary["first_val_acc"] is not None
    assert_policy_updated(tmp_path / "api", tiny_qwen2_dir, steps=2)
    records = _records(tmp_path / "api")
    assert any("val/acc/mean@1" in r for r in records)
    with pytest.raises(ConfigError, match="no training data"):
        GRPOTrainer(model=str(tiny_qwen2_dir), config=load_config("demo", ["data.task="]))


def _switch_config(trainer: RLTrainer, cfg) -> None:
    """Give the trainer and every part built from its config (a test's shortcut) ``cfg``."""
    parts = [trainer, trainer.plane, trainer.rollout, trainer.producer, trainer.replicas]
    if isinstance(trainer.rollout, AheadRollout):  # its rollout thread's producer
        parts.append(trainer.rollout.producer)
    for part in parts:
        part.cfg = cfg


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_estimator_and_policy_loss_runs_a_step(tmp_path, mode):
    import dataclasses

    cfg = load_config(
        "demo",
        _e2e_overrides(
            tmp_path,
            "estimators",
            "trainer.worker_backend=local",
            "trainer.total_steps=8",
            "actor.use_kl_loss=true",
            f"trainer.mode={mode}",
            # One group at a time ahead: each step's groups are generated under its estimator.
            "async.max_staleness=0",
        ),
    )
    trainer = RLTrainer(cfg)
    # ReMax first: its greedy baseline is sampled with the groups, which the async rollout
    # reserves a batch ahead (a later switch to remax would find the next batch without it).
    variants = [
        ("remax", "ppo_clip", False),
        ("grpo", "ppo_clip", False),
        ("grpo", "gspo", False),
        ("rloo", "ppo_clip", False),
        ("reinforce_plus_plus", "ppo_clip", False),
        ("reinforce_plus_plus_baseline", "ppo_clip", True),
    ]
    spreads = {}
    try:
        trainer.setup()
        for step, (estimator, loss, norm) in enumerate(variants, start=1):
            _switch_config(
                trainer,
                dataclasses.replace(
                    cfg,
                    algorithm=dataclasses.replace(
                        cfg.algorithm, adv_estimator=estimator, norm_adv_by_std=norm
                    ),
                    actor=dataclasses.replace(
                        cfg.actor, policy_loss=loss, loss_agg_mode="seq-mean-token-sum-norm"
                    ),
                ),
            )
            metrics = trainer.step(step)
            if mode == "sync":
                assert metrics["rollout/weight_version"] == step - 1, estimator
            else:
                assert metrics["async/staleness_max"] == 0, estimator
            assert "actor/kl_loss" in metrics and metrics["actor/kl_loss"] >= 0.0
            assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])), (estimator, loss)
            if estimator != "remax":
                # Every estimator here centres the rewards (remax uses the greedy baseline).
                assert abs(metrics["critic/advantages/mean"]) < 1.0
            spreads[estimator] = metrics["critic/advantages/max"] - metrics["critic/advantages/min"]
    finally:
        trainer.close()
    # The estimators did run: they spread the same kind of rewards differently.
    assert len({round(v, 6) for v in spreads.values()}) >= 4, spreads


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_new_objective_and_rollout_mask_runs_a_grpo_step(tmp_path, mode):
    import dataclasses

    cfg = load_config(
        "demo",
        _e2e_overrides(
            tmp_path,
            "objectives",
            "trainer.worker_backend=local",
            "trainer.total_steps=8",
            "model.tiny_size=nano",
            f"trainer.mode={mode}",
            "async.max_staleness=0",
            # Wide covariance ranges and shares, so that Clip-Cov and KL-Cov act on this batch.
            "actor.clip_cov_ratio=0.5",
            "actor.clip_cov_lb=-100",
            "actor.clip_cov_ub=100",
            "actor.kl_cov_ratio=0.5",
            # The curriculum records every group's outcome, in both modes.
            "data.curriculum=pass_rate",
            "data.train_batch_size=4",
            "rollout.n=2",
        ),
    )
    trainer = RLTrainer(cfg)
    # One step per objective, each with one of the rollout masks (a veto with clip_cov).
    variants = [
        ("cispo", "token", 0.0),
        ("sapo", "icepop", 0.0),
        ("gmpo", "sequence", 0.0),
        ("gpg", "geometric", 0.0),
        ("clip_cov", "none", 1e-4),
        ("kl_cov", "token", 0.0),
    ]
    try:
        trainer.setup()
        for step, (loss, rs, veto) in enumerate(variants, start=1):
            _switch_config(
                trainer,
                dataclasses.replace(
                    cfg,
                    algorithm=dataclasses.replace(
                        cfg.algorithm, rollout_rs=rs, rollout_token_veto_threshold=veto
                    ),
                    actor=dataclasses.replace(cfg.actor, policy_loss=loss),
                ),
            )
            metrics = trainer.step(step)
            assert math.isfinite(metrics["actor/pg_loss"]), loss
            assert math.isfinite(metrics["actor/grad_norm"]), loss
            # fp32 rollouts against an fp32 trainer: the ratios are 1 up to rounding, inside
            # every band, so nothing is masked; the metrics say so.
            assert metrics["actor/rollout_rs_masked_frac"] == 0.0, (loss, rs)
            assert metrics["actor/rollout_rs_seq_rejected_frac"] == 0.0, (loss, rs)
            if loss in ("clip_cov", "kl_cov"):
                assert metrics[f"actor/{loss}_frac"] > 0.0
        # Every trained prompt's outcome reached the curriculum.
        assert len(trainer.sampler.history) >= 4
    finally:
        trainer.close()


_SERVER_TOPK = ["algorithm.teacher_source=server", "algorithm.teacher_topk=4"]


@pytest.mark.slow
def test_on_policy_distillation_scores_the_students_tokens_with_the_teacher(tmp_path):
    from polyrl.models.tiny import build_tiny_model

    base = load_config("demo", ["model.tiny_size=nano"])
    reverse_kl = {}
    # The teacher as the reference engine role, and as a rollout server with the top-k loss.
    cases = (("same", base.seed, []), ("other", base.seed + 1, _SERVER_TOPK))
    for name, seed, source in cases:
        # The same seed builds the student's own weights: a teacher identical to the student.
        teacher = build_tiny_model(base.model.tiny_arch, tmp_path / name, size="nano", seed=seed)
        overrides = _e2e_overrides(
            tmp_path,
            f"opd_{name}",
            "trainer.worker_backend=local",
            "trainer.total_steps=1",
            "model.tiny_size=nano",
            "data.train_batch_size=4",
            "rollout.n=2",
            "algorithm.distill_coef=1.0",
            f"algorithm.teacher_model_path={teacher}",
            *source,
        )
        trainer = RLTrainer(load_config("demo", overrides))
        try:
            trainer.setup()
            metrics = trainer.step(1)
        finally:
            trainer.close()
        assert math.isfinite(metrics["actor/pg_loss"])
        if source:
            assert metrics["actor/distill_topk_kl"] > 0 and "timing_s/teacher" in metrics
        reverse_kl[name] = metrics["opd/reverse_kl"]
    # The student against itself: 0 up to rounding; against another model: clearly not.
    assert abs(reverse_kl["same"]) < 1e-4, reverse_kl
    assert abs(reverse_kl["other"]) > 1e-2, reverse_kl


@pytest.mark.slow
def test_async_grpo_with_the_tool_loop_runs_multi_turn_steps(tmp_path):
    import dataclasses

    from polyrl.agent.tool_loop import ParsedToolCall, ToolParser, register_tool_parser

    @register_tool_parser("test_rl_always_calc")
    class AlwaysCalc(ToolParser):
        """Reads every model turn as a calculator call, so a random model uses the tool."""

        def parse(self, text: str) -> list[ParsedToolCall]:
            return [ParsedToolCall("calculator", {"expression": "123*456"})]

    cfg = load_config(
        "grpo_tool",
        _e2e_overrides(
            tmp_path,
            "tool",
            "trainer.worker_backend=local",
            "trainer.total_steps=3",
            "model.tiny_size=nano",
            "data.max_prompt_length=512",
            "data.max_response_length=96",
            "rollout.max_new_tokens=16",
            "agent.max_turns=3",
            "agent.tool_parser=test_rl_always_calc",
            "actor.max_tokens_per_micro_batch=4096",
            # Agent loops in the asynchronous mode: the rollout thread runs them ahead.
            "trainer.mode=async",
        ),
    )
    # Extra stop ids end the random model's turns early, so the loop goes on to the tool.
    cfg = dataclasses.replace(
        cfg, rollout=dataclasses.replace(cfg.rollout, stop_token_ids=list(range(20, 1024, 3)))
    )
    RLTrainer(cfg).fit()
    records = [r for r in _records(tmp_path / "tool") if "critic/score/mean" in r]
    assert len(records) == 3
    for r in records:
        assert r["num_turns/mean"] > 1.0  # the tool answered and the model went on
        assert r["tool_calls/mean"] >= 1.0 and r["tool_errors/mean"] == 0.0
        # The loss covers only the model's tokens: fewer than the whole response.
        assert r["actor/num_tokens"] < r["perf/response_tokens"]
        assert r["async/staleness_max"] <= 1
    assert records[-1]["rollout/weight_version"] >= 1


def test_dapo_dynamic_sampling_fills_the_batch_and_shapes_overlong_rewards(tmp_path):
    overrides = _e2e_overrides(
        tmp_path,
        "dapo",
        "trainer.worker_backend=local",
        "trainer.total_steps=2",
        "actor.ppo_mini_batch_size=8",
        "reward.overlong_buffer_len=4",
        "algorithm.max_gen_batches=3",
        "model.tiny_size=nano",
    )
    # The dense test reward is never >= 1, so no response is "correct": with the acc metric no
    # group varies, every step samples max_gen_batches batches and trains on uninformative
    # groups; with the score metric (continuous lengths) the first batch has enough.
    trainer = RLTrainer(load_config("dapo", overrides))
    try:
        trainer.setup()
        # The run directory's config shows what the run resolved, the transport included.
        saved = load_config(tmp_path / "dapo" / "rl_config.yaml")
        assert saved == resolved_config(trainer.cfg, trainer.settings, trainer.replicas.transport)
        assert "auto" not in (saved.trainer.device, saved.rollout.weight_transport)
        before = trainer.sampler.state_dict()
        metrics = trainer.step(1)
        assert metrics["filter/gen_batches"] == 3.0
        assert metrics["filter/informative_groups"] == 0.0
        assert metrics["filter/first_batch_informative_fraction"] == 0.0
        after = trainer.sampler.state_dict()
        assert after != before  # the sampler moved on by three batches
        # All 8 prompts x 4 responses trained on; responses near the 8-token cap were penalised.
        assert metrics["response_length/mean"] > 0
        assert "reward/overlong_penalty/mean" in metrics
        assert metrics["reward/overlong_penalty/mean"] <= 0.0
        # The generation phase reads the filter settings (the step reads none of them).
        trainer.cfg = trainer.rollout.cfg = load_config(
            "dapo", [*overrides, "algorithm.filter_groups_metric=score"]
        )
        metrics = trainer.step(2)
        assert metrics["filter/gen_batches"] <= 3.0
        assert metrics["filter/informative_groups"] == 8.0
        assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))
    finally:
        trainer.close()


def _steps(cfg, steps: int) -> list[dict]:
    """The metrics of ``steps`` steps of a run of ``cfg`` (set up, stepped and closed here)."""
    trainer = RLTrainer(cfg)
    try:
        trainer.setup()
        return [trainer.step(step) for step in range(1, steps + 1)]
    finally:
        trainer.close()


def _full_forward_overrides(tmp_path: Path, name: str, *extra: str) -> list[str]:
    return _e2e_overrides(
        tmp_path,
        name,
        "trainer.worker_backend=local",
        "trainer.total_steps=2",
        "actor.ppo_epochs=2",  # old log-probs are computed by the actor engine too
        "model.compute_dtype=float32",  # what auto resolves to on CPU, said for the dtype test
        *extra,
    )


@pytest.fixture(scope="module")
def full_forward_steps(tmp_path_factory) -> list[dict]:
    """The two steps' metrics of a local fp32 run with two PPO epochs and no prefix sharing.

    The baseline of the shared-prefix and the compute-dtype tests, run once for both: each
    compares runs that differ from it in one option.
    """
    tmp_path = tmp_path_factory.mktemp("full_forward")
    cfg = load_config("demo", _full_forward_overrides(tmp_path, "full", "actor.share_prefix=false"))
    return _steps(cfg, 2)


@pytest.mark.slow
def test_shared_prefix_update_gives_the_metrics_of_a_full_forward(tmp_path, full_forward_steps):
    """actor.share_prefix changes the positions the actor runs on, not the step's numbers."""
    cfg = load_config(
        "demo", _full_forward_overrides(tmp_path, "shared", "actor.share_prefix=true")
    )
    shared_steps = _steps(cfg, 2)
    for shared, full in zip(shared_steps, full_forward_steps, strict=True):
        assert shared["response_length/mean"] == full["response_length/mean"]
        assert shared["critic/score/mean"] == full["critic/score/mean"]
        for key in ("actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm"):
            assert shared[key] == pytest.approx(full[key], rel=1e-4, abs=1e-6), key
        assert shared["actor/compute_tokens"] < full["actor/compute_tokens"]


def test_grpo_step_at_a_temperature_computes_log_probs_equal_to_the_rollouts(tmp_path, monkeypatch):
    """At rollout.temperature=0.7 the engines' log-probs are the servers' (ratio 1 at start).

    The reference engine holds the actor's initial weights: at step 1 its log-probs are the old
    log-probs (the update's own here: one mini-batch, one epoch), computed the same way.

    Also the rollout correction's metrics: every response's first rollout log-prob is lowered
    by log(3), so its sequence weight exp(sum(old - rollout)) is 3 times the true weight, which
    is 1 up to rounding (an fp32 rollout against an fp32 trainer, both at T=0.7). A stub that
    logged 1.0, an inverted ratio (1/3) or the truncated weights (2) fails;
    test_actor_loss_weights_advantages_by_the_rollout_correction checks the truncation's
    arithmetic by hand.
    """
    import polyrl.trainer.rl.rollout as rollout_module
    from polyrl.core.columns import LOSS_MASK, REF_LOG_PROBS, ROLLOUT_LOG_PROBS
    from polyrl.model_engine.engine import TEMPERATURE_KEY

    def offset_batch(*args, **kwargs):
        batch = build_rollout_batch(*args, **kwargs)
        first = rollout_widths(batch)[0]  # every response starts at this column
        batch["rollout_log_probs"][:, first] -= math.log(3.0)
        return batch

    monkeypatch.setattr(rollout_module, "build_rollout_batch", offset_batch)
    overrides = _e2e_overrides(
        tmp_path,
        "tis",
        "trainer.worker_backend=local",
        "trainer.total_steps=2",
        "model.tiny_size=nano",
        "rollout.temperature=0.7",
        "algorithm.rollout_is=sequence",
        "algorithm.rollout_is_threshold=2.0",
    )
    trainer = RLTrainer(load_config("demo", overrides))
    seen = []
    try:
        trainer.setup()
        advantages = trainer.plane.advantages

        def spy(rows, *args):  # the step's rows, with their log-prob columns, before the update
            seen.append(rows)
            return advantages(rows, *args)

        trainer.plane.advantages = spy
        metrics = trainer.step(1)
    finally:
        trainer.close()
    (rows,) = seen
    on = rows[LOSS_MASK] != 0
    rollout = rows[ROLLOUT_LOG_PROBS].clone()
    rollout[:, rollout_widths(rows)[0]] += math.log(3.0)  # undo the offset
    # The tolerance of fp32 against fp32 (test_compute_dtype_sets_the_engines_mixed_precision);
    # with the engines at T=1 the largest gap here is ~0.18.
    assert (rows[REF_LOG_PROBS] - rollout)[on].abs().max() < 1e-5
    assert rows.meta[TEMPERATURE_KEY] == 0.7
    # The metrics are of the weights before truncation; every one is above the threshold.
    assert metrics["actor/rollout_is_mean"] == pytest.approx(3.0, rel=1e-3)
    assert metrics["actor/rollout_is_max"] == pytest.approx(3.0, rel=1e-3)
    assert metrics["actor/rollout_is_clipfrac"] == 1.0
    assert math.isfinite(metrics["actor/pg_loss"])
