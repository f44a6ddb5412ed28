"""Tests for polyrl.data: schema, io, dataset + collate, sampler, tasks, GSM8K preprocessing."""

from __future__ import annotations

import itertools
import json
import logging
import re
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from polyrl.data import (
    TASKS,
    PromptTooLongError,
    RLDataset,
    RowValidationError,
    StatefulSampler,
    collate_prompts,
    convert_gsm8k_rows,
    extract_gsm8k_answer,
    generate,
    get_task,
    make_row,
    normalize_row,
    read_rows,
    register_task,
    row_uid,
    sample_gsm8k_path,
    validate_row,
    validate_rows,
    write_gsm8k_splits,
    write_rows,
    write_task_splits,
)
from polyrl.data.preprocess_gsm8k import INSTRUCTION

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------------ fixtures
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t['function']['name'] }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
# Characters of the fixed template around one user message: "<|im_start|>" "user\n" ...
# "<|im_end|>" "\n" "<|im_start|>" "assistant\n" -> 1 + 5 + 1 + 1 + 1 + 10 tokens.
OVERHEAD = 19


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer with a ChatML template: token counts are easy to predict."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=CHAT_TEMPLATE,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )


def _row(content: str, index: int, **extra) -> dict:
    return {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(index)},
        "extra_info": {"split": "train", "index": index, **extra},
    }


# ------------------------------------------------------------------------------------------ io
FREEFORM_ROWS = [
    {
        "data_source": "arithmetic",
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "3"},
        "extra_info": {"split": "train", "index": 0, "tools_kwargs": {"calc": {"x": 1}}},
    },
    {
        "data_source": "countdown",
        "prompt": [{"role": "user", "content": "3 4 5 -> 17= ünïcødé"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": {"target": 17, "numbers": [3, 4, 5]}},
        "extra_info": {"agent_name": "tool_agent", "note": None, "scores": [0.5, -1.25, 1e-30]},
    },
    {
        # no ability, an empty extra_info, and a column only this row has
        "data_source": "x",
        "prompt": [{"role": "user", "content": ""}],
        "reward_model": {"ground_truth": None},
        "extra_info": {},
        "only_here": [[1, 2], [], [{"deep": True}]],
    },
]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl", ".json"])
def test_roundtrip_keeps_freeform_values_exactly(tmp_path, suffix):
    path = write_rows(FREEFORM_ROWS, tmp_path / f"sub/rows{suffix}")
    assert path.is_file()
    back = read_rows(path)
    assert back == FREEFORM_ROWS
    # Missing keys stay missing rather than turning into None (parquet's struct padding).
    assert "ability" not in back[2] and "only_here" not in back[0]
    assert back[1]["extra_info"]["note"] is None
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_parquet_stores_uniform_scalars_natively(tmp_path):
    rows = [{"a": 1, "s": "x", "f": 0.5, "b": True}, {"a": 2, "s": "y", "f": 1.5, "b": False}]
    path = write_rows(rows, tmp_path / "n.parquet")
    schema = pq.read_schema(path)
    assert schema.field("a").type == pa.int64()
    assert schema.field("f").type == pa.float64()
    assert schema.field("b").type == pa.bool_()
    assert read_rows(path) == rows


_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
_json_value = st.recursive(
    _json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_rows_strategy = st.lists(
    st.dictionaries(st.sampled_from(["a", "b", "extra_info", "prompt"]), _json_value, max_size=4),
    max_size=5,
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=_rows_strategy, suffix=st.sampled_from([".parquet", ".jsonl"]))
def test_roundtrip_property(rows, suffix):
    with tempfile.TemporaryDirectory() as d:
        path = write_rows(rows, Path(d) / f"r{suffix}")
        assert read_rows(path) == rows


def test_reads_struct_parquet_written_by_pyarrow(tmp_path):
    """A verl-style file: struct/list columns, differing extra_info keys, a pandas index."""
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "q0"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "7"},
            "extra_info": {"split": "train", "index": 0, "answer": "a0"},
        },
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "q1"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "8"},
            "extra_info": {"split": "train", "index": 1, "tools_kwargs": {"k": 2}},
        },
    ]
    table = pa.Table.from_pylist(rows)
    assert pa.types.is_struct(table.schema.field("extra_info").type)
    # Padding really happens: pyarrow fills the missing keys with nulls.
    assert table.column("extra_info").to_pylist()[0]["tools_kwargs"] is None
    index = pa.array([10, 11])
    pandas_meta = json.dumps({"index_columns": ["__index_level_0__"], "columns": []}).encode()
    table = table.append_column("__index_level_0__", index).replace_schema_metadata(
        {b"pandas": pandas_meta}
    )
    path = tmp_path / "verl.parquet"
    pq.write_table(table, path)
    back = read_rows(path)
    assert back == rows
    validate_rows(back)


