"""Tests for polyrl.models: tiny-model factory, tokenizer, chat template and the local loader."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import string
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from polyrl.models import load_causal_lm, load_tokenizer
from polyrl.models.tiny import (
    SPEC_FILE,
    TINY_ARCHS,
    TINY_SIZES,
    TINY_TARGET_PARAMS,
    VISION_ARCHS,
    build_tiny_model,
    count_parameters,
    main,
    resolve_tiny_spec,
    tiny_config,
    tiny_tokenizer,
)
from polyrl.models.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TAG_TOKENS,
    build_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DIGITS_AND_OPERATORS = "0123456789+-*/()=<>"
PRINTABLE = string.printable  # letters, digits, punctuation, space, \t\n\r\x0b\x0c


# The text architectures (qwen2_vl is tested in test_multimodal_core.py with its own classes).
TEXT_ARCHS = tuple(a for a in TINY_ARCHS if a not in VISION_ARCHS)


@pytest.fixture(scope="module")
def reference_tokenizer():
    """The tokenizer as built in memory, before any save."""
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One nano model per architecture; qwen2 goes through the CLI in a real subprocess."""
    root = tmp_path_factory.mktemp("tiny")
    dirs: dict[str, Path] = {}
    out = root / "qwen2"
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.models.tiny", "--arch", "qwen2", "--out", str(out)],
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((out / SPEC_FILE).read_text())
    # The CLI prints the parameter count it recorded.
    assert f"{spec['num_parameters']:,} parameters" in proc.stdout
    dirs["qwen2"] = out
    for arch in TEXT_ARCHS:
        if arch != "qwen2":
            dirs[arch] = build_tiny_model(arch, root / arch)
    return dirs


@pytest.fixture(scope="module", params=TEXT_ARCHS)
def arch_dir(request, model_dirs) -> tuple[str, Path]:
    return request.param, model_dirs[request.param]


def _task_like_strings(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["reverse", "the", "string", "Sort", "letters", "answer", "numbers", "make", "xyzzy"]
    out: list[str] = []
    for i in range(n):
        kind = i % 7
        if kind == 0:  # arithmetic
            parts = [str(rng.randint(0, 99999))]
            for _ in range(rng.randint(1, 4)):
                parts += [rng.choice("+-*/"), str(rng.randint(0, 999))]
            expr = "".join(parts)
            if rng.random() < 0.5:
                expr = f"({expr})*{rng.randint(1, 9)}"
            out.append(expr + rng.choice(["=?", "=", " = ?", f"={rng.randint(-50, 50)}"]))
        elif kind == 1:  # countdown
            nums = [rng.randint(1, 100) for _ in range(rng.randint(3, 6))]
            out.append(
                f"Using {nums} make {rng.randint(1, 999)}: {nums[0]}*{nums[1]}-({nums[2]}/2)"
            )
        elif kind == 2:  # reversed random letters
            s = "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 30)))
            out.append(f"reverse {s}={s[::-1]}")
        elif kind == 3:  # words with odd spacing and newlines
            sep = rng.choice([" ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n"])
            out.append(sep.join(rng.choice(words) for _ in range(rng.randint(1, 8))))
        elif kind == 4:  # arbitrary printable ASCII
            out.append("".join(rng.choice(PRINTABLE) for _ in range(rng.randint(0, 60))))
        elif kind == 5:  # comparisons and answers
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            out.append(f"{a}<{b} is {a < b}; {a}>{b}? #### {max(a, b)}\n")
        else:  # leading/trailing whitespace and tool-ish json
            out.append(f'  {{"name": "calc", "arguments": {{"x": {rng.randint(0, 9)}}}}}  \n')
    return out


# ---------------------------------------------------------------- stock loading, forward, generate


def test_stock_auto_classes_load_forward_and_generate(arch_dir):
    arch, d = arch_dir
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert model.config.model_type == arch
    assert model.config.vocab_size == len(tok)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, return_dict=False
    )
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
    )
    assert out.shape == (1, ids.shape[1] + 4)
    assert torch.equal(out[0, : ids.shape[1]], ids[0])
    assert isinstance(tok.decode(out[0, ids.shape[1] :]), str)


