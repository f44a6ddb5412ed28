"""Tests for polyrl.reward: scorers, user functions and the process-pool RewardManager."""

from __future__ import annotations

import math
import os
import threading
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polyrl.core import expressions
from polyrl.core.batch import Batch
from polyrl.reward import (
    SCORERS,
    ExpressionError,
    GarbageResultError,
    RewardManager,
    arithmetic_score,
    bind_scorer,
    call_scorer,
    countdown_score,
    evaluate_expression,
    extract_answer,
    get_scorer,
    gsm8k_extract,
    gsm8k_score,
    load_user_function,
    math_score,
    normalize_result,
    register_scorer,
    string_reverse_score,
    string_sort_score,
)
from polyrl.reward import scorers as scorers_module

FIXTURES = Path(__file__).parent / "fixtures" / "reward_fns.py"


def fixture_spec(name: str) -> str:
    return f"{FIXTURES}:{name}"


# ======================================================================================
# registry and answer extraction
# ======================================================================================


def test_builtin_sources_and_aliases_are_registered():
    for name in ["arithmetic", "countdown", "string_reverse", "string_sort", "gsm8k", "math"]:
        assert callable(get_scorer(name))
    assert get_scorer("openai/gsm8k") is get_scorer("gsm8k")
    assert get_scorer("lighteval/MATH") is get_scorer("math") is math_score
    assert get_scorer("DigitalLearningGmbH/MATH-lighteval") is math_score
    assert get_scorer("gsm8k_flexible") is not get_scorer("gsm8k")


def test_unknown_source_error_lists_registered_sources():
    with pytest.raises(KeyError) as info:
        get_scorer("no_such_task")
    message = str(info.value)
    assert "no_such_task" in message and "arithmetic" in message and "countdown" in message


def test_register_scorer_aliases_duplicates_and_bad_names():
    def my_scorer(response, ground_truth, extra_info=None, prompt=None):
        return 1.0

    def other(response, ground_truth, extra_info=None, prompt=None):
        return 0.0

    try:
        register_scorer("test_src_a", "test_src_b")(my_scorer)
        assert SCORERS["test_src_a"] is SCORERS["test_src_b"] is my_scorer
        register_scorer("test_src_a")(my_scorer)  # same function again is fine
        with pytest.raises(ValueError, match="already registered"):
            register_scorer("test_src_a")(other)
        register_scorer("test_src_a", overwrite=True)(other)
        assert get_scorer("test_src_a") is other
    finally:
        SCORERS.remove("test_src_a")
        SCORERS.remove("test_src_b")
    with pytest.raises(ValueError, match="at least one"):
        register_scorer()
    with pytest.raises(ValueError, match="non-empty"):
        register_scorer("")
    with pytest.raises(TypeError, match="callable"):
        register_scorer("test_src_c")(42)
    assert "test_src_c" not in SCORERS


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("think <answer> 42 </answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<ANSWER>x</ANSWER>", "x"),
        ("work work #### 17", "17"),
        ("#### 1 #### 2", "2"),
        ("<answer>a</answer> #### b", "a"),  # tags win over ####
        ("  plain text  ", "plain text"),
        ("", None),
        ("<answer>   </answer>", None),
        (None, None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


def test_extract_answer_rejects_non_strings():
    with pytest.raises(TypeError, match="str"):
        extract_answer(42)


# ======================================================================================
# arithmetic
# ======================================================================================


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("<answer>19</answer>", "19", 1.0),
        ("3 + 16 = 19", "19", 1.0),
        ("#### -3", "-3", 1.0),
        ("<answer>the result is 19.0</answer>", "19", 1.0),
        ("<answer>1,000</answer>", "1000", 1.0),
        ("<answer>18</answer>", "19", 0.0),
        ("<answer>19.5</answer>", "5", 0.0),  # a decimal is not read as its tail digits
        ("<answer>3</answer>", "-3", 0.0),
        ("<answer>no idea</answer>", "19", 0.0),
        ("", "19", 0.0),
    ],
)
def test_arithmetic(response, truth, score):
    assert arithmetic_score(response, truth) == score


@pytest.mark.parametrize("truth", ["nineteen", "1.5", "", None, True, ["19"]])
def test_arithmetic_bad_ground_truth(truth):
    with pytest.raises(ValueError, match="arithmetic: ground_truth"):
        arithmetic_score("19", truth)


# ======================================================================================
# countdown
# ======================================================================================

GT = {"target": 16, "numbers": [3, 5, 2]}