def test_io_errors(tmp_path):
    with pytest.raises(ValueError, match=r"\.csv.*expected a name ending in one of"):
        read_rows(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_rows(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\n\n{"a": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: invalid JSON"):
        read_rows(bad)
    not_list = tmp_path / "obj.json"
    not_list.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        read_rows(not_list)
    with pytest.raises(TypeError, match="row 1 must be a dict"):
        write_rows([{"a": 1}, [1, 2]], tmp_path / "x.jsonl")
    with pytest.raises(TypeError, match="dict keys must be strings"):
        write_rows([{"a": {1: 2}}], tmp_path / "x.parquet")


def test_write_is_atomic_on_failure(tmp_path):
    path = write_rows([{"a": 1}], tmp_path / "keep.parquet")
    with pytest.raises(TypeError, match=r"row 1: column 'a'.*object"):
        write_rows([{"a": [1]}, {"a": [object()]}], path)
    assert read_rows(path) == [{"a": 1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.parquet"]


# -------------------------------------------------------------------------------------- schema
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.pop("reward_model"), r"row 3 is missing required field\(s\) \['reward_"),
        (lambda r: r.update(data_source=""), "row 3: field 'data_source' must be a non-empty"),
        (lambda r: r.update(prompt="hi"), "row 3: field 'prompt' must be a list of chat messages"),
        (lambda r: r.update(prompt=[]), "at least one chat message"),
        (lambda r: r["prompt"].append({"role": "bot", "content": "x"}), r"prompt'\[1\]\['role'\]"),
        (lambda r: r["prompt"][0].update(content=5), r"prompt'\[0\]\['content'\] must be a string"),
        (lambda r: r.update(reward_model={"style": "rule"}), "must have a 'ground_truth' key"),
        (lambda r: r.update(extra_info=[1]), "field 'extra_info' must be a dict"),
        (lambda r: r.update(ability=3), "field 'ability' must be a string"),
        (lambda r: r["extra_info"].update(tools="calc"), "extra_info.tools' must be a list"),
    ],
)
def test_validate_row_errors_name_row_and_field(mutate, message):
    row = _row("1+1=", 3)
    validate_row(row, 3)
    mutate(row)
    with pytest.raises(RowValidationError, match=message):
        validate_row(row, 3)


def test_validate_rows_reports_first_bad_index_and_helpers():
    rows = [_row("a", 0), _row("b", 1), {"data_source": "x"}]
    with pytest.raises(RowValidationError, match="row 2 is missing"):
        validate_rows(rows)
    with pytest.raises(RowValidationError, match="row must be a dict"):
        validate_row("not a row")
    row = make_row("arithmetic", "2+2=", "4", ability="math", system_prompt="s")
    assert row["prompt"][0] == {"role": "system", "content": "s"}
    assert row["reward_model"] == {"style": "rule", "ground_truth": "4"}
    filled = normalize_row(
        {
            "data_source": "d",
            "prompt": [{"role": "user", "content": "x"}],
            "reward_model": {"ground_truth": 1},
        }
    )
    assert filled["ability"] == "unknown" and filled["extra_info"] == {}
    assert filled["reward_model"]["style"] == "rule"
    assert row_uid(_row("a", 7), 0) == "arithmetic/train-7"
    assert row_uid({"data_source": "d"}, 5) == "d/row-5"


# ------------------------------------------------------------------------------------- dataset
def test_dataset_tokenizes_through_chat_template(tokenizer):
    rows = [_row("12+7=", 0), _row("3*4=", 1)]
    ds = RLDataset(rows, tokenizer, max_prompt_length=64)
    assert len(ds) == 2 and ds.prompt_lengths == [5 + OVERHEAD, 4 + OVERHEAD]
    item = ds[0]
    assert item["input_ids"].dtype == torch.long and item["input_ids"].ndim == 1
    text = tokenizer.decode(item["input_ids"].tolist())
    assert text == "<|im_start|>user\n12+7=<|im_end|>\n<|im_start|>assistant\n"
    assert item["raw_prompt"] == rows[0]["prompt"]
    assert item["uid"] == "arithmetic/train-0"
    assert item["reward_model"] == rows[0]["reward_model"]
    assert item["extra_info"] == rows[0]["extra_info"]
    item["raw_prompt"].append({"role": "assistant", "content": "19"})
    item["extra_info"]["turns"] = 1
    assert ds[0]["raw_prompt"] == rows[0]["prompt"] and "turns" not in ds[0]["extra_info"]


def test_collate_left_pads_with_mask_and_positions(tokenizer):
    rows = [_row("1+1=", 0), _row("123*456=", 1), _row("7-2=", 2, tools_kwargs={"a": 1})]
    ds = RLDataset(rows, tokenizer, max_prompt_length=64)
    batch = collate_prompts([ds[i] for i in range(3)], pad_token_id=tokenizer.pad_token_id)
    ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    lengths = [4 + OVERHEAD, 8 + OVERHEAD, 4 + OVERHEAD]
    width = max(lengths)
    assert len(batch) == 3 and ids.shape == mask.shape == pos.shape == (3, width)
    for i, n in enumerate(lengths):
        pad = width - n
        assert ids[i, :pad].tolist() == [tokenizer.pad_token_id] * pad
        assert ids[i, pad:].tolist() == ds.input_ids[i]
        assert mask[i].tolist() == [0] * pad + [1] * n
        assert pos[i].tolist() == [0] * pad + list(range(n))
    assert ids[:, -1].tolist() == [ds.input_ids[0][-1]] * 3  # all end with "assistant\n"
    assert list(batch["data_source"]) == ["arithmetic"] * 3
    assert list(batch["ground_truth"]) == ["0", "1", "2"]
    assert list(batch["uid"]) == ["arithmetic/train-0", "arithmetic/train-1", "arithmetic/train-2"]
    assert batch["extra_info"][2]["tools_kwargs"] == {"a": 1}
    assert batch["raw_prompt"][1] == [{"role": "user", "content": "123*456="}]
    with pytest.raises(ValueError, match="at least one item"):
        collate_prompts([], pad_token_id=0)
    with pytest.raises(ValueError, match="item 0 has no 'input_ids'"):
        collate_prompts([rows[0]], pad_token_id=0)


def test_truncation_error_names_row_and_length(tokenizer):
    rows = [_row("ab", 0), _row("x" * 30, 1)]
    with pytest.raises(PromptTooLongError, match=rf"row 1 .*{30 + OVERHEAD} tokens.*=25"):
        RLDataset(rows, tokenizer, max_prompt_length=25, truncation="error")


def test_truncation_filter_counts_and_logs(tokenizer, caplog):
    rows = [_row("x" * n, i) for i, n in enumerate([1, 10, 3, 20, 6])]
    with caplog.at_level(logging.INFO, logger="polyrl.data.dataset"):
        ds = RLDataset(rows, tokenizer, max_prompt_length=OVERHEAD + 6, truncation="filter")
    assert ds.num_filtered == 2 and ds.filtered_indices == [1, 3]
    assert len(ds) == 3 and [ds[i]["uid"] for i in range(3)] == [
        "arithmetic/train-0",
        "arithmetic/train-2",
        "arithmetic/train-4",
    ]
    assert f"filtered 2 of 5 prompts longer than {OVERHEAD + 6} tokens" in caplog.text


@pytest.mark.parametrize("policy", ["left", "right"])
def test_truncation_left_right(tokenizer, policy):
    rows = [_row("abcdefghij", 0), _row("ab", 1)]
    full = RLDataset(rows, tokenizer, max_prompt_length=100).input_ids
    limit = OVERHEAD + 4
    ds = RLDataset(rows, tokenizer, max_prompt_length=limit, truncation=policy)
    assert ds.num_truncated == 1 and ds.num_filtered == 0
    assert ds.input_ids[1] == full[1]
    expected = full[0][-limit:] if policy == "left" else full[0][:limit]
    assert ds.input_ids[0] == expected and len(expected) == limit
    if policy == "left":  # the generation prompt survives
        assert tokenizer.decode(ds.input_ids[0]).endswith("<|im_start|>assistant\n")


def test_dataset_passes_tools_and_template_kwargs(tokenizer):
    tool = {"type": "function", "function": {"name": "calc", "parameters": {}}}
    rows = [_row("q", 0, tools=[tool]), _row("q", 1)]
    ds = RLDataset(rows, tokenizer, 200, apply_chat_template_kwargs={"enable_thinking": False})
    with_tools = tokenizer.decode(ds.input_ids[0])
    assert with_tools.startswith("<|im_start|>system\ntools: calc<|im_end|>")
    assert with_tools.endswith("assistant\n<think></think>")
    assert "tools" not in tokenizer.decode(ds.input_ids[1])
    with pytest.raises(ValueError, match=r"may not set \['tokenize'\]"):
        RLDataset(rows, tokenizer, 200, apply_chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLDataset(rows, tokenizer, 200, truncation="middle")
    with pytest.raises(RowValidationError, match="row 1"):
        RLDataset([rows[0], {"data_source": "d"}], tokenizer, 200)


def test_dataset_from_files_with_dataloader_and_sampler(tokenizer, tmp_path):
    train, _ = write_task_splits("arithmetic", tmp_path, num_train=10, num_test=2, seed=0)
    jsonl = write_rows(read_rows(train)[:3], tmp_path / "more.jsonl")
    ds = RLDataset([train, jsonl], tokenizer, max_prompt_length=64)
    assert len(ds) == 13 and len(set(ds.uids)) == 13  # duplicated rows get distinct uids
    assert ds.uids[10] == ds.uids[0] + "#1"
    sampler = StatefulSampler(len(ds), batch_size=4, seed=1)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=ds.collate)
    epoch0 = [list(b["uid"]) for b in loader]
    epoch1 = [list(b["uid"]) for b in loader]
    assert len(epoch0) == len(epoch1) == 3 and all(len(u) == 4 for u in epoch0)
    assert epoch0 != epoch1
    first = next(iter(loader))
    assert first["input_ids"].shape[0] == 4 and first["attention_mask"][:, -1].all()


#: The tasks with a short answer after ``####`` (``code_simple`` asks for a program: its prompts
#: are longer, and tests/test_reward_code.py covers it).
# Text tasks with short answers (the visual tasks are tested in test_data_vlm.py).
ANSWER_TASKS = sorted(name for name in TASKS if name not in ("code_simple", "visual_count"))


def test_task_prompts_fit_the_tiny_model_tokenizer():
    """The demo's tiny-model tokenizer renders every task prompt in a few dozen tokens."""
    from polyrl.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    for name in ANSWER_TASKS:
        ds = RLDataset(generate(name, 20, seed=0), tok, max_prompt_length=32)
        assert len(ds) == 20 and max(ds.prompt_lengths) <= 32
        text = tok.decode(ds.input_ids[0])
        assert ds.rows[0]["prompt"][0]["content"] in text
        batch = ds.collate([ds[i] for i in range(4)])
        assert batch["attention_mask"].sum(1).tolist() == ds.prompt_lengths[:4]


# ------------------------------------------------------------------------------------- sampler
def test_sampler_epochs_are_seeded_permutations():
    s = StatefulSampler(10, 3, seed=5, drop_last=False)
    e0, e1 = list(s), list(s)
    assert [len(b) for b in e0] == [3, 3, 3, 1]
    assert sorted(itertools.chain(*e0)) == list(range(10))
    assert sorted(itertools.chain(*e1)) == list(range(10))
    assert e0 != e1
    again = StatefulSampler(10, 3, seed=5, drop_last=False)
    assert list(again) == e0 and list(again) == e1
    assert list(StatefulSampler(10, 3, seed=6, drop_last=False)) != e0
    ordered = StatefulSampler(7, 2, shuffle=False)
    assert list(ordered) == [[0, 1], [2, 3], [4, 5]] and len(ordered) == 3


def test_sampler_drop_last_and_errors():
    s = StatefulSampler(10, 4, seed=0, drop_last=True)
    batches = list(s)
    assert len(batches) == len(s) == 2 and all(len(b) == 4 for b in batches)
    assert len(set(itertools.chain(*batches))) == 8
    with pytest.raises(ValueError, match=r"num_items \(3\) < batch_size \(4\)"):
        StatefulSampler(3, 4)
    assert len(StatefulSampler(3, 4, drop_last=False)) == 1
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        StatefulSampler(3, 0)
    state = s.state_dict()
    with pytest.raises(ValueError, match="seed: saved 0 vs this sampler 1"):
        StatefulSampler(10, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        StatefulSampler(10, 4).load_state_dict({**state, "position": 2})
    with pytest.raises(ValueError, match=r"missing keys \['epoch'\]"):
        StatefulSampler(10, 4).load_state_dict({k: v for k, v in state.items() if k != "epoch"})


@settings(max_examples=30, deadline=None)
@given(
    num_items=st.integers(1, 23),
    batch_size=st.integers(1, 7),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    seed=st.integers(0, 1000),
    consumed=st.integers(0, 25),
    ahead=st.integers(1, 25),
)
def test_sampler_exact_resume(num_items, batch_size, shuffle, drop_last, seed, consumed, ahead):
    assume(not (drop_last and num_items < batch_size))
    kwargs = dict(batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
    original = StatefulSampler(num_items, **kwargs)
    for _ in range(consumed):
        original.next_batch()
    state = json.loads(json.dumps(original.state_dict()))  # must survive serialization
    restored = StatefulSampler(num_items, **kwargs)
    restored.load_state_dict(state)
    # Through iteration: the rest of this epoch, then identical following epochs.
    assert list(restored) == list(original)
    assert restored.state_dict() == original.state_dict()
    assert [restored.next_batch() for _ in range(ahead)] == [
        original.next_batch() for _ in range(ahead)
    ]
    # The uninterrupted stream from scratch agrees too.
    fresh = StatefulSampler(num_items, **kwargs)
    stream = [fresh.next_batch() for _ in range(consumed)]
    assert fresh.state_dict() == state and len(stream) == consumed


def test_sampler_resume_mid_epoch_through_iterator():
    s = StatefulSampler(12, 3, seed=2)
    it = iter(s)
    taken = [next(it), next(it)]
    state = s.state_dict()
    assert state["epoch"] == 0 and state["position"] == 2
    rest = list(it)
    r = StatefulSampler(12, 3, seed=2)
    r.load_state_dict(state)
    assert list(r) == rest and len(taken) + len(rest) == 4
    assert list(r) == list(s)  # the next epoch lines up as well
    last = StatefulSampler(12, 3, seed=2)
    for _ in range(4):
        last.next_batch()
    assert last.state_dict()["epoch"] == 1 and last.state_dict()["position"] == 0


# --------------------------------------------------------------------------------------- tasks
def _reachable(numbers: list[int]) -> set[Fraction]:
    """Every value reachable using each number exactly once with + - * / (brute force)."""

    def rec(vals: tuple[Fraction, ...]) -> set[Fraction]:
        if len(vals) == 1:
            return {vals[0]}
        out: set[Fraction] = set()
        for i, j in itertools.combinations(range(len(vals)), 2):
            a, b = vals[i], vals[j]
            rest = tuple(v for k, v in enumerate(vals) if k not in (i, j))
            results = {a + b, a - b, b - a, a * b}
            if b:
                results.add(a / b)
            if a:
                results.add(b / a)
            for r in results:
                out |= rec(rest + (r,))
        return out

    return rec(tuple(Fraction(n) for n in numbers))


@pytest.mark.parametrize("name", ANSWER_TASKS)
def test_tasks_are_deterministic_valid_rows(name):
    rows = generate(name, 40, seed=3)
    assert rows == get_task(name)(40, 3) == generate(name, 40, seed=3, split="train")
    assert generate(name, 15, seed=3) == rows[:15]  # prefix does not depend on num
    assert generate(name, 40, seed=4) != rows
    assert generate(name, 40, seed=3, split="test") != rows
    validate_rows(rows)
    # Preference pairs are arithmetic rows (scored by the arithmetic scorer) plus two answers.
    source = "arithmetic" if name == "arithmetic_pairs" else name
    assert all(r["data_source"] == source for r in rows)
    assert [r["extra_info"]["index"] for r in rows] == list(range(40))
    assert all(len(r["prompt"]) == 1 and r["prompt"][0]["role"] == "user" for r in rows)
    assert all(len(r["prompt"][0]["content"]) <= 24 for r in rows)  # short by default
    instruct = generate(name, 5, seed=3, style="instruct")
    assert all(r["prompt"][0]["content"].endswith("after ####.") for r in instruct)


def test_task_answers_are_correct():
    for row in generate("arithmetic", 100, seed=0, max_digits=3, ops="+-*"):
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", row["prompt"][0]["content"]).groups()
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["reward_model"]["ground_truth"] == str(expected) and expected >= 0
    assert any(
        int(r["reward_model"]["ground_truth"]) < 0
        for r in generate("arithmetic", 100, seed=0, ops="-", allow_negative=True)
    )
    for row in generate("string_reverse", 30, seed=0, min_length=2, max_length=9):
        s = row["extra_info"]["input"]
        assert row["prompt"][0]["content"] == f"reverse {s}="
        assert row["reward_model"]["ground_truth"] == s[::-1] and 2 <= len(s) <= 9
    for row in generate("string_sort", 30, seed=0, alphabet="abc"):
        s = row["extra_info"]["input"]
        assert set(s) <= set("abc") and row["reward_model"]["ground_truth"] == "".join(sorted(s))
    with pytest.raises(ValueError, match="ops must be"):
        generate("arithmetic", 1, 0, ops="/")
    with pytest.raises(ValueError, match=r"min_digits \(3\) must be <= max_digits \(2\)"):
        generate("arithmetic", 1, 0, min_digits=3)
    with pytest.raises(KeyError, match="unknown task 'nope'.*arithmetic"):
        get_task("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_task("arithmetic")(lambda num, seed, split="train": [])


def test_countdown_targets_are_reachable():
    rows = generate("countdown", 25, seed=11, min_numbers=3, max_numbers=4)
    assert {len(r["reward_model"]["ground_truth"]["numbers"]) for r in rows} == {3, 4}
    for row in rows:
        gt = row["reward_model"]["ground_truth"]
        assert set(gt) == {"target", "numbers"} and 1 <= gt["target"] <= 100
        assert all(1 <= n <= 20 for n in gt["numbers"])
        assert Fraction(gt["target"]) in _reachable(gt["numbers"])
        # The stored witness uses each number exactly once and evaluates to the target.
        expr = row["extra_info"]["expression"]
        assert sorted(int(n) for n in re.findall(r"\d+", expr)) == sorted(gt["numbers"])
        assert Fraction(eval(expr)) == gt["target"]  # noqa: S307 - our own digits-and-ops text


def test_write_task_splits_disjoint_and_readable(tmp_path):
    train, test = write_task_splits("string_sort", tmp_path / "s", 60, 20, seed=1, max_length=3)
    assert (train.name, test.name) == ("train.parquet", "test.parquet")
    train_rows, test_rows = read_rows(train), read_rows(test)
    assert len(train_rows) == 60 and len(test_rows) == 20
    validate_rows(train_rows)
    assert [r["extra_info"]["index"] for r in train_rows] == list(range(60))
    assert {r["extra_info"]["split"] for r in train_rows} == {"train"}
    test_prompts = {r["prompt"][0]["content"] for r in test_rows}
    assert not test_prompts & {r["prompt"][0]["content"] for r in train_rows}
    assert write_task_splits("string_sort", tmp_path / "t", 60, 20, 1, max_length=3) == (
        tmp_path / "t/train.parquet",
        tmp_path / "t/test.parquet",
    )
    assert read_rows(tmp_path / "t/train.parquet") == train_rows
    with pytest.raises(ValueError, match="only .* train prompts"):
        # Only one possible prompt ("sort a="), and the test split takes it.
        write_task_splits(
            "string_sort", tmp_path / "u", 5, 1, 0, alphabet="a", max_length=1, min_length=1
        )


def test_tasks_cli(tmp_path):
    out = tmp_path / "cd"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.data.tasks",
            "countdown",
            "--out",
            str(out),
            "--num-train",
            "8",
            "--num-test",
            "4",
            "--seed",
            "2",
            "--kwargs",
            '{"max_number": 9}',
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr
    assert proc.stdout.split() == [str(out / "train.parquet"), str(out / "test.parquet")]
    rows = read_rows(out / "train.parquet")
    assert len(rows) == 8 and all(
        max(r["reward_model"]["ground_truth"]["numbers"]) <= 9 for r in rows
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.data.tasks",
            "countdown",
            "--out",
            str(out),
            "--kwargs",
            '{"colour": 1}',
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert bad.returncode == 2 and "colour" in bad.stderr


# --------------------------------------------------------------------------------------- gsm8k
def test_shipped_gsm8k_sample_is_consistent():
    records = read_rows(sample_gsm8k_path())
    assert len(records) == 20
    for rec in records:
        steps = re.findall(r"<<([^=>]+)=([^>]+)>>", rec["answer"])
        assert steps, rec
        for expr, value in steps:  # every calculator annotation is right
            assert Fraction(eval(expr)) == Fraction(value)  # noqa: S307 - shipped sample
        assert Fraction(extract_gsm8k_answer(rec["answer"])) == Fraction(steps[-1][1])


def test_gsm8k_preprocess_on_shipped_sample(tmp_path):
    train, test = write_gsm8k_splits(sample_gsm8k_path(), tmp_path, test_fraction=0.25, seed=0)
    train_rows, test_rows = read_rows(train), read_rows(test)
    assert len(train_rows) == 15 and len(test_rows) == 5
    validate_rows(train_rows + test_rows)
    questions = {r["extra_info"]["question"] for r in train_rows + test_rows}
    assert len(questions) == 20
    for rows, split in ((train_rows, "train"), (test_rows, "test")):
        assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
        assert {r["extra_info"]["split"] for r in rows} == {split}
    by_question = {r["extra_info"]["question"]: r for r in train_rows + test_rows}
    factory = next(r for q, r in by_question.items() if q.startswith("A factory"))
    assert factory["reward_model"] == {"style": "rule", "ground_truth": "12000"}
    assert factory["data_source"] == "openai/gsm8k" and factory["ability"] == "math"
    content = factory["prompt"][0]["content"]
    assert content == factory["extra_info"]["question"] + " " + INSTRUCTION
    assert content.endswith('output the final answer after "####".')


def test_gsm8k_helpers_and_errors():
    assert extract_gsm8k_answer("a\n#### 1,234") == "1234"
    assert extract_gsm8k_answer("#### 1\nthen\n#### -3.5") == "-3.5"
    with pytest.raises(ValueError, match="no final '#### <number>'"):
        extract_gsm8k_answer("the answer is 4")
    with pytest.raises(ValueError, match="record 1 needs a string 'answer'"):
        convert_gsm8k_rows([{"question": "q", "answer": "#### 1"}, {"question": "q"}], "train")
    with pytest.raises(ValueError, match="record 0: answer has no final"):
        convert_gsm8k_rows([{"question": "q", "answer": "4"}], "train")


def test_gsm8k_cli_with_separate_test_file(tmp_path):
    records = read_rows(sample_gsm8k_path())
    train_in = write_rows(records[:12], tmp_path / "in/train.parquet")
    test_in = write_rows(records[12:], tmp_path / "in/test.jsonl")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "polyrl.data.preprocess_gsm8k",
            "--input",
            str(train_in),
            "--test-input",
            str(test_in),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "RuntimeWarning" not in proc.stderr
    assert len(read_rows(tmp_path / "out/train.parquet")) == 12
    test_rows = read_rows(tmp_path / "out/test.parquet")
    assert [r["extra_info"]["question"] for r in test_rows] == [r["question"] for r in records[12:]]