def test_token_ids_agree_between_tokenizer_config_and_generation_config(arch_dir):
    _, d = arch_dir
    tok = AutoTokenizer.from_pretrained(d)
    config = AutoConfig.from_pretrained(d)
    gen = json.loads((d / "generation_config.json").read_text())
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(tok, name) == getattr(config, name) == gen[name], name
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_loader_loads_tiny_model(arch_dir):
    arch, d = arch_dir
    tok = load_tokenizer(d)
    model = load_causal_lm(str(d), dtype="bfloat16")
    assert model.config.model_type == arch
    assert next(model.parameters()).dtype == torch.bfloat16
    assert tok.pad_token == PAD_TOKEN
    assert tok.padding_side == "right"  # returned as saved; callers switch to left for prompts
    batch = tok(["1+2=", "reverse abc="], padding=True)
    lengths = [sum(m) for m in batch["attention_mask"]]
    short = lengths.index(min(lengths))
    assert batch["input_ids"][short][-1] == tok.pad_token_id  # right padding


# ---------------------------------------------------------------- tokenizer


def test_roundtrip_and_ids_survive_reload(arch_dir, reference_tokenizer):
    arch, d = arch_dir
    reloaded = AutoTokenizer.from_pretrained(d)
    texts = _task_like_strings(300, seed=TEXT_ARCHS.index(arch))
    before = reference_tokenizer(texts, add_special_tokens=True)["input_ids"]
    after = reloaded(texts, add_special_tokens=True)["input_ids"]
    for text, ids_before, ids_after in zip(texts, before, after, strict=True):
        assert ids_after == ids_before, text
        assert reloaded.decode(ids_after) == text
    # The serialised pipelines are the same too, not just the ids on these strings.
    saved = json.loads(reloaded.backend_tokenizer.to_str())
    built = json.loads(reference_tokenizer.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "decoder", "added_tokens"):
        assert saved[key] == built[key], key
    assert saved["model"]["vocab"] == built["model"]["vocab"]
    assert saved["model"]["merges"] == built["model"]["merges"]


@pytest.fixture(scope="module")
def qwen2_tokenizer(model_dirs):
    """The qwen2 tokenizer after reload: transformers forces its own class for this arch."""
    return AutoTokenizer.from_pretrained(model_dirs["qwen2"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=PRINTABLE, max_size=80))
def test_printable_ascii_roundtrips_exactly(qwen2_tokenizer, reference_tokenizer, text):
    ids = qwen2_tokenizer.encode(text, add_special_tokens=False)
    assert qwen2_tokenizer.decode(ids) == text
    assert ids == reference_tokenizer.encode(text, add_special_tokens=False)


def test_qwen2_reload_is_forced_class_with_same_pipeline(
    model_dirs, qwen2_tokenizer, reference_tokenizer
):
    # transformers 5 forces Qwen2Tokenizer for model_type qwen2 whatever tokenizer_config says;
    # the saved pipeline must be exactly what that class rebuilds.
    tok = qwen2_tokenizer
    assert type(tok).__name__ == "Qwen2Tokenizer"
    text = "Mixed: 'it's 12 + 7 = 19'\n\t#### done  \r\n"
    assert tok.encode(text) == reference_tokenizer.encode(text)
    for arch in ("llama", "qwen3", "qwen3_moe"):
        assert type(AutoTokenizer.from_pretrained(model_dirs[arch])).__name__ in (
            "TokenizersBackend",
            "Qwen2Tokenizer",
        )


def test_each_digit_and_operator_is_one_token(reference_tokenizer):
    tok = reference_tokenizer
    for ch in DIGITS_AND_OPERATORS:
        assert len(tok.encode(ch, add_special_tokens=False)) == 1, ch
    for text in ["12+345*(6-7)=", "9876543210", "((1+2)*3)/4<5>6", "100-99=1", "+-*/()=<>"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) == len(text), text
        assert [tok.decode([i]) for i in ids] == list(text)
    # Structural check: no vocabulary entry glues a digit or punctuation to anything else.
    specials = set(SPECIAL_TOKENS) | set(TAG_TOKENS)
    for token, idx in tok.get_vocab().items():
        if token in specials:
            continue
        piece = tok.decode([idx])
        if any(c in string.digits or c in string.punctuation for c in piece):
            assert len(piece) == 1, repr(piece)


