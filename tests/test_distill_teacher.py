"""On-policy distillation teachers on rollout servers: the same values as the engine role.

The teacher as the reference model-engine role and the teacher as a rollout server (a real
native server process, the session's shared ``agent_server``) score the same rows; the
distillation reads the response positions, where the two must agree to 1e-5 in fp32.
"""

from __future__ import annotations

import pytest
import torch

from polyrl.config import ConfigError, load_config
from polyrl.core.columns import (
    LOSS_MASK,
    TEACHER_LOG_PROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOG_PROBS,
)
from polyrl.core.rollout_batch import build_rollout_batch
from polyrl.trainer.rl.teacher import TeacherServers, teacher_columns


def test_teacher_columns_put_each_score_under_its_token():
    # Row 0 starts at column 1 (left padding), row 1 at 0; position 0 of each is unscored.
    scores = [
        ([None, -1.0, -2.0], [[], [(4, -0.5), (1, -1.0)], [(2, -0.1), (3, -3.0)]]),
        ([None, -0.25, -0.5, -0.75], [[], [(7, -0.2), (6, -0.3)]] + [[(5, -0.4), (0, -0.9)]] * 2),
    ]
    cols = teacher_columns((2, 4), [1, 0], scores, topk=2)
    assert cols[TEACHER_LOG_PROBS].tolist() == [[0, 0, -1.0, -2.0], [0, -0.25, -0.5, -0.75]]
    assert cols[TEACHER_TOPK_IDS][0].tolist() == [[0, 0], [0, 0], [4, 1], [2, 3]]
    assert cols[TEACHER_TOPK_LOG_PROBS][1, 1].tolist() == pytest.approx([-0.2, -0.3])
    with pytest.raises(ValueError, match="exceed"):
        teacher_columns((2, 3), [1, 0], scores, topk=0)


def _rows(tokenizer_vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, tokenizer_vocab, (k,), generator=g).tolist() for k in (5, 9, 9)]
    responses = [torch.randint(3, tokenizer_vocab, (k,), generator=g).tolist() for k in (6, 3, 8)]
    return prompts, responses


def _config(url: str, *extra: str):
    return load_config(
        "opd",
        [
            "algorithm.teacher_source=server",
            f"algorithm.teacher_model_path={url}",
            *extra,
        ],
    )


def test_teacher_server_and_engine_role_give_the_same_values(agent_server, tiny_qwen2_dir, engines):
    from polyrl.model_engine import EngineConfig
    from polyrl.model_engine.engine import compute_log_probs

    engine = engines(str(tiny_qwen2_dir), EngineConfig(max_tokens_per_micro_batch=64))
    prompts, responses = _rows(1000)
    # Rows 1 and 2 share a prompt length: the engine role shares prefixes (share_prefix).
    batch = build_rollout_batch(prompts, responses, pad_token_id=0)
    closers: list = []
    teachers = TeacherServers(_config(str(agent_server.url), "algorithm.teacher_topk=4"), closers)
    try:
        scored = teachers.score(batch.clone(), 1.0)
    finally:
        for close in reversed(closers):
            close()
    on = batch[LOSS_MASK] != 0
    role = engine.infer_batch(batch, compute_log_probs, share_prefix=True)["log_probs"]
    gap = (scored[TEACHER_LOG_PROBS] - role)[on].abs().max().item()
    assert gap <= 1e-5, gap
    # The top-k: the engine's own log-probs of the server's k tokens, and the sampled token's.
    of = engine.infer_batch(scored, lambda out, b: {"lp": out.log_probs_of(b[TEACHER_TOPK_IDS])})
    topk_gap = (of["lp"] - scored[TEACHER_TOPK_LOG_PROBS])[on].abs().max().item()
    assert topk_gap <= 1e-5, topk_gap
    print(f"teacher server vs engine role (max abs, fp32): {gap:.2e}, top-k {topk_gap:.2e}")
    assert bool((scored[TEACHER_TOPK_LOG_PROBS][on].diff(dim=-1) <= 0).all())  # best first


def test_rows_go_to_the_teacher_of_their_data_source(agent_server):
    url = str(agent_server.url).rstrip("/")
    # Two names for one server: two clients, so each one's traffic shows which rows it scored.
    cfg = _config("", f"algorithm.teachers={{a: {url}, b: {url}/}}")
    prompts, responses = _rows(1000)
    batch = build_rollout_batch(prompts[:2], responses[:2], pad_token_id=0)
    closers: list = []
    teachers = TeacherServers(cfg, closers)
    try:
        batch["data_source"] = ["a", "a"]
        teachers.score(batch, 1.0)
        sent = {spec: c.bytes_sent for spec, c in teachers.clients.items()}
        assert sent[url] > 0 and sent[f"{url}/"] == 0, sent
        batch["data_source"] = ["b", "c"]
        with pytest.raises(ConfigError, match="no distillation teacher for data_source 'c'"):
            teachers.score(batch, 1.0)
    finally:
        for close in reversed(closers):
            close()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.distill_coef=1.0"], "algorithm.teacher_model_path"),
        (["algorithm.teacher_topk=4", "algorithm.teacher_model_path=http://x:1"], "teacher_topk"),
        (["algorithm.teachers={a: /nowhere}"], "algorithm.teachers"),
        (["algorithm.teacher_source=server", "algorithm.teachers={a: /nowhere}"], "teachers.a"),
    ],
)
def test_teacher_options_are_checked_by_name(overrides, key):
    from polyrl.trainer.rl.checks import check_teachers

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_teachers(load_config("grpo", overrides))


def test_streamed_generate_carries_the_prompt_log_probs_once(agent_server):
    import json

    import httpx

    body = {
        "input_ids": [5, 9, 14, 3],
        "stream": True,
        "sampling_params": {"max_new_tokens": 3, "n": 2, "prompt_logprobs": 2, "seed": 1},
    }
    with httpx.stream("POST", f"{agent_server.url}/generate", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == "{"]
    scored = [e for e in events if "prompt_logprobs" in e]
    assert len(scored) == 1 and scored[0]["index"] == 0
    assert scored[0]["prompt_logprobs"][0] is None and len(scored[0]["prompt_logprobs"]) == 4
    assert [len(alts) for alts in scored[0]["prompt_top_logprobs"]] == [0, 2, 2, 2]
