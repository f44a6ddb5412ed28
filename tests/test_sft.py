"""SFT: chat tokenisation with assistant-only loss, data building, resume, and `polyrl sft`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polyrl import cli
from polyrl.config import ConfigError, load_config
from polyrl.model_engine import checkpoint as ckpt
from polyrl.trainer.checkpointing import effective_resume_mode, resolve_resume_path
from polyrl.trainer.sft_data import (
    SFTDataError,
    SFTDataset,
    chats_from_rows,
    collate_chats,
    tokenize_chat,
)
from polyrl.trainer.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "12+7="},
    {"role": "assistant", "content": "19"},
    {"role": "user", "content": "and 3*4?"},
    {"role": "assistant", "content": "12"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The sft_demo model (nano qwen2, seed 0), built once and passed as model.path."""
    from polyrl.models.tiny import build_tiny_model

    return build_tiny_model("qwen2", tmp_path_factory.mktemp("sft") / "model", size="nano", seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from polyrl.models.loader import load_tokenizer

    return load_tokenizer(model_dir)


def _learned(tokenizer, chat) -> str:
    return tokenizer.decode([t for t, m in zip(chat.input_ids, chat.loss_mask, strict=True) if m])


# ------------------------------------------------------------------------------ tokenisation
def test_loss_covers_assistant_turns_up_to_their_eos(tokenizer):
    chat = tokenize_chat(tokenizer, CHAT)
    assert _learned(tokenizer, chat) == "19<|im_end|>12<|im_end|>"
    # Segment-wise tokenisation equals tokenising the whole rendering at once here.
    whole = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert chat.input_ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    ends = [i for i, t in enumerate(chat.input_ids) if t == eos and chat.loss_mask[i]]
    assert len(ends) == 2 and all(chat.loss_mask[i + 1] == 0 for i in ends)  # the "\n" after
    # The context of each answer is exactly the generation prompt a rollout would see.
    first = chat.loss_mask.index(1)
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(chat.input_ids[:first]) == prompt


def test_tool_calls_and_tools_are_rendered_and_learned(tokenizer):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "what is 2+2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "calc", "arguments": {"expr": "2+2"}}}],
        },
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    chat = tokenize_chat(tokenizer, messages, tools=tools)
    learned = _learned(tokenizer, chat)
    assert learned == '<tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>' + (
        "<|im_end|>4<|im_end|>"
    )
    assert "# Tools" in tokenizer.decode(chat.input_ids)


def test_template_problems_are_reported(tokenizer):
    with pytest.raises(SFTDataError, match="no assistant message"):
        tokenize_chat(tokenizer, CHAT[:2])
    with pytest.raises(SFTDataError, match="starts with an assistant"):
        tokenize_chat(tokenizer, [{"role": "assistant", "content": "hi"}, *CHAT[:2]])
    original = tokenizer.chat_template
    try:
        # Newest message first: rendering messages[:k] is not a prefix of messages[:k+1].
        tokenizer.chat_template = (
            "{% for m in messages|reverse %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}"
        )
        with pytest.raises(SFTDataError, match="not prefix-stable"):
            tokenize_chat(tokenizer, CHAT)
    finally:
        tokenizer.chat_template = original


# ------------------------------------------------------------------------------ rows and datasets
def test_template_kwargs_render_sft_chats_and_preference_pairs(tokenizer):
    """data.apply_chat_template_kwargs reaches SFT and DPO/RM rendering, every turn alike."""
    import copy

    from polyrl.trainer.preference_data import PreferenceDataset

    tok = copy.deepcopy(tokenizer)
    # A template argument the tiny template reads: a marker before the whole conversation.
    tok.chat_template = "{%- if marker is defined and marker -%}{{- 'MARK ' -}}{%- endif -%}" + (
        tok.chat_template
    )
    kw = {"marker": True}
    mark = tok.encode("MARK ", add_special_tokens=False)
    plain = tokenize_chat(tok, CHAT)
    marked = SFTDataset([{"messages": CHAT}], tok, max_length=512, apply_chat_template_kwargs=kw)[0]
    assert marked.input_ids == mark + plain.input_ids  # every later turn renders alike
    assert marked.loss_mask == [0] * len(mark) + plain.loss_mask
    pair = {"prompt": CHAT[:2], "chosen": [CHAT[2]], "rejected": [{**CHAT[2], "content": "18"}]}
    plain_pair = PreferenceDataset([pair], tok, max_length=512)[0]
    marked_pair = PreferenceDataset([pair], tok, max_length=512, apply_chat_template_kwargs=kw)[0]
    assert marked_pair.chosen.input_ids == mark + plain_pair.chosen.input_ids
    assert marked_pair.rejected.input_ids == mark + plain_pair.rejected.input_ids
    with pytest.raises(ValueError, match="tokenize"):
        SFTDataset([{"messages": CHAT}], tok, 512, apply_chat_template_kwargs={"tokenize": True})