def test_special_tokens_are_single_and_stable_across_reload(arch_dir, reference_tokenizer):
    _, d = arch_dir
    reloaded = AutoTokenizer.from_pretrained(d)
    control = SPECIAL_TOKENS + TAG_TOKENS
    for expected_id, token in enumerate(control):
        for tok in (reference_tokenizer, reloaded):
            assert tok.encode(token, add_special_tokens=False) == [expected_id], token
            assert tok.convert_tokens_to_ids(token) == expected_id
    text = "<|im_start|>assistant\n<think>2+2</think><tool_call>{}</tool_call><|im_end|>"
    ids = reloaded.encode(text, add_special_tokens=False)
    # Special tokens are dropped by skip_special_tokens; the tags must stay visible.
    assert reloaded.decode(ids, skip_special_tokens=True) == (
        "assistant\n<think>2+2</think><tool_call>{}</tool_call>"
    )
    assert reloaded.decode(ids) == text
    assert reloaded.special_tokens_map == reference_tokenizer.special_tokens_map


def test_no_special_tokens_added_on_plain_encode(reference_tokenizer):
    assert reference_tokenizer.encode("1+1") == reference_tokenizer.encode(
        "1+1", add_special_tokens=False
    )


def test_tokenizer_training_is_deterministic_and_fast():
    import time

    from polyrl.models.tokenizer import _trained_json, build_corpus

    start = time.perf_counter()
    fresh = _trained_json.__wrapped__(1024)
    assert time.perf_counter() - start < 2.0
    assert fresh == _trained_json(1024)
    assert build_corpus() == build_corpus()
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=100)
    with pytest.raises(ValueError, match="reserved_tokens"):
        build_tokenizer(reserved_tokens=-1)


def test_generated_task_strings_roundtrip(model_dirs):
    from polyrl.data.tasks import TASKS, generate

    tok = AutoTokenizer.from_pretrained(model_dirs["qwen2"])
    texts: list[str] = []
    for name in TASKS:
        for style in ("short", "instruct"):
            for row in generate(name, 60, seed=3, style=style):
                texts += [m["content"] for m in row["prompt"]]
                truth = row["reward_model"]["ground_truth"]
                texts.append(truth if isinstance(truth, str) else json.dumps(truth))
                texts += [v for v in row["extra_info"].values() if isinstance(v, str)]
    for kwargs in ({"max_digits": 5, "ops": "+-*", "allow_negative": True},):
        for row in generate("arithmetic", 60, seed=4, **kwargs):
            texts += [row["prompt"][0]["content"], row["reward_model"]["ground_truth"]]
    assert len(texts) > 500
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    for text, row_ids in zip(texts, ids, strict=True):
        assert tok.decode(row_ids) == text
        digits = [t for t in tok.convert_ids_to_tokens(row_ids) if any(c.isdigit() for c in t)]
        assert all(len(t) == 1 for t in digits), text


# ---------------------------------------------------------------- chat template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

CONVERSATION = [
    {"role": "system", "content": "You are a careful solver."},
    {"role": "user", "content": "What is 12*(3+4)?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "use the tool",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "12*(3+4)"}},
            }
        ],
    },
    {"role": "tool", "content": "84"},
    {"role": "tool", "content": "ok"},
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"name": "calculator", "arguments": '{"expression": "84/12"}'}],
    },
    {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "#### 84"},
    {"role": "user", "content": "Thanks!\nBye."},
    {"role": "assistant", "content": "Bye."},
]


def _render(tok, messages, **kwargs) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_template_renders_chatml_with_tools(model_dirs):
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    text = _render(tok, CONVERSATION[:4], tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a careful solver.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert "<tool_call></tool_call>" in text  # the answer format instruction
    assert "<|im_start|>user\nWhat is 12*(3+4)?<|im_end|>\n" in text
    call = (
        "<|im_start|>assistant\n<think>use the tool</think>\n<tool_call>"
        '{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call><|im_end|>\n'
    )
    assert call in text
    assert "<|im_start|>tool\n<tool_response>84</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The rendered call is JSON the agent loop can parse.
    body = call.split("<tool_call>")[1].split("</tool_call>")[0]
    assert json.loads(body) == {"name": "calculator", "arguments": {"expression": "12*(3+4)"}}
    # Without tools there is no tool preamble; without a system message no system turn.
    plain = _render(tok, CONVERSATION[1:2], add_generation_prompt=True)
    assert plain == "<|im_start|>user\nWhat is 12*(3+4)?<|im_end|>\n<|im_start|>assistant\n"
    # String arguments are inserted verbatim.
    later = _render(tok, CONVERSATION[:6])
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "84/12"}}' in later
    assert "Checking.\n<tool_call>" in later