@pytest.mark.parametrize(
    ("response", "score", "valid"),
    [
        ("<answer>(3 + 5) * 2</answer>", 1.0, True),
        ("<answer>2 * (5 + 3) = 16</answer>", 1.0, True),
        ("<answer>(3 + 5) × 2</answer>", 1.0, True),
        ("<answer>(3 + 5) + 2</answer>", 0.0, True),  # wrong value
        ("<answer>(5 + 3) * 2 + 2 - 2</answer>", 0.0, True),  # 2 reused
        ("<answer>8 * 2</answer>", 0.0, True),  # 8 is not a given number
        ("<answer>(3 + 5) * 2 = 17</answer>", 0.0, False),  # wrong claim after '='
        ("<answer>(3 + 5) * 2 = 16 = 16</answer>", 0.0, False),
        ("<answer>__import__('os').system('true')</answer>", 0.0, False),
        ("<answer>2**999999</answer>", 0.0, False),
        ("<answer>3 / (5 - 5) * 2</answer>", 0.0, False),  # division by zero
        ("<answer>1.5 * 2</answer>", 0.0, False),
        ("<answer>(3 + 5 * 2</answer>", 0.0, False),
        ("<answer>3 5 2</answer>", 0.0, False),
        ("<answer></answer>", 0.0, False),
        ("", 0.0, False),
    ],
)
def test_countdown_cases(response, score, valid):
    assert countdown_score(response, GT) == {"score": score, "valid_expr": valid}


def test_countdown_missing_number_is_wrong():
    assert countdown_score("<answer>5 + 3</answer>", {"target": 8, "numbers": [3, 5, 2]}) == {
        "score": 0.0,
        "valid_expr": True,
    }


def test_countdown_uses_exact_fractions():
    # 8 / (3 - 8/3) = 24 exactly; float arithmetic would give 23.999...
    gt = {"target": 24, "numbers": [8, 3, 8, 3]}
    assert countdown_score("<answer>8 / (3 - 8 / 3)</answer>", gt)["score"] == 1.0
    assert (
        countdown_score("<answer>-5 + 3</answer>", {"target": -2, "numbers": [5, 3]})["score"]
        == 1.0
    )


def test_countdown_rejects_huge_nesting_and_sizes_quickly():
    deep = "(" * 5000 + "3" + ")" * 5000
    start = time.perf_counter()
    assert countdown_score(f"<answer>{deep}</answer>", GT)["valid_expr"] is False
    assert countdown_score("<answer>" + "-" * 200 + "3</answer>", GT)["valid_expr"] is False
    big = "*".join(["999999999999"] * 19)  # each literal < the digit limit; product > bits
    assert len(big) <= expressions.MAX_EXPR_CHARS
    assert countdown_score(f"<answer>{big}</answer>", GT)["valid_expr"] is False
    assert countdown_score("<answer>1234567890123 + 1</answer>", GT)["valid_expr"] is False
    assert time.perf_counter() - start < 1.0


def test_countdown_format_score_from_kwarg_and_extra_info():
    wrong = "<answer>3 + 5 + 2</answer>"
    assert countdown_score(wrong, GT, format_score=0.1)["score"] == 0.1
    assert countdown_score(wrong, GT, {"format_score": 0.2})["score"] == 0.2
    assert countdown_score("<answer>oops</answer>", GT, {"format_score": 0.2})["score"] == 0.0
    assert countdown_score("<answer>(3+5)*2</answer>", GT, {"format_score": 0.2})["score"] == 1.0


@pytest.mark.parametrize(
    "truth",
    [
        {"target": 16},
        {"numbers": [1]},
        {"target": "x", "numbers": [1]},
        {"target": 1, "numbers": [1.5]},
        [16, [3, 5]],
        "16",
        None,
    ],
)
def test_countdown_bad_ground_truth(truth):
    with pytest.raises(ValueError, match="countdown: ground_truth"):
        countdown_score("<answer>1</answer>", truth)


def test_countdown_accepts_numpy_ints():
    gt = {"target": np.int64(16), "numbers": np.array([3, 5, 2])}
    assert countdown_score("<answer>(3 + 5) * 2</answer>", gt)["score"] == 1.0


def test_evaluate_expression_errors_are_clear():
    with pytest.raises(ExpressionError, match="disallowed character"):
        evaluate_expression("__import__('os')")
    with pytest.raises(ExpressionError, match="division by zero"):
        evaluate_expression("1/0")
    with pytest.raises(ExpressionError, match="empty"):
        evaluate_expression("   ")
    with pytest.raises(ExpressionError, match="characters"):
        evaluate_expression("1+" * 200 + "1")


_leaf = st.integers(min_value=0, max_value=99).map(lambda n: (str(n), Fraction(n)))