def test_rows_become_chats():
    rl_row = {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": "2+3="}],
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"tools": [{"type": "function", "function": {"name": "f"}}]},
    }
    chat_row = {"messages": CHAT}
    chats = chats_from_rows([rl_row, chat_row], source="train.jsonl")
    assert chats[0]["messages"][-1] == {"role": "assistant", "content": "5"}
    assert chats[0]["tools"][0]["function"]["name"] == "f"
    assert chats[1] == {"messages": CHAT, "tools": None}
    with pytest.raises(SFTDataError, match=r"train.jsonl: row 1: has neither a 'messages'"):
        chats_from_rows([rl_row, {"text": "x"}], source="train.jsonl")
    with pytest.raises(SFTDataError, match=r"row 0: .*role"):
        chats_from_rows([{"messages": [{"role": "robot", "content": "x"}]}])
    with pytest.raises(SFTDataError, match="no assistant message"):
        chats_from_rows([{"messages": CHAT[:2]}])
    with pytest.raises(SFTDataError, match="cannot be an assistant answer"):
        chats_from_rows([{**rl_row, "reward_model": {"ground_truth": {"a": 1}}}])


def test_dataset_truncation_policies_and_collate(tokenizer):
    short = {"messages": CHAT[1:3], "tools": None}
    long = {"messages": CHAT, "tools": None}
    n_short = len(tokenize_chat(tokenizer, short["messages"]))
    n_long = len(tokenize_chat(tokenizer, long["messages"]))
    limit = n_short + 2
    assert n_long > limit
    with pytest.raises(SFTDataError, match=rf"row 1 has {n_long} tokens.*sft.max_length"):
        SFTDataset([short, long], tokenizer, max_length=limit)
    filtered = SFTDataset([short, long], tokenizer, max_length=limit, truncation="filter")
    assert len(filtered) == 1 and filtered.num_filtered == 1
    cut = SFTDataset([short, long], tokenizer, max_length=limit, truncation="right")
    assert [len(x) for x in cut.items] == [n_short, limit] and cut.num_truncated == 1
    with pytest.raises(SFTDataError, match="no conversation left"):
        SFTDataset([long], tokenizer, max_length=limit, truncation="filter")

    batch = collate_chats(cut.items, tokenizer.pad_token_id)
    assert batch["input_ids"].shape == (2, limit)
    assert batch["attention_mask"].sum(1).tolist() == [n_short, limit]
    assert batch["input_ids"][0, n_short:].eq(tokenizer.pad_token_id).all()
    assert batch["loss_mask"].dtype == torch.float32
    assert batch["loss_mask"].sum() == sum(cut.items[0].loss_mask) + sum(cut.items[1].loss_mask)


# ------------------------------------------------------------------------------ resume modes
def test_resume_mode_resolution(tmp_path):
    root = tmp_path / "checkpoints"
    assert effective_resume_mode("", False) == "never"
    assert effective_resume_mode("", True) == "auto"
    assert effective_resume_mode(" auto ", False) == "auto"
    assert resolve_resume_path("auto", False, root) is None  # nothing to resume yet
    for step in (2, 5):
        path = root / f"global_step_{step}"
        path.mkdir(parents=True)
        ckpt.write_complete_marker(str(path), {"step": step})
    (root / "global_step_9").mkdir()  # a half-written directory (no marker) is never chosen
    assert resolve_resume_path("auto", False, root) == str(root / "global_step_5")
    assert resolve_resume_path("", True, root) == str(root / "global_step_5")
    assert resolve_resume_path("never", True, root) is None
    explicit = resolve_resume_path(str(root / "global_step_2"), False, root)
    assert explicit == str(root / "global_step_2")
    with pytest.raises(ConfigError, match="trainer.resume_mode") as info:
        resolve_resume_path(str(root / "global_step_9"), False, root)
    assert "not a complete checkpoint" in str(info.value)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_resume_path(str(tmp_path / "nowhere"), False, root)


