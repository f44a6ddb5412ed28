"""Rewards beyond rules: a scalar reward model, a generative judge, the code scorer in GRPO."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.reward.judge import format_judge_prompt, parse_verdict
from polyrl.reward.model import SequenceRewardModel, reward_model_text


def _build_reward_model(policy_dir: Path, out: Path) -> Path:
    """A tiny Qwen2ForSequenceClassification (num_labels=1) from the nano config, seed 0."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2ForSequenceClassification

    if (out / "config.json").is_file():
        return out
    config = AutoConfig.from_pretrained(policy_dir)
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # a head large enough that the scores differ visibly
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(policy_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def reward_model_dir(tiny_qwen2_dir, tmp_path_factory):
    return _build_reward_model(Path(tiny_qwen2_dir), tmp_path_factory.mktemp("rm") / "rm")


def _transformers_score(model_dir: Path, text: str) -> float:
    """The reference: Hugging Face's own forward on one unpadded text."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return float(model(**ids).logits[0, 0])


# ------------------------------------------------------------------------------ unit tests
def test_parse_verdict_on_crafted_verdicts():
    assert parse_verdict("YES, it is right.") == 1.0
    assert parse_verdict("Maybe yes... no.") == 0.0  # the last word decides
    assert parse_verdict("yesterday nothing") is None  # whole words only
    assert parse_verdict("") is None and parse_verdict(None) is None  # type: ignore[arg-type]
    assert parse_verdict("Score: 7/10", "number", max_score=10) == pytest.approx(1.0)
    assert parse_verdict("I give it 7", "number", max_score=10) == pytest.approx(0.7)
    assert parse_verdict("-3", "number") == 0.0 and parse_verdict("42", "number") == 1.0
    assert parse_verdict("no digits", "number") is None
    assert parse_verdict("Verdict: [[CORRECT]]", r"\[\[(\w+)\]\]") == 1.0
    assert parse_verdict("Rating: [[4]] then [[8]]", r"\[\[(\d+)\]\]", max_score=10) == 0.8
    assert parse_verdict("Rating: none", r"\[\[(\d+)\]\]") is None
    with pytest.raises(ValueError, match="max_score"):
        parse_verdict("1", "number", max_score=0)


def test_judge_template_fields_and_config_checks():
    text = format_judge_prompt(
        "Q: {prompt}\nA: {response}\nRef: {ground_truth}\nYES or NO?",
        [{"role": "user", "content": "1+1="}],
        "2",
        "2",
    )
    assert text == "Q: 1+1=\nA: 2\nRef: 2\nYES or NO?"
    with pytest.raises(ConfigError, match=r"reward.judge_template.*\{answer\}"):
        load_config("grpo", ["reward.judge_template=Is {answer} right?"])
    with pytest.raises(ConfigError, match="reward.judge_parse"):
        load_config("grpo", ["reward.judge_template={response}", "reward.judge_parse=[("])
    from polyrl.trainer.rl.checks import check_config

    with pytest.raises(ConfigError, match="reward.rule_weight"):
        check_config(load_config("grpo", ["reward.rule_weight=0"]))
    with pytest.raises(ConfigError, match="reward.model_path"):
        check_config(load_config("grpo", ["reward.model_path=/nonexistent/rm"]))


def test_every_scorer_kind_says_what_it_reads_and_where_the_replicas_are(tmp_path):
    """The four scorer kinds declare the Scorer fields; wrappers pass them on."""
    from polyrl.reward import RewardManager
    from polyrl.reward.functions import RewardFunctionsManager
    from polyrl.trainer.rl.asynchronous import SerialRewards
    from polyrl.trainer.rl.reward_mix import MixedRewards
    from polyrl.trainer.rl.rollout import reward_manager

    class Replicas:
        urls = ["http://127.0.0.1:1"]
        api_key = None

    batched = tmp_path / "trl_reward.py"
    batched.write_text("def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    trl = [f"reward.custom_function={batched}:reward"]
    judged = ["reward.judge_template={response}", "reward.judge_weight=0.5"]
    cases = [
        ([], RewardManager, False, False),
        (trl, RewardFunctionsManager, True, False),
        (judged, MixedRewards, False, True),
        (judged + trl, MixedRewards, True, True),
    ]
    for overrides, kind, rows, prompts in cases:
        scorer = reward_manager(load_config("grpo", [*overrides, "reward.num_workers=0"]))
        try:
            shared = SerialRewards(scorer)
            assert isinstance(scorer, kind)
            for each in (scorer, shared):
                assert (each.wants_rows, each.wants_prompts) == (rows, prompts), (overrides, each)
                each.attach_rollout(Replicas())  # a no-op for the rules, noted by the judge
            if isinstance(scorer, MixedRewards):
                assert isinstance(scorer._policy_client, Replicas)
        finally:
            scorer.close()


def test_reward_model_reads_the_tokens_polyrl_rm_trained_it_on(tiny_qwen2_tokenizer):
    """The scored text tokenises to the trainer's sequence: the score is read at the same token."""
    from polyrl.data.tasks import generate
    from polyrl.trainer.preference_data import pairs_from_rows, tokenize_completion

    tok = tiny_qwen2_tokenizer
    rows = generate("arithmetic_pairs", 3, seed=0, split="train")  # chat-message prompts
    rows.append({"prompt": "12+7=", "chosen": "19", "rejected": "191"})  # plain strings
    for pair in pairs_from_rows(rows):
        for completion in (pair["chosen"], pair["rejected"]):
            response = completion if isinstance(completion, str) else completion[0]["content"]
            text = reward_model_text(tok, pair["prompt"], response)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert ids == tokenize_completion(tok, pair["prompt"], completion).input_ids, text
            assert ids[-1] == tok.eos_token_id  # not the template's newline after the turn
    # A response that already ends with the end-of-sequence token does not get a second one.
    assert reward_model_text(tok, "1+1=", "2<|im_end|>") == "1+1=2<|im_end|>"


def test_reward_model_batches_score_like_transformers(reward_model_dir):
    rm = SequenceRewardModel(str(reward_model_dir), device="cpu", batch_size=3)
    prompts = [[{"role": "user", "content": "12+7="}], "plain prompt ", None, "x"]
    responses = ["19", "a much longer response than the others", "z", "y z"]
    scores = rm.score(prompts, responses)
    texts = [rm.render(p, r) for p, r in zip(prompts, responses, strict=True)]
    assert (
        texts[0].startswith("<|im_start|>user\n12+7=")
        and texts[1] == "plain prompt " + responses[1] + "<|im_end|>"
    )
    for text, score in zip(texts, scores, strict=True):
        # Right padding inside a batch of 3 gives each text its unpadded score.
        assert score == pytest.approx(_transformers_score(reward_model_dir, text), abs=1e-5)
    assert len(set(np.round(scores, 4))) == len(scores)


# ------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_grpo_with_code_scorer_reward_model_and_judge(tmp_path, tiny_qwen2_dir, reward_model_dir):
    """One GRPO run scores with all three: the code scorer, the reward model and the judge."""
    from polyrl.core.sandbox import SandboxUnavailable, check_sandbox
    from polyrl.trainer.rl.loop import RLTrainer

    try:
        check_sandbox()
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))
    template = "Question: {prompt}\nAnswer: {response}\nIs the answer right? Reply YES or NO."
    cfg = load_config(
        "grpo_code",
        [
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.worker_backend=local",
            "trainer.total_steps=3",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.save_freq=0",
            "trainer.export_hf=false",
            "trainer.loggers=[jsonl]",
            "model.tiny_size=nano",
            "data.task_options={num_cases: 2, style: short}",
            "data.num_train=16",
            "data.num_val=0",
            "data.train_batch_size=2",
            "data.max_response_length=8",
            "rollout.n=2",
            "rollout.max_new_tokens=8",
            "actor.ppo_mini_batch_size=2",
            "actor.use_kl_loss=false",
            "reward.num_workers=1",
            f"reward.model_path={reward_model_dir}",
            "reward.model_weight=0.5",
            f"reward.judge_template={template}",
            "reward.judge_max_tokens=4",
            "reward.judge_weight=0.25",
        ],
    )
    trainer = RLTrainer(cfg, model_dir=tiny_qwen2_dir)
    try:
        trainer.setup()
        for step in (1, 2, 3):
            metrics = trainer.step(step)
            assert 0.0 <= metrics["reward/rule/mean"] <= 1.0  # the code scorer's fraction
            assert math.isfinite(metrics["reward/model/mean"])
            failures = metrics["reward/judge_parse_failures"] + metrics["reward/judge_errors"]
            assert 0.0 <= failures <= 4.0  # 2 prompts x 2 responses
            assert metrics["reward/judge/mean"] <= (4.0 - failures) / 4.0 + 1e-6
        assert metrics["rollout/weight_version"] == 2.0  # the weights moved on every step

        # The same path on one fresh batch: the per-sample parts, and how they add up.
        items = [trainer.train_ds[i] for i in range(2)]
        batch, _ = trainer.generate(items, 2, 1.0, seed=7)
        result = trainer.producer.rewards.score(batch)
        rule, model = result.extras["rule_score"], result.extras["model_score"]
        judge, parsed = result.extras["judge_score"], result.extras["judge_parsed"]
        assert ((rule >= 0) & (rule <= 1)).all()
        expected = rule + 0.5 * model + 0.25 * judge
        assert np.allclose(result.scores.numpy(), expected, atol=1e-5)
        assert result.metrics["reward/judge_parse_failures"] + result.metrics[
            "reward/judge_errors"
        ] == float((parsed == 0).sum())
        assert (judge[parsed == 0] == 0).all()
        # The reward model's score is Hugging Face's on the text it was given.
        texts = list(batch.non_tensors["response_text"])
        prompts = list(batch.non_tensors["raw_prompt"])
        from transformers import AutoTokenizer

        rm_tok = AutoTokenizer.from_pretrained(reward_model_dir)
        for i in (0, 3):
            text = reward_model_text(rm_tok, prompts[i], texts[i])
            assert model[i] == pytest.approx(_transformers_score(reward_model_dir, text), abs=1e-4)
        # A reference solution as the response scores 1 through the same scorer and workers.
        references = [item["extra_info"]["reference"] for item in items for _ in range(2)]
        batch.non_tensors["response_text"] = np.array(
            [f"```python\n{r}```" for r in references], dtype=object
        )
        solved = trainer.producer.rewards.score(batch)
        assert (solved.extras["rule_score"] == 1.0).all()
        assert (solved.extras["acc"] == 1.0).all()
    finally:
        trainer.close()