def _combine(children):
    def build(parts):
        (ltext, lval), op, (rtext, rval) = parts
        if op == "/" and rval == 0:
            op = "*"
        value = {"+": lval + rval, "-": lval - rval, "*": lval * rval}.get(op)
        if op == "/":
            value = lval / rval
        return f"({ltext} {op} {rtext})", value

    return st.tuples(children, st.sampled_from("+-*/"), children).map(build)


@settings(max_examples=30, deadline=None)
@given(st.recursive(_leaf, _combine, max_leaves=8))
def test_evaluate_expression_matches_exact_arithmetic(tree):
    text, expected = tree
    value, numbers = evaluate_expression(text)
    assert value == expected
    assert numbers == [
        int(tok) for tok in text.replace("(", " ").replace(")", " ").split() if tok.isdigit()
    ]


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet="0123456789+-*/() x=.e_a'", max_size=40))
def test_countdown_never_raises_on_arbitrary_text(text):
    result = countdown_score(f"<answer>{text}</answer>", GT)
    assert result["score"] in (0.0, 1.0) and isinstance(result["valid_expr"], bool)


# ======================================================================================
# string tasks
# ======================================================================================


def test_string_reverse_and_sort():
    assert string_reverse_score("<answer>olleh</answer>", "olleh") == 1.0
    assert string_reverse_score("olleh", " olleh ") == 1.0
    assert string_reverse_score("<answer>hello</answer>", "olleh") == 0.0
    assert string_reverse_score("<answer>olleh</answer> <answer>x</answer>", "olleh") == 0.0
    assert string_reverse_score("", "olleh") == 0.0
    assert string_sort_score("<answer>ehllo</answer>", "ehllo") == 1.0
    assert string_sort_score("<answer>EHLLO</answer>", "ehllo") == 0.0
    assert get_scorer("string_sort") is string_sort_score
    for fn in (string_reverse_score, string_sort_score):
        with pytest.raises(ValueError, match="ground_truth must be a str"):
            fn("abc", ["a", "b", "c"])


# ======================================================================================
# GSM8K
# ======================================================================================


@pytest.mark.parametrize(
    ("response", "truth", "strict", "flexible"),
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
        ("so #### $1,234", "1234", 1.0, 1.0),
        ("#### 72.00", "72", 1.0, 1.0),
        ("#### -5", "-5", 1.0, 1.0),
        ("The answer is 72.", "72", 0.0, 1.0),  # no '####': only flexible finds it
        ("I got 70, no wait, 72", "72", 0.0, 1.0),
        ("#### 71", "72", 0.0, 0.0),
        ("#### seventy-two", "72", 0.0, 0.0),
        ("", "72", 0.0, 0.0),
        ("#### 72", "Step one... 24*3 = 72\n#### 72", 1.0, 1.0),  # full gold solution
        ("#### 5", 5, 1.0, 1.0),
    ],
)
def test_gsm8k(response, truth, strict, flexible):
    assert get_scorer("gsm8k")(response, truth) == strict
    assert get_scorer("openai/gsm8k")(response, truth) == strict
    assert get_scorer("gsm8k_flexible")(response, truth) == flexible
    assert gsm8k_score(response, truth, {"method": "flexible"}) == flexible


def test_gsm8k_extract_and_errors():
    assert gsm8k_extract("#### 1,000,000.") == "1000000"
    assert gsm8k_extract("a 1 b 2 c", "flexible") == "2"
    assert gsm8k_extract("nothing") is None
    assert gsm8k_score("#### 3", "4", format_score=0.1) == 0.1
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        gsm8k_extract("#### 1", "fuzzy")
    with pytest.raises(ValueError, match="gsm8k: ground_truth"):
        gsm8k_score("#### 1", "no number here")
    with pytest.raises(ValueError, match="gsm8k: ground_truth"):
        gsm8k_score("#### 1", None)


# ======================================================================================
# MATH (math-verify)
# ======================================================================================


@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("So the answer is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),
        ("$\\boxed{1+x^2}$", "x^2+1", 1.0),
        ("<answer>$\\frac{3}{4}$</answer>", "\\dfrac{3}{4}", 1.0),
        ("Solution ... \\boxed{3}", "The sum is $1+2=\\boxed{3}$.", 1.0),
        ("\\boxed{4}", ["3", "4"], 1.0),
        ("\\boxed{0.6}", "\\frac{1}{2}", 0.0),
        ("\\boxed{x^2-1}", "x^2+1", 0.0),
    ],
)
def test_math_right_and_wrong(response, truth, score):
    result = math_score(response, truth)
    assert result["score"] == score and result["answer_found"] == 1.0


def test_math_no_answer_and_bad_ground_truth():
    assert math_score("I have no idea.", "\\frac{1}{2}") == {"score": 0.0, "answer_found": 0.0}
    assert math_score("", "3") == {"score": 0.0, "answer_found": 0.0}
    for bad in ["", None, [], True, {"a": 1}]:
        with pytest.raises(ValueError, match="math: "):
            math_score("\\boxed{1}", bad)