def test_sft_demo_preset_and_config_errors(tmp_path, capsys):
    cfg = load_config("sft_demo")
    assert cfg.data.task == "arithmetic" and cfg.model.tiny_size == "nano"
    assert cfg.trainer.save_freq > 0 and cfg.trainer.test_freq > 0
    assert cfg.trainer.world_size == 1
    assert load_config("sft_demo", ["trainer.n_gpus_per_node=2"]).trainer.world_size == 2
    out = tmp_path / "run"
    # No data configured: a one-line usage error before anything is built.
    assert cli.main(["sft", f"trainer.output_dir={out}"]) == 2
    assert "no training data" in capsys.readouterr().err
    assert not (out / "model").exists()
    assert cli.main(["sft", "sft_demo", "sft.truncation=middle"]) == 2
    assert "sft.truncation" in capsys.readouterr().err


# ------------------------------------------------------------------------------ end to end
def _run_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "sft", "sft_demo", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


SMALL = ["data.num_train=128", "data.num_val=32", "trainer.total_steps=6", "trainer.test_freq=3"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, model_dir):
    """`polyrl sft sft_demo` for 6 steps (checkpoints at 3 and 6), run once for this module."""
    tmp = tmp_path_factory.mktemp("sft_run")
    out = tmp / "run"
    args = [f"trainer.output_dir={out}", f"model.path={model_dir}", "trainer.save_freq=3", *SMALL]
    proc = _run_cli(tmp, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"out": out, "args": args, "proc": proc, "records": read_metrics(out / "metrics.jsonl")}


@pytest.mark.slow
def test_polyrl_sft_lowers_val_loss_and_resume_auto_continues_exactly(base_run, tmp_path):
    out, records = base_run["out"], base_run["records"]
    val = [(r["step"], r["val/loss"]) for r in records if r.get("val/loss") is not None]
    assert [s for s, _ in val] == [0, 3, 6]
    assert val[-1][1] < val[0][1] - 0.2, val
    stdout = base_run["proc"].stdout
    assert sum(1 for line in stdout.splitlines() if line.startswith("step ")) == 7
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["steps"] == 6 and summary["last_val_loss"] == pytest.approx(val[-1][1])
    assert (out / "learning_curves.png").read_bytes()[:4] == b"\x89PNG"
    root = out / "checkpoints"
    assert [s for s, _ in ckpt.list_checkpoints(str(root))] == [3, 6]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "hf_model").num_parameters() > 0

    # A crash after step 6 but before its checkpoint: resume=auto continues from step 3 and
    # reproduces steps 4..6 exactly (model, optimizer, RNG and data-sampler state restored).
    shutil.rmtree(root / "global_step_6")
    again = _run_cli(tmp_path, *base_run["args"], "trainer.resume_mode=auto")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {root / 'global_step_3'} at step 3" in again.stdout
    resumed = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in records]
    for old, new in zip(records, resumed, strict=True):
        for key in ("train/loss", "train/grad_norm", "val/loss"):
            assert old.get(key) == new.get(key), (old["step"], key)
    assert [s for s, _ in ckpt.list_checkpoints(str(root))] == [3, 6]


@pytest.mark.slow
def test_polyrl_sft_data_parallel_through_the_controller_matches_one_rank(base_run, tmp_path):
    out = tmp_path / "dp2"
    two = _run_cli(
        tmp_path,
        f"trainer.output_dir={out}",
        f"model.path={base_run['args'][1].split('=', 1)[1]}",
        "trainer.n_gpus_per_node=2",
        "trainer.worker_backend=local",
        "data.num_train=128",
        "data.num_val=32",
        "trainer.total_steps=3",
        "trainer.test_freq=3",
        "trainer.save_freq=0",
        "sft.export_hf=false",
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert "world size 2" in two.stdout
    one = {r["step"]: r for r in base_run["records"]}
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    for record in got:
        ref = one[record["step"]]
        for key in ("train/loss", "val/loss"):
            if key in ref and ref[key] is not None:
                assert record[key] == pytest.approx(ref[key], abs=1e-5), (record["step"], key)
        if record["step"]:
            assert record["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)