def test_chat_template_tokenize_true_matches_text(arch_dir):
    _, d = arch_dir
    tok = AutoTokenizer.from_pretrained(d)
    ids = tok.apply_chat_template(
        CONVERSATION, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text = _render(tok, CONVERSATION, tools=TOOLS, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == text.count("<|im_start|>")


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_prefix_property_and_delta_tokenization(reference_tokenizer, tools):
    tok = reference_tokenizer
    for k in range(1, len(CONVERSATION)):
        shorter = _render(tok, CONVERSATION[:k], tools=tools)
        longer = _render(tok, CONVERSATION[: k + 1], tools=tools)
        assert longer.startswith(shorter), k
        # Deltas can be tokenised alone: ids(longer) == ids(shorter) + ids(delta).
        delta = longer[len(shorter) :]
        enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
        assert enc(longer) == enc(shorter) + enc(delta), k
        if CONVERSATION[k]["role"] == "assistant":
            prompt = _render(tok, CONVERSATION[:k], tools=tools, add_generation_prompt=True)
            assert longer.startswith(prompt), k


def test_chat_template_rejects_unknown_role(reference_tokenizer):
    with pytest.raises(Exception, match="Unknown message role narrator"):
        _render(reference_tokenizer, [{"role": "narrator", "content": "x"}])


# ---------------------------------------------------------- factory: sizes, specs, idempotence


@pytest.mark.parametrize("arch", TEXT_ARCHS)
@pytest.mark.parametrize("size", list(TINY_SIZES))
def test_preset_parameter_counts(arch, size):
    spec = resolve_tiny_spec(arch, size)
    tok = tiny_tokenizer(spec)
    config = tiny_config(spec, tok)
    with torch.device("meta"):  # exact count, no memory
        model = AutoModelForCausalLM.from_config(config)
    n = count_parameters(model)
    target = TINY_TARGET_PARAMS[size]
    assert 0.6 * target <= n <= 1.4 * target, (arch, size, n)


def test_nano_recorded_count_matches_loaded_model(model_dirs):
    for arch, d in model_dirs.items():
        spec = json.loads((d / SPEC_FILE).read_text())
        model = AutoModelForCausalLM.from_pretrained(d)
        assert spec["num_parameters"] == count_parameters(model), arch
        assert 0.6 * 300_000 <= spec["num_parameters"] <= 1.4 * 300_000


@pytest.mark.slow
def test_small_preset_builds_near_100m(tmp_path):
    d = build_tiny_model("qwen2", tmp_path / "small", size="small")
    model = AutoModelForCausalLM.from_pretrained(d)
    n = count_parameters(model)
    assert 60_000_000 <= n <= 140_000_000
    assert model.config.hidden_size == TINY_SIZES["small"]["hidden"]


def test_build_is_idempotent_seeded_and_guards_other_content(tmp_path):
    kwargs = {"layers": 1, "hidden": 32, "intermediate": 64}
    d = build_tiny_model("llama", tmp_path / "m", seed=1, **kwargs)
    weights = d / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_tiny_model("llama", tmp_path / "m", seed=1, **kwargs) == d
    assert weights.stat().st_mtime_ns == stamp  # reused, not rewritten
    # Same spec elsewhere gives identical weights; another seed gives different ones.
    twin = build_tiny_model("llama", tmp_path / "twin", seed=1, **kwargs)
    assert (twin / "model.safetensors").read_bytes() == weights.read_bytes()
    with pytest.raises(FileExistsError, match="different spec"):
        build_tiny_model("llama", d, seed=2, **kwargs)
    rebuilt = build_tiny_model("llama", d, seed=2, overwrite=True, **kwargs)
    assert json.loads((rebuilt / SPEC_FILE).read_text())["seed"] == 2
    assert (rebuilt / "model.safetensors").read_bytes() != (twin / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="other files"):
        build_tiny_model("llama", other, **kwargs)
    assert (other / "notes.txt").read_text() == "keep me"
    # No temporary directories are left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "other", "twin"]


def test_concurrent_builds_of_one_spec_agree(tmp_path):
    kwargs = {"layers": 1, "hidden": 32, "intermediate": 64, "seed": 5}
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(
            pool.map(lambda _: build_tiny_model("qwen3", tmp_path / "m", **kwargs), range(3))
        )
    assert paths == [tmp_path / "m"] * 3
    solo = build_tiny_model("qwen3", tmp_path / "solo", **kwargs)
    assert (solo / "model.safetensors").read_bytes() == (
        paths[0] / "model.safetensors"
    ).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "solo"]


def test_overrides_win_over_preset(tmp_path):
    d = build_tiny_model(
        "qwen3_moe",
        tmp_path / "moe",
        size="micro",
        hidden=48,
        layers=2,
        heads=6,
        kv_heads=3,
        intermediate=96,
        experts=3,
        experts_per_tok=1,
        vocab_extra=5,
        tie_embeddings=False,
    )
    config = AutoConfig.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert (config.hidden_size, config.num_hidden_layers) == (48, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (6, 3)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (
        3,
        1,
        32,
    )
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(tok) == 1024 + 5
    # Reserved ids decode to their reserved tokens, so any sampled id is decodable.
    assert tok.convert_ids_to_tokens(1024 + 4) == "<|reserved_4|>"
    model = AutoModelForCausalLM.from_pretrained(d)
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 1029)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("gpt2",), {}, "unknown arch 'gpt2'"),
        (("qwen2",), {"size": "huge"}, "unknown size 'huge'"),
        (("qwen2",), {"depth": 3}, "unknown override"),
        (("qwen2",), {"heads": 4, "kv_heads": 3}, "multiple of kv_heads"),
        (("qwen2",), {"hidden": 30, "heads": 4}, "divisible by heads"),
        (("llama",), {"experts": 4}, "only apply to arch 'qwen3_moe'"),
        (("qwen3_moe",), {"experts": 2, "experts_per_tok": 3}, "experts_per_tok"),
        (("qwen2",), {"layers": 0}, "layers must be >= 1"),
        (("qwen2",), {"layers": 1.5}, "layers must be an int"),
        (("qwen2",), {"head_dim": 8}, "qwen2 derives head_dim"),
        (("qwen2",), {"seed": -1}, "seed must be"),
    ],
)
def test_bad_specs_raise_clear_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_tiny_spec(*args, **kwargs)