def test_math_verify_needs_main_thread_but_our_scorer_does_not():
    """math-verify's signal timeout breaks in threads; math_score turns it off there."""
    import math_verify

    outcome: dict[str, object] = {}

    def run():
        try:
            math_verify.parse("$1$", parsing_timeout=5)
        except ValueError as exc:
            outcome["library"] = str(exc)
        outcome["ours"] = math_score("\\boxed{\\frac{2}{4}}", "0.5")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert "thread" in str(outcome["library"])
    assert outcome["ours"] == {"score": 1.0, "answer_found": 1.0}


def test_set_math_verify_timeout_validates():
    with pytest.raises(ValueError, match="timeout"):
        scorers_module.set_math_verify_timeout(-1)
    with pytest.raises(ValueError, match="timeout"):
        scorers_module.set_math_verify_timeout(1.5)  # signal.alarm takes whole seconds


# ======================================================================================
# user functions
# ======================================================================================


def test_load_user_function_and_errors(tmp_path):
    fn = load_user_function(fixture_spec("compute_score"))
    assert fn("x", "ab", "ab", {"bonus": 0.5}) == 1.5
    assert fn.__polyrl_spec__ == f"{FIXTURES}:compute_score"
    assert load_user_function(fixture_spec("compute_score")) is fn  # module loaded once

    with pytest.raises(ValueError, match="path/to/file.py:function_name"):
        load_user_function("no_colon_here.py")
    with pytest.raises(ValueError, match="identifier"):
        load_user_function(f"{FIXTURES}:not-a-name")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_user_function(f"{tmp_path}/missing.py:f")
    with pytest.raises(AttributeError, match="no attribute 'nope'.*simple_reward"):
        load_user_function(fixture_spec("nope"))
    with pytest.raises(TypeError, match="not a callable"):
        load_user_function(fixture_spec("NOT_CALLABLE"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    with pytest.raises(ImportError, match="boom at import"):
        load_user_function(f"{broken}:f")


def test_call_scorer_binds_by_name():
    common = dict(
        prompt="say hi",
        response=" hi",
        ground_truth="hi",
        data_source="src",
        extra_info={"bonus": 0.25},
    )
    simple = load_user_function(fixture_spec("simple_reward"))
    verl = load_user_function(fixture_spec("compute_score"))
    kwargs = load_user_function(fixture_spec("kwargs_reward"))
    assert call_scorer(simple, **common) == 1.0
    assert call_scorer(verl, **{**common, "response": "hi"}) == 1.25
    assert call_scorer(kwargs, **common) == {
        "score": 6.0,
        "has_solution_str": True,
        "has_prompt": True,
    }

    def positional_only(response, /, ground_truth):
        return float(response == ground_truth)

    assert call_scorer(positional_only, **{**common, "response": "hi"}) == 1.0
    assert bind_scorer(positional_only).positional == ("response",)


def test_bind_scorer_rejects_unsupplied_parameters():
    needs_secret = load_user_function(fixture_spec("needs_secret"))
    with pytest.raises(TypeError, match="'secret'.*supported parameter names"):
        bind_scorer(needs_secret)

    def optional_unknown(response, temperature=1.0):
        return temperature

    assert (
        call_scorer(
            optional_unknown,
            prompt=None,
            response="r",
            ground_truth=None,
            data_source=None,
            extra_info=None,
        )
        == 1.0
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (1, (1.0, {})),
        (0.25, (0.25, {})),
        (True, (1.0, {})),
        (np.float32(0.5), (0.5, {})),
        (np.bool_(True), (1.0, {})),
        (np.array(2.0), (2.0, {})),
        (torch.tensor(3.0), (3.0, {})),
        (
            {"score": 1, "acc": True, "len": np.int64(4), "pred": "42"},
            (1.0, {"acc": 1.0, "len": 4.0}),
        ),
    ],
)
def test_normalize_result_accepts(raw, expected):
    assert normalize_result(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        None,
        "1.0",
        float("nan"),
        float("inf"),
        {"acc": 1.0},
        {"score": float("nan")},
        {"score": "1"},
        [1.0],
        np.array([1.0, 2.0]),
        object(),
    ],
)
def test_normalize_result_rejects_garbage(raw):
    with pytest.raises(GarbageResultError):
        normalize_result(raw)


# ======================================================================================
# RewardManager
# ======================================================================================


@pytest.fixture(scope="module")
def tokenizer():
    from polyrl.models.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def builtin_pool(tokenizer):
    with RewardManager(num_workers=2, timeout_s=10.0, tokenizer=tokenizer) as manager:
        yield manager


