"""Shared-prefix forward of the model engine (polyrl.model_engine.prefix): planning and exactness.

A GRPO-style batch (n responses per prompt, prompts left-padded, responses right-padded) trained
with prefix sharing must give the loss, gradients, log-probs and entropies of a plain full forward
while running fewer positions.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "engine_scripts"))

from engine_common import (  # noqa: E402
    clean_loss_mask,
    engine_grads,
    make_batch,
    make_group_batch,
    reference_log_probs,
    reference_sft,
    tiny_model,
)

from polyrl.model_engine import (  # noqa: E402
    EngineConfig,
    OptimizerConfig,
    compute_log_probs,
    compute_log_probs_and_entropy,
    sft_loss,
)
from polyrl.model_engine.prefix import plan_prefix_split  # noqa: E402

VOCAB = 1000


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix")
    dirs = {
        "qwen2": tiny_model(root / "qwen2"),
        "llama": tiny_model(root / "llama", arch="llama", tie_embeddings=False),
    }
    # Sliding-window attention over 3 tokens, shorter than the prompts: the prefix pass's cache
    # keeps only the window, as in generation.
    sliding = root / "qwen2_sliding"
    shutil.copytree(dirs["qwen2"], sliding)
    config = json.loads((sliding / "config.json").read_text())
    config.update(
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=0,
        layer_types=["sliding_attention"] * config["num_hidden_layers"],
    )
    (sliding / "config.json").write_text(json.dumps(config))
    dirs["qwen2_sliding"] = str(sliding)
    return dirs


def _plan(ids, am, lm, pos=None):
    ids, am, lm = (torch.tensor(x) for x in (ids, am, lm))
    if pos is None:
        pos = (am.cumsum(1) - 1).clamp(min=0)
    return plan_prefix_split(ids, am, torch.as_tensor(pos), lm.float())


def test_plan_groups_rows_by_their_real_prefix_tokens():
    # Rows 0, 1 and 3 share "5 6" (row 3 has a different pad id); row 2's prompt is "7 6".
    ids = [[0, 5, 6, 9, 9], [0, 5, 6, 8, 0], [0, 7, 6, 1, 2], [3, 5, 6, 4, 4]]
    am = [[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    lm = [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    plan = _plan(ids, am, lm)
    assert plan is not None
    assert (plan.split, plan.first, plan.num_prefixes) == (3, 1, 2)
    group = plan.group.tolist()
    assert group[0] == group[1] == group[3] != group[2]
    assert plan.prefix_rows[plan.group[2]].item() == 2
    assert plan.prefix_rows[plan.group[0]].item() == 0  # the first row represents its group


def test_plan_tells_apart_prefixes_that_differ_in_mask_or_positions():
    ids = [[5, 6, 9], [5, 6, 9], [5, 6, 9]]
    am = [[1, 1, 1], [0, 1, 1], [1, 1, 1]]
    lm = [[0, 0, 1], [0, 0, 1], [0, 0, 1]]
    pos = [[0, 1, 2], [0, 0, 1], [3, 4, 5]]
    plan = _plan(ids, am, lm, pos)
    assert plan is not None and plan.num_prefixes == 3 and plan.split == 2


def test_plan_is_none_when_rows_do_not_line_up_or_nothing_is_trained():
    # Every row needs a real token just before the split column.
    ids = [[1, 2, 0, 0, 0], [1, 2, 3, 4, 5]]
    am = [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    lm = [[0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]
    assert _plan(ids, am, lm) is None  # row 0 ends at column 1 < split - 1 = 3
    am_late = [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]]
    lm_late = [[0, 0, 0, 0, 1], [0, 0, 1, 1, 1]]
    assert _plan(ids, am_late, lm_late) is None  # row 0 starts after split - 1 = 1
    assert _plan(ids, [[1] * 5, [1] * 5], [[0] * 5, [0] * 5]) is None  # nothing trained
    lm_first = [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert _plan(ids, am, lm_first) is None  # split 0: no prefix at all


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2_sliding"])
def test_shared_prefix_training_matches_a_full_forward(model_dirs, engines, arch):
    model_dir = model_dirs[arch]
    batch = make_group_batch(prompts=4, n=3, prompt_width=7, response_width=9, vocab=VOCAB)
    ref_loss, ref_grads, _ = reference_sft(model_dir, batch)
    results = {}
    for share in (True, False):
        engine = engines(
            model_dir, EngineConfig(grad_clip=1e9, share_prefix=share), OptimizerConfig(lr=1e-3)
        )
        metrics = engine.forward_backward(batch, sft_loss)
        results[share] = (metrics, engine_grads(engine))
    for share, (metrics, grads) in results.items():
        assert metrics["loss"] == pytest.approx(ref_loss, abs=1e-5), share
        assert max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads) < 1e-5
        assert metrics["num_tokens"] == float((clean_loss_mask(batch) != 0).sum())
    shared, full = results[True][0]["compute_tokens"], results[False][0]["compute_tokens"]
    am = batch["attention_mask"]
    prompt_cols = 7 - int(am.argmax(1).min())  # from the leftmost real prompt token to the split
    longest_response = int(am[:, 7:].sum(1).max())
    # 4 prompts once each + every row's response window (its last prompt token comes from the
    # prefix pass) against every row's trimmed full sequence.
    assert shared == 4 * prompt_cols + 12 * longest_response
    assert shared < full


def test_shared_prefix_log_probs_and_entropy_match_on_trained_tokens(model_dirs, engines):
    model_dir = model_dirs["qwen2"]
    batch = make_group_batch(prompts=3, n=4, prompt_width=6, response_width=8, vocab=VOCAB, seed=2)
    batch.meta["temperature"] = 0.7
    full = engines(model_dir, EngineConfig(share_prefix=False))
    shared = engines(model_dir, EngineConfig(share_prefix=True))
    want_logp, want_ent = (
        full.infer_batch(batch, compute_log_probs_and_entropy)[k] for k in ("log_probs", "entropy")
    )
    # Without the flag inference reads every position, as before.
    plain = shared.infer_batch(batch, compute_log_probs)["log_probs"]
    torch.testing.assert_close(plain, want_logp, atol=1e-6, rtol=0)

    got = shared.infer_batch(batch, compute_log_probs_and_entropy, share_prefix=True)
    mask = clean_loss_mask(batch) != 0
    for key, want in (("log_probs", want_logp), ("entropy", want_ent)):
        torch.testing.assert_close(got[key][mask], want[mask], atol=1e-5, rtol=0)
        assert bool((got[key][:, :5] == 0).all()), key  # before the split column - 1: 0


def test_shared_prefix_trains_like_a_full_forward_over_several_steps(model_dirs, engines):
    """Optimizer steps on shared-prefix micro-batches follow the full-forward trajectory."""
    model_dir = model_dirs["qwen2"]
    batch = make_group_batch(prompts=4, n=4, prompt_width=5, response_width=6, vocab=VOCAB, seed=4)
    losses = {}
    for share in (True, False):
        # A 48-token budget splits the 16 rows into several micro-batches.
        engine = engines(
            model_dir,
            EngineConfig(share_prefix=share, max_tokens_per_micro_batch=48),
            OptimizerConfig(lr=1e-2),
        )
        losses[share] = [engine.train_batch(batch, sft_loss) for _ in range(3)]
        engine.close()
    for a, b in zip(losses[True], losses[False], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["num_micro_batches"] == b["num_micro_batches"] > 1
    assert losses[True][2]["loss"] < losses[True][0]["loss"]


def test_shared_prefix_is_not_used_where_it_cannot_apply(model_dirs, engines):
    model_dir = model_dirs["qwen2"]
    batch = make_group_batch(prompts=2, n=3, prompt_width=5, response_width=6, vocab=VOCAB, seed=6)
    counts = {}
    for name, kwargs in {
        "off": dict(share_prefix=False),
        "grad_ckpt": dict(gradient_checkpointing=True, share_prefix=True),
        "on": dict(share_prefix=True),
    }.items():
        engine = engines(model_dir, EngineConfig(**kwargs))
        counts[name] = engine.forward_backward(batch, sft_loss)["compute_tokens"]
        engine.close()
    assert counts["grad_ckpt"] == counts["off"] > counts["on"]

    # Right-padded SFT rows whose prompts end before the split: the plain forward runs, exactly.
    sft = make_batch(6, 12, VOCAB, seed=8)
    ref_loss, _, ref_model = reference_sft(model_dir, sft)
    engine = engines(model_dir, EngineConfig(grad_clip=1e9, share_prefix=True))
    assert engine.forward_backward(sft, sft_loss)["loss"] == pytest.approx(ref_loss, abs=1e-5)
    ref_model.eval()
    logp = engine.infer_batch(sft, compute_log_probs, share_prefix=True)["log_probs"]
    mask = clean_loss_mask(sft) != 0
    torch.testing.assert_close(
        logp[mask], reference_log_probs(ref_model, sft)[mask], atol=1e-5, rtol=0
    )


def test_shared_prefix_gradients_are_bit_reproducible(model_dirs, engines):
    """Repeated backward passes of one batch give the same gradients to the last bit.

    Runs on two threads with groups that straddle the threads' halves of the batch: the
    gathered last prompt logits once summed their rows' gradients with atomic adds, whose order
    (and so the rounding) changed from run to run.
    """
    batch = make_group_batch(prompts=37, n=7, prompt_width=6, response_width=5, vocab=VOCAB)
    engine = engines(model_dirs["qwen2"], EngineConfig(share_prefix=True, grad_clip=1e9))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        digests = set()
        for _ in range(20):
            engine.zero_grad()
            engine.forward_backward(batch, sft_loss)
            grads = engine_grads(engine)
            digests.add(hash(tuple(grads[n].numpy().tobytes() for n in sorted(grads))))
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 1