def test_cli_reports_bad_overrides(tmp_path, capsys):
    rc = main(["--arch", "qwen2", "--out", str(tmp_path / "x"), "--kv-heads", "3"])
    assert rc == 2
    assert "multiple of kv_heads" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- loader errors


def test_loader_errors_name_path_and_what_is_missing(tmp_path, model_dirs):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        load_causal_lm(missing)
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        load_tokenizer(missing)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError, match="file.txt"):
        load_tokenizer(a_file)

    only_tok = tmp_path / "only_tok"
    only_tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dirs["llama"] / name, only_tok / name)
    with pytest.raises(FileNotFoundError, match=r"only_tok.*config\.json and weights"):
        load_causal_lm(only_tok)
    shutil.copy(model_dirs["llama"] / "config.json", only_tok / "config.json")
    with pytest.raises(FileNotFoundError, match=r"lacks weights"):
        load_causal_lm(only_tok)

    no_tok = tmp_path / "no_tok"
    no_tok.mkdir()
    shutil.copy(model_dirs["llama"] / "config.json", no_tok / "config.json")
    with pytest.raises(FileNotFoundError, match=r"no_tok.*lacks tokenizer files.*tokenizer\.json"):
        load_tokenizer(no_tok)

    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_causal_lm(model_dirs["llama"], dtype="float8")
    with pytest.raises(ValueError, match="invalid device"):
        load_causal_lm(model_dirs["llama"], device="gpu:zero")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_causal_lm(model_dirs["llama"], device="cuda")


def test_load_tokenizer_falls_back_to_eos_for_padding(tmp_path, model_dirs, caplog):
    d = tmp_path / "nopad"
    shutil.copytree(model_dirs["llama"], d)
    cfg_path = d / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["pad_token"]
    cfg_path.write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="polyrl.models.loader"):
        tok = load_tokenizer(d)
    assert tok.pad_token == tok.eos_token == EOS_TOKEN
    assert tok.pad_token_id == tok.eos_token_id
    assert "no pad token" in caplog.text