@pytest.fixture(scope="module")
def behave_pool():
    with RewardManager(
        fixture_spec("behave"), num_workers=2, timeout_s=1.0, error_reward=-1.0
    ) as manager:
        manager.score_samples([{"response": "good"}] * 4)  # wait for both workers
        yield manager


MIXED = [
    ("arithmetic", "<answer>19</answer>", "19", 1.0),
    ("arithmetic", "<answer>18</answer>", "19", 0.0),
    ("countdown", "<answer>(3 + 5) * 2</answer>", {"target": 16, "numbers": [3, 5, 2]}, 1.0),
    ("countdown", "<answer>__import__('os')</answer>", {"target": 16, "numbers": [3, 5, 2]}, 0.0),
    ("string_reverse", "<answer>cba</answer>", "cba", 1.0),
    ("openai/gsm8k", "#### 1,000", "1000", 1.0),
    ("math", "\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("math", "\\boxed{2}", "3", 0.0),
]


def mixed_batch() -> Batch:
    return Batch(
        non_tensors={
            "data_source": [m[0] for m in MIXED],
            "response_text": [m[1] for m in MIXED],
            "ground_truth": [m[2] for m in MIXED],
            "extra_info": [{"index": i} for i in range(len(MIXED))],
        }
    )


def test_pool_scores_builtin_batch_like_in_process(builtin_pool):
    result = builtin_pool.score(mixed_batch())
    expected = torch.tensor([m[3] for m in MIXED], dtype=torch.float32)
    assert result.scores.dtype == torch.float32 and result.scores.shape == (len(MIXED),)
    assert torch.equal(result.scores, expected)
    assert result.statuses == ["ok"] * len(MIXED)
    valid = result.extras["valid_expr"]
    assert valid[2] == 1.0 and valid[3] == 0.0 and np.isnan(valid[0])
    assert list(result.extras["answer_found"][-2:]) == [1.0, 1.0]
    m = result.metrics
    assert m["reward/score/mean"] == pytest.approx(5 / 8)
    assert m["reward/arithmetic/mean"] == 0.5 and m["reward/math/mean"] == 0.5
    assert m["reward/openai/gsm8k/mean"] == 1.0
    assert m["reward/extra/valid_expr/mean"] == 0.5
    assert m["reward/errors"] == m["reward/timeouts"] == m["reward/garbage"] == 0.0

    with RewardManager(num_workers=0) as local:
        in_process = local.score(mixed_batch())
    assert torch.equal(in_process.scores, result.scores)
    assert in_process.metrics.keys() == result.metrics.keys()


def test_pool_handles_thousand_trivial_samples_fast(builtin_pool):
    samples = [
        {
            "data_source": "arithmetic",
            "response": f"<answer>{i}</answer>",
            "ground_truth": str(i if i % 4 else i + 1),
        }
        for i in range(1000)
    ]
    builtin_pool.score_samples(samples[:10])  # warm
    start = time.perf_counter()
    result = builtin_pool.score_samples(samples)
    elapsed = time.perf_counter() - start
    assert result.metrics["reward/score/mean"] == 0.75
    assert elapsed < 2.0, f"1000 trivial samples took {elapsed:.2f}s"


def test_decodes_responses_with_tokenizer(builtin_pool, tokenizer):
    texts = ["<answer>19</answer>", "<answer>7</answer>", "#### 5"]
    prompts = ["What is 9 + 10?", "What is 3 + 4?", "What is 2 + 3?"]
    pad = tokenizer.pad_token_id
    resp_ids = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    width, pwidth = max(map(len, resp_ids)) + 2, max(map(len, prompt_ids))
    responses = torch.full((3, width), pad)
    response_mask = torch.zeros(3, width, dtype=torch.long)
    prompt_t = torch.full((3, pwidth), pad)
    prompt_mask = torch.zeros(3, pwidth, dtype=torch.long)
    for i, (r, p) in enumerate(zip(resp_ids, prompt_ids, strict=True)):
        responses[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = 1
        prompt_t[i, pwidth - len(p) :] = torch.tensor(p)  # left padded, as in rollouts
        prompt_mask[i, pwidth - len(p) :] = 1
    # A non-pad token under a zero mask must be ignored by the decoding.
    responses[0, -1] = tokenizer("9")["input_ids"][0]
    non_tensors = {"data_source": ["arithmetic"] * 3, "ground_truth": ["19", "8", "5"]}

    batch = Batch(
        tensors={"responses": responses, "response_mask": response_mask, "prompts": prompt_t},
        non_tensors=non_tensors,
    )
    result = builtin_pool.score(batch)
    assert result.scores.tolist() == [1.0, 0.0, 1.0]

    # verl layout: attention_mask over prompt + response instead of response_mask.
    attention = torch.cat([prompt_mask, response_mask], dim=1)
    verl_batch = Batch(
        tensors={"responses": responses, "prompts": prompt_t, "attention_mask": attention},
        non_tensors=non_tensors,
    )
    assert builtin_pool.score(verl_batch).scores.tolist() == [1.0, 0.0, 1.0]

    # The decoded prompt reaches user functions that ask for it.
    with RewardManager(fixture_spec("kwargs_reward"), num_workers=0, tokenizer=tokenizer) as local:
        got = local.score(verl_batch)
    assert got.extras["has_prompt"].tolist() == [1.0, 1.0, 1.0]
    local_items = RewardManager(num_workers=0, tokenizer=tokenizer)._items_from_batch(verl_batch)
    assert [item[2] for item in local_items] == prompts
    assert [item[3] for item in local_items] == texts


def test_batch_missing_columns_are_named(builtin_pool):
    with pytest.raises(ValueError, match="data_source"):
        builtin_pool.score(Batch(non_tensors={"response_text": ["1"], "ground_truth": ["1"]}))
    with pytest.raises(ValueError, match="response_text"):
        builtin_pool.score(
            Batch(non_tensors={"data_source": ["arithmetic"], "ground_truth": ["1"]})
        )
    with RewardManager(num_workers=0) as no_tokenizer:
        batch = Batch(
            tensors={"responses": torch.zeros(1, 3, dtype=torch.long)},
            non_tensors={"data_source": ["arithmetic"], "ground_truth": ["1"]},
        )
        with pytest.raises(ValueError, match="no tokenizer"):
            no_tokenizer.score(batch)
    with pytest.raises(KeyError, match="unknown scorer 'nope'"):
        builtin_pool.score_samples([{"data_source": "nope", "response": "1", "ground_truth": "1"}])
    with pytest.raises(ValueError, match="sample 1 has no 'response'"):
        builtin_pool.score_samples(
            [{"response": "1", "data_source": "arithmetic", "ground_truth": "1"}, {"text": "x"}]
        )
    with pytest.raises(TypeError, match="Batch"):
        builtin_pool.score([{"response": "1"}])


def test_verl_reward_model_column_and_scorer_errors(builtin_pool):
    batch = Batch(
        non_tensors={
            "data_source": ["arithmetic", "arithmetic"],
            "response_text": ["<answer>4</answer>", "<answer>4</answer>"],
            "reward_model": [{"ground_truth": "4"}, {"ground_truth": "not a number"}],
        }
    )
    result = builtin_pool.score(batch)
    assert result.scores.tolist() == [1.0, 0.0]
    assert result.statuses == ["ok", "error"]
    assert result.metrics["reward/errors"] == 1.0
    assert "arithmetic: ground_truth" in result.failures[1]


def test_user_registered_scorers_are_shipped_to_workers(builtin_pool):
    try:
        register_scorer("test_fixture_source")(load_user_function(fixture_spec("dict_reward")))
        result = builtin_pool.score_samples(
            [
                {"data_source": "test_fixture_source", "response": "abc", "ground_truth": "abc"},
                {"data_source": "arithmetic", "response": "1", "ground_truth": "1"},
            ]
        )
        assert result.scores.tolist() == [1.0, 1.0]
        assert result.extras["length"][0] == 3.0 and np.isnan(result.extras["length"][1])
        assert "note" not in result.extras

        register_scorer("test_lambda_source")(lambda response, ground_truth: 1.0)
        with pytest.raises(TypeError, match="test_lambda_source.*module-level"):
            builtin_pool.score_samples(
                [{"data_source": "test_lambda_source", "response": "1", "ground_truth": "1"}]
            )
        # The pool is unaffected by the refused batch.
        ok = builtin_pool.score_samples(
            [{"data_source": "string_sort", "response": "ab", "ground_truth": "ab"}]
        )
        assert ok.scores.tolist() == [1.0]
    finally:
        SCORERS.remove("test_fixture_source")
        SCORERS.remove("test_lambda_source")


def test_failures_are_contained_and_counted(behave_pool):
    responses = [
        "good",
        "raise",
        "none",
        "str",
        "nan",
        "inf",
        "nodict",
        "exit",
        "good",
        "segfault",
        "bad",
        "good",
    ]
    pids_before = set(behave_pool.worker_pids)
    result = behave_pool.score_samples([{"response": r} for r in responses])
    assert result.statuses == [
        "ok",
        "error",
        "garbage",
        "garbage",
        "garbage",
        "garbage",
        "garbage",
        "error",
        "ok",
        "error",
        "ok",
        "ok",
    ]
    assert result.scores.tolist() == [
        1.0,
        -1.0,
        -1.0,
        -1.0,
        -1.0,
        -1.0,
        -1.0,
        -1.0,
        1.0,
        -1.0,
        0.0,
        1.0,
    ]
    assert result.metrics["reward/errors"] == 3.0
    assert result.metrics["reward/garbage"] == 5.0
    assert result.metrics["reward/timeouts"] == 0.0
    assert "scorer exploded on purpose" in result.failures[1]
    assert "died (exit code 1)" in result.failures[7]
    assert "died (exit code -11)" in result.failures[9]  # SIGSEGV
    assert "without a 'score'" in result.failures[6]
    assert len(set(behave_pool.worker_pids) - pids_before) == 2  # two workers replaced

    again = behave_pool.score_samples([{"response": "good"}] * 8)
    assert again.statuses == ["ok"] * 8 and again.scores.sum().item() == 8.0


@pytest.mark.parametrize("kind", ["hang", "spin"])
def test_hanging_scorer_times_out_and_worker_is_killed(behave_pool, kind):
    pids_before = set(behave_pool.worker_pids)
    start = time.perf_counter()
    result = behave_pool.score_samples([{"response": kind}, {"response": "good"}])
    elapsed = time.perf_counter() - start
    assert result.statuses == ["timeout", "ok"]
    assert result.scores.tolist() == [-1.0, 1.0]
    assert result.metrics["reward/timeouts"] == 1.0
    assert "timeout_s=1.0" in result.failures[0]
    # Not before the 1 s limit; far from the scorer's own end (hang: 1000 s, spin: never).
    assert 0.9 <= elapsed < 60, elapsed
    (killed,) = pids_before - set(behave_pool.worker_pids)
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)
    assert behave_pool.score_samples([{"response": "good"}] * 3).scores.tolist() == [1.0] * 3


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # zombie: dead, not reaped
    except FileNotFoundError:
        return True


def test_timed_out_worker_takes_its_child_processes_down(tmp_path):
    pid_file = tmp_path / "child.pid"
    with RewardManager(
        fixture_spec("spawn_child_and_hang"), num_workers=1, timeout_s=1.5
    ) as manager:
        result = manager.score_samples(
            [{"response": "x", "extra_info": {"pid_file": str(pid_file)}}]
        )
    assert result.statuses == ["timeout"]
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not _process_gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _process_gone(child), f"grandchild {child} survived its worker"


def test_extras_from_dict_results_with_nan_where_absent(tmp_path):
    with RewardManager(fixture_spec("only_some_have_extra"), num_workers=1) as manager:
        result = manager.score_samples([{"response": "xx"}, {"response": "y"}, {"response": "x"}])
    assert result.scores.tolist() == [1.0, 0.5, 1.0]
    xs = result.extras["xs"]
    assert xs[0] == 2.0 and math.isnan(xs[1]) and xs[2] == 1.0
    assert result.metrics["reward/extra/xs/mean"] == 1.5


def test_verl_and_simple_user_functions_in_pool():
    samples = [
        {
            "prompt": "repeat after me: hi",
            "response": "hi",
            "ground_truth": "hi",
            "data_source": "anything",
            "extra_info": {"bonus": 0.5},
        },
        {
            "prompt": "repeat after me: yo",
            "response": "no",
            "ground_truth": "yo",
            "data_source": "anything",
            "extra_info": None,
        },
    ]
    with RewardManager(
        fixture_spec("compute_score"), num_workers=1, mp_context="forkserver"
    ) as verl:
        assert verl.score_samples(samples).scores.tolist() == [1.5, 0.0]
    with RewardManager(load_user_function(fixture_spec("simple_reward")), num_workers=1) as simple:
        assert simple.score_samples(samples).scores.tolist() == [1.0, 0.0]
    # A module-level callable is pickled to the workers and receives data_source-free args.
    with RewardManager(arithmetic_score, num_workers=1) as pickled:
        result = pickled.score_samples([{"response": "<answer>3</answer>", "ground_truth": "3"}])
        assert result.scores.tolist() == [1.0]


def test_manager_argument_errors():
    with pytest.raises(TypeError, match="module-level"):
        RewardManager(lambda response: 1.0, num_workers=1)
    with pytest.raises(TypeError, match="'secret'"):
        RewardManager(fixture_spec("needs_secret"), num_workers=0)
    with pytest.raises(FileNotFoundError):
        RewardManager("/nonexistent/reward.py:f", num_workers=0)
    with pytest.raises(TypeError, match="custom_function must be"):
        RewardManager(3.5, num_workers=0)
    with pytest.raises(ValueError, match="num_workers"):
        RewardManager(num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManager(num_workers=0, timeout_s=0)
    with pytest.raises(ValueError, match="mp_context"):
        RewardManager(num_workers=0, mp_context="fork")
    with pytest.raises(ValueError, match="error_reward"):
        RewardManager(num_workers=0, error_reward=float("nan"))
    # Lambdas are fine in-process, where nothing is pickled.
    with RewardManager(lambda response: len(response), num_workers=0) as local:
        assert local.score_samples([{"response": "abc"}]).scores.tolist() == [3.0]
    closed = RewardManager(num_workers=0)
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.score_samples([])


def test_in_process_mode_catches_errors_and_garbage():
    with RewardManager(fixture_spec("behave"), num_workers=0, error_reward=-2.0) as local:
        responses = ["good", "raise", "none", "sys.exit", "good"]
        result = local.score_samples([{"response": r} for r in responses])
    assert result.statuses == ["ok", "error", "garbage", "error", "ok"]
    assert result.scores.tolist() == [1.0, -2.0, -2.0, -2.0, 1.0]


def test_worker_that_cannot_start_raises_instead_of_hanging(tmp_path):
    script = tmp_path / "parent_only.py"
    script.write_text(
        "import multiprocessing\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    raise RuntimeError('cannot be imported in a worker')\n"
        "def score(response):\n"
        "    return 1.0\n"
    )
    manager = RewardManager(f"{script}:score", num_workers=1)
    try:
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match="cannot be imported in a worker"):
            manager.score_samples([{"response": "x"}])
        assert time.perf_counter() - start < 20
    finally:
        manager.close()


def test_empty_input(builtin_pool):
    empty = builtin_pool.score_samples([])
    assert empty.scores.shape == (0,) and empty.metrics["reward/errors"] == 0.0


@pytest.mark.slow
def test_manager_runs_inside_a_ray_actor(ray_session):
    """The trainer may host the reward manager in a Ray actor; its pool must work there."""
    ray = ray_session

    @ray.remote(num_cpus=0)
    class RewardActor:
        def __init__(self, spec: str):
            self.manager = RewardManager(spec, num_workers=1, timeout_s=1.0, error_reward=-1.0)

        def score(self, responses: list[str]) -> tuple[list[float], list[str]]:
            result = self.manager.score_samples([{"response": r} for r in responses])
            return result.scores.tolist(), result.statuses

    actor = RewardActor.remote(fixture_spec("behave"))
    try:
        scores, statuses = ray.get(
            actor.score.remote(["good", "hang", "exit", "good"]), timeout=120
        )
        assert statuses == ["ok", "timeout", "error", "ok"]
        assert scores == [1.0, -1.0, -1.0, 1.0]
    finally:
        ray.kill(actor)


# ------------------------------------------------------------------------- DAPO math, shaping
@pytest.mark.parametrize(
    ("response", "truth", "score"),
    [
        ("Let me think... so the sum is 34.\nAnswer: 34", "34", 1.0),
        ("Answer: $\\dfrac{3}{4}$", "\\frac{3}{4}", 1.0),
        ("Answer: \\boxed{1,000}.", "1000", 1.0),
        ("Answer: 2.50", "2.5", 1.0),
        ("Answer: 90^\\circ", "90", 1.0),
        ("Answer: 12\nAnswer: 13", "13", 1.0),  # the last answer line counts
        ("The total is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),  # no line: last box
        ("Answer: 35", "34", -1.0),
        ("I do not know", "34", -1.0),
        ("Answer: 7", ["6", "7"], 1.0),
    ],
)
def test_math_dapo_scores_the_last_answer_line(response, truth, score):
    out = scorers_module.math_dapo_score(response, truth)
    assert out["score"] == score
    assert out["acc"] == (1.0 if score > 0 else 0.0)
    assert out["answer_found"] == (0.0 if response == "I do not know" else 1.0)
    assert get_scorer("math_dapo") is scorers_module.math_dapo_score


def test_math_dapo_rejects_bad_ground_truth_and_reads_only_the_tail():
    for bad in ("", [], True, None):
        with pytest.raises(ValueError, match="math_dapo"):
            scorers_module.math_dapo_score("Answer: 1", bad)
    # An answer line buried before a long tail is not the final answer.
    assert scorers_module.math_dapo_score("Answer: 5" + " x" * 1000, "5")["score"] == -1.0


def test_overlong_penalty_is_zero_then_linear_to_the_factor():
    from polyrl.reward.shaping import overlong_penalty

    lengths = torch.tensor([0, 12, 13, 14, 16, 20])
    got = overlong_penalty(lengths, max_response_length=16, buffer_length=4, penalty_factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError, match="overlong buffer of 0"):
        overlong_penalty(lengths, 16, 0)
    with pytest.raises(ValueError, match="1..16"):
        overlong_penalty(lengths, 16, 17)
