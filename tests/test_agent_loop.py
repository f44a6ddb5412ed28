"""Agent loops against a real rollout server: no drift, tool failures, environments, collation."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import torch

from polyrl.agent import (
    ChatTemplateError,
    Tool,
    ToolParser,
    Trajectory,
    agent_name_of,
    chat_delta_ids,
    collate_trajectories,
    create_agent_loop,
    register_tool_parser,
    run_agent_loops,
)
from polyrl.agent.base import prompt_ids_of
from polyrl.agent.tool_loop import HermesToolParser, ParsedToolCall
from polyrl.core.prompts import PromptTooLongError
from polyrl.core.rollout_batch import build_rollout_batch
from polyrl.data.dataset import RLDataset
from polyrl.rollout.client import GenerateResult, RolloutClient

# A third of the vocabulary ends a turn: the random tiny model then writes short turns that end
# with finish_reason "stop" (as a trained model ending on eos would), so loops go on.
STOP_IDS = list(range(20, 1024, 3))


@pytest.fixture(scope="module")
def server(agent_server):
    return agent_server


@pytest.fixture(scope="module")
def tok(tiny_qwen2_tokenizer):
    return tiny_qwen2_tokenizer


class RecordingClient:
    """The real client; remembers every request's input ids and the server's answer."""

    def __init__(self, client: RolloutClient):
        self.client = client
        self.calls: list[tuple[list[int], GenerateResult]] = []

    async def generate(self, input_ids, sampling_params=None, *, session_id=None, request_id=None):
        result = await self.client.generate(input_ids, sampling_params, session_id=session_id)
        self.calls.append((list(input_ids), result))
        return result


class ScriptedClient(RecordingClient):
    """Sends every turn to the real server (so each token-in prompt is served), then answers
    with the next scripted text instead of the random model's tokens (a random model never
    writes a tool call)."""

    def __init__(self, client: RolloutClient, tok, script: list[str]):
        super().__init__(client)
        self.tok = tok
        self.script = list(script)

    async def generate(self, input_ids, sampling_params=None, *, session_id=None, request_id=None):
        params = {**dict(sampling_params or {}), "max_new_tokens": 1}
        result = await self.client.generate(input_ids, params, session_id=session_id)
        ids = self.tok.encode(self.script.pop(0), add_special_tokens=False)
        ids.append(self.tok.eos_token_id)
        out = result.outputs[0]
        out.output_ids, out.logprobs, out.finish_reason = ids, [-0.5] * len(ids), "stop"
        self.calls.append((list(input_ids), result))
        return result


def run(coro_fn):
    """Run ``coro_fn(client)`` with a started real client."""

    async def main(url):
        async with RolloutClient([url], health_interval=0) as client:
            return await coro_fn(client)

    return main


def assert_no_drift(traj: Trajectory, calls) -> None:
    """Every model token is exactly what the server returned, at the place it was generated,
    and the mask marks exactly those tokens."""
    traj.validate()
    assert len(calls) == traj.num_turns
    model_positions = set()
    for input_ids, result in calls:
        out = result.outputs[0]
        start = len(input_ids) - len(traj.prompt_ids)
        assert input_ids[: len(traj.prompt_ids)] == traj.prompt_ids
        # token-in: the request was exactly the trajectory so far
        assert input_ids[len(traj.prompt_ids) :] == traj.response_ids[:start]
        end = start + len(out.output_ids)
        assert traj.response_ids[start:end] == list(out.output_ids)
        assert traj.rollout_log_probs[start:end] == pytest.approx(out.logprobs)
        model_positions.update(range(start, end))
    mask_positions = {i for i, m in enumerate(traj.response_mask) if m == 1}
    assert mask_positions == model_positions
    for i, m in enumerate(traj.response_mask):
        if m == 0:
            assert traj.rollout_log_probs[i] == 0.0


@register_tool_parser("test_always_calc")
class AlwaysCalc(ToolParser):
    """Reads every model turn as a calculator call, so the random model drives the loop."""

    def parse(self, text: str) -> list[ParsedToolCall]:
        return [ParsedToolCall("calculator", {"expression": "6*7"})]


def test_tool_loop_no_drift_real_server(server, tok):
    loop = create_agent_loop(
        "tool",
        tok,
        parser="test_always_calc",
        max_turns=3,
        sampling_params={"max_new_tokens": 24, "seed": 11, "stop_token_ids": STOP_IDS},
    )
    sample = {"raw_prompt": [{"role": "user", "content": "What is 6 * 7?"}]}

    async def go(client):
        rec = RecordingClient(client)
        return await loop.run(sample, rec), rec.calls

    traj, calls = asyncio.run(run(go)(server.url))
    assert traj.finish_reason == "max_turns", traj.finish_reason
    assert traj.num_turns == 3 and traj.tool_calls == 2 and traj.tool_errors == 0
    assert_no_drift(traj, calls)
    # the tool/template tokens between model turns carry the tool's answer
    env_text = tok.decode(
        [t for t, m in zip(traj.response_ids, traj.response_mask, strict=True) if m == 0]
    )
    assert env_text.count("<tool_response>42</tool_response>") == 2
    assert env_text.count("<|im_start|>assistant\n") == 2
    model_ids = [t for _, r in calls for t in r.outputs[0].output_ids]
    assert traj.response_text(tok, model_only=True) == tok.decode(
        model_ids, skip_special_tokens=True
    )
    batch = collate_trajectories([traj], tok.pad_token_id)
    width_p = len(traj.prompt_ids)
    assert batch.tensors["loss_mask"][0, width_p:].tolist() == [
        float(m) for m in traj.response_mask
    ]
    assert batch.meta["agent_metrics"]["num_turns/mean"] == 3.0


def test_tool_loop_failures_become_messages(server, tok):
    class Slow(Tool):
        name = "slow"

        async def call(self, arguments, **context):
            await asyncio.sleep(30)
            return "never"

    class Crash(Tool):
        name = "crash"

        async def call(self, arguments, **context):
            raise RuntimeError("disk on fire")

    class Big(Tool):
        name = "big"

        async def call(self, arguments, **context):
            return "word " * 2000

    loop = create_agent_loop(
        "tool",
        tok,
        tools=["calculator", Slow(), Crash(), Big()],
        max_turns=5,
        max_parallel_calls=5,
        tool_timeout=0.5,
        max_tool_response_tokens=16,
        sampling_params={"max_new_tokens": 64},
    )
    first = (
        '<tool_call>{"name": "slow", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "crash", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": oops}</tool_call>'
        '<tool_call>{"name": "big", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2**10"}}</tool_call>'
    )
    second = (
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
        + '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>' * 4
        + "<tool_call>{unclosed"
    )
    sample = {"raw_prompt": [{"role": "user", "content": "Compute 2 to the 10th."}]}

    async def go(client):
        scripted = ScriptedClient(client, tok, [first, second, "The answer is 1024."])
        t0 = time.monotonic()
        traj = await loop.run(sample, scripted)
        return traj, scripted.calls, time.monotonic() - t0

    traj, calls, elapsed = asyncio.run(run(go)(server.url))
    assert traj.finish_reason == "stop" and traj.num_turns == 3
    tool_msgs = [m["content"] for m in traj.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 5 + 7
    slow, crash, bad, big, calc = tool_msgs[:5]
    assert "timed out after 0.5 s" in slow
    assert "RuntimeError: disk on fire" in crash
    assert "malformed tool call" in bad and "not valid JSON" in bad
    assert "[truncated: the response had" in big and big.count("word") <= 16
    assert calc == "1024"
    nope, zero, *ones, unclosed = tool_msgs[5:]
    assert "unknown tool 'nope'" in nope and "calculator" in nope
    assert "division by zero" in zero
    assert ones[:3] == ["2", "2", "2"] and "at most 5 tool calls" in ones[3]
    assert "skipped" in unclosed
    assert traj.tool_calls == 12
    assert traj.tool_errors == 3 + 4  # slow, crash, bad; nope, 1/0 and the two skipped
    assert elapsed < 20, "the slow call (30 s) must time out at 0.5 s"
    assert_no_drift(traj, calls)
    # token-in/token-out deltas rebuild exactly the chat template's rendering
    schemas = [t.schema() for t in loop.tools.values()]
    rendered = tok.apply_chat_template(traj.messages, tools=schemas, tokenize=False)
    assert tok.decode(traj.prompt_ids + traj.response_ids) == rendered.rstrip("\n")


def test_tool_loop_length_budget_and_countdown_tool(server, tok):
    loop = create_agent_loop(
        "tool",
        tok,
        tools=["countdown_check"],
        max_turns=4,
        max_response_length=60,
        sampling_params={"max_new_tokens": 32},
    )
    call = '<tool_call>{"name": "countdown_check", "arguments": {"expression": "(3+5)*2"}}'
    sample = {
        "raw_prompt": [{"role": "user", "content": "Make 16 from 3 5 2."}],
        "extra_info": {"tools_kwargs": {"countdown_check": {"target": 16, "numbers": [2, 3, 5]}}},
    }

    async def go(client):
        scripted = ScriptedClient(client, tok, [call + "</tool_call>"] * 4)
        return await loop.run(sample, scripted)

    traj = asyncio.run(run(go)(server.url))
    assert traj.messages[2] == {"role": "tool", "content": "(3+5)*2 = 16: correct"}
    assert traj.finish_reason == "length"
    assert len(traj.response_ids) <= 60


def test_env_loop_real_server_and_scripted_win(server, tok):
    loop = create_agent_loop(
        "env",
        tok,
        env="guess_number",
        max_turns=3,
        sampling_params={"max_new_tokens": 16, "seed": 5, "stop_token_ids": STOP_IDS},
    )
    sample = {"extra_info": {"env_kwargs": {"secret": 37}, "seed": 0}}

    async def real(client):
        rec = RecordingClient(client)
        return await loop.run(sample, rec), rec.calls

    traj, calls = asyncio.run(run(real)(server.url))
    assert_no_drift(traj, calls)
    assert traj.num_turns == len(traj.turn_rewards) >= 2
    assert traj.reward == sum(traj.turn_rewards)
    assert "guesses left" in tok.decode(traj.response_ids)

    async def win(client):
        return await loop.run(sample, ScriptedClient(client, tok, ["50", "25", "37"]))

    won = asyncio.run(run(win)(server.url))
    assert [m["content"] for m in won.messages if m["role"] == "user"][1:] == [
        "Lower. 6 guesses left.",
        "Higher. 5 guesses left.",
    ]
    assert won.turn_rewards == [0.0, 0.0, 1.0] and won.reward == 1.0
    assert won.finish_reason == "done" and won.metrics["env/solved"] == 1.0


def test_run_agent_loops_selects_by_agent_name(server, tok):
    samples = [
        {"raw_prompt": [{"role": "user", "content": "hi"}], "input_ids": torch.tensor([3, 9, 4])},
        {"extra_info": {"agent_name": "env", "env_kwargs": {"secret": 3}}},
        {"raw_prompt": [{"role": "user", "content": "yo"}], "extra_info": {"agent_name": "tool"}},
    ]
    params = {"max_new_tokens": 8, "seed": 1, "stop_token_ids": STOP_IDS}
    kwargs = {name: {"sampling_params": params, "max_turns": 2} for name in ("env", "tool")} | {
        "single_turn": {"sampling_params": params}
    }

    async def go(client):
        return await run_agent_loops(samples, client, tok, loop_kwargs=kwargs)

    trajs = asyncio.run(run(go)(server.url))
    assert [t.agent_name for t in trajs] == ["single_turn", "env", "tool"]
    assert trajs[0].prompt_ids == [3, 9, 4]  # the dataset's tokenized prompt is used as is
    assert trajs[0].num_turns == 1 and all(m == 1 for m in trajs[0].response_mask)
    assert agent_name_of({"extra_info": {"agent_name": "tol"}}) == "tol"
    with pytest.raises(KeyError, match="did you mean 'tool'"):
        create_agent_loop("tol", tok)


def test_sample_seed_makes_copies_reproducible_and_distinct(server, tok):
    prompt = [{"role": "user", "content": "Tell me a story."}]
    samples = [{"raw_prompt": prompt, "seed": s} for s in (1, 1, 2)]
    kwargs = {"single_turn": {"sampling_params": {"max_new_tokens": 8, "seed": 99}}}

    async def go(client):
        return await run_agent_loops(samples, client, tok, loop_kwargs=kwargs)

    a, b, c = asyncio.run(run(go)(server.url))
    assert a.response_ids == b.response_ids != c.response_ids


# ------------------------------------------------- the prompt-length rule on the prompt sent
ROW = {
    "data_source": "arithmetic",
    "prompt": [{"role": "user", "content": "What is 6 * 7?"}],
    "reward_model": {"ground_truth": "42"},
}


def tool_prompt(tok) -> tuple[dict, list[int], int]:
    """A dataset item whose prompt fits ``limit`` until the tool loop adds its schemas, the
    prompt the tool loop renders, and that limit."""
    bare = RLDataset([ROW], tok, max_prompt_length=4096)[0]
    schemas = [t.schema() for t in create_agent_loop("tool", tok).tools.values()]
    rendered, _ = prompt_ids_of(bare, tok, tools=schemas, render=True)
    limit = (len(bare["input_ids"]) + len(rendered)) // 2
    assert len(bare["input_ids"]) <= limit < len(rendered)
    # The dataset applies the rule to its own prompt and keeps the row.
    sample = RLDataset([ROW], tok, max_prompt_length=limit, truncation="error")[0]
    return sample, rendered, limit


def test_loops_apply_the_dataset_prompt_rule_to_what_they_send(tok):
    sample, rendered, limit = tool_prompt(tok)

    def tool(truncation):
        return create_agent_loop("tool", tok, max_prompt_length=limit, truncation=truncation)

    where = rf"sample {sample['uid']!r} \(data_source='arithmetic'\), prompt rendered with 1 tool"
    too_long = rf"prompt is {len(rendered)} tokens, longer than max_prompt_length={limit}"
    with pytest.raises(PromptTooLongError, match=rf"{where} schema\(s\): {too_long}"):
        asyncio.run(tool("error").run(sample, None))  # refused before any request
    filtered = asyncio.run(tool("filter").run(sample, None))
    assert filtered.finish_reason == "filtered" and filtered.num_turns == 0
    assert filtered.response_ids == [] and filtered.metrics == {"prompt_filtered": 1.0}
    assert filtered.prompt_ids == rendered[-limit:]
    batch = collate_trajectories([filtered], tok.pad_token_id)
    assert batch["prompt_length"].tolist() == [limit] and float(batch["loss_mask"].sum()) == 0.0
    # The environment loop adds its first observation to the prompt the dataset measured.
    fits = len(sample["input_ids"])
    env = create_agent_loop("env", tok, max_prompt_length=fits, truncation="error")
    with pytest.raises(PromptTooLongError, match=r"prompt with the first observation: prompt is"):
        asyncio.run(env.run(sample, None))


def test_tool_loop_sends_the_prompt_cut_by_the_rule(server, tok):
    sample, rendered, limit = tool_prompt(tok)
    loop = create_agent_loop("tool", tok, max_prompt_length=limit, truncation="left")

    async def go(client):
        scripted = ScriptedClient(client, tok, ["no tool needed"])
        return await loop.run(sample, scripted), scripted.calls

    traj, calls = asyncio.run(run(go)(server.url))
    assert calls[0][0] == traj.prompt_ids == rendered[-limit:]
    assert traj.finish_reason == "stop" and traj.metrics["prompt_truncated"] == 1.0


def test_plain_text_prompts_are_never_templated_by_a_loop(tok):
    row = {"prompt": "2+2=", "answer": "4"}
    ds = RLDataset([row], tok, 64, require_reward_fields=False, template_string_prompts=False)
    sample = ds[0]
    ids, messages = prompt_ids_of(sample, tok)  # the single-turn loop's prompt
    assert ids == tok.encode("2+2=", add_special_tokens=False)
    assert messages == [{"role": "user", "content": "2+2="}]
    for name in ("tool", "env"):
        with pytest.raises(ValueError, match=r"plain text, tokenized without the chat template"):
            asyncio.run(create_agent_loop(name, tok).run(sample, None))


def test_collate_matches_trainer_layout(tok):
    a = Trajectory(prompt_ids=[5, 6, 7])
    a.append_model([11, 12], [-0.1, -0.2])
    a.append_env([13, 14, 15])
    a.append_model([16], [-0.3])
    b = Trajectory(prompt_ids=[8])
    b.append_model([21, 22, 23], [-1.0, -2.0, -3.0])
    batch = collate_trajectories([a, b], pad_token_id=0)
    ref = build_rollout_batch(
        [a.prompt_ids, b.prompt_ids],
        [a.response_ids, b.response_ids],
        0,
        [a.rollout_log_probs, b.rollout_log_probs],
    )
    for key in (
        "input_ids",
        "attention_mask",
        "position_ids",
        "prompt_length",
        "rollout_log_probs",
    ):
        assert torch.equal(batch.tensors[key], ref.tensors[key]), key
    expected = ref.tensors["loss_mask"].clone()
    expected[0, 3 + 2 : 3 + 5] = 0.0  # the env tokens of trajectory a
    assert torch.equal(batch.tensors["loss_mask"], expected)
    assert batch.non_tensors["num_turns"].tolist() == [0, 0]
    with pytest.raises(ValueError, match="at least one"):
        collate_trajectories([], 0)


def test_template_that_rewrites_history_is_rejected(tok):
    class Rewriting:
        """Puts the message count in the system turn, so earlier text changes every turn."""

        eos_token = tok.eos_token

        def apply_chat_template(self, messages, **kw: Any):
            head = {"role": "system", "content": f"{len(messages)} messages"}
            return tok.apply_chat_template([head, *messages], **kw)

        def encode(self, text, add_special_tokens=False):
            return tok.encode(text, add_special_tokens=add_special_tokens)

    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "tool", "content": "c"},
    ]
    with pytest.raises(ChatTemplateError, match="not prefix-preserving"):
        chat_delta_ids(Rewriting(), msgs, 1)
    delta = tok.decode(chat_delta_ids(tok, msgs, 1))
    assert delta == "\n<|im_start|>tool\n<tool_response>c</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    cut = tok.decode(chat_delta_ids(tok, msgs, 1, last_ended_with_eos=False))
    assert cut == "<|im_end|>" + delta


def test_hermes_parser_cases():
    p = HermesToolParser()
    calls = p.parse(
        'hi <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call><tool_call>[1]</tool_call>'
        '<tool_call>{"name": "c", "arguments": 5}</tool_call>'
    )
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("a", {"x": 1}, True),
        ("b", {"y": 2}, True),
        (None, {}, False),
        (None, {}, False),
        ("c", {}, False),
    ]
    assert p.parse("no calls here") == []


# ------------------------------------------- data.apply_chat_template_kwargs in every loop
NO_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def thinking_tok(tiny_qwen2_dir):
    """The tiny tokenizer with a Qwen3-like generation prompt: ``enable_thinking=False`` closes
    an empty think block (the tiny template itself reads no extra arguments)."""
    from polyrl.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_qwen2_dir)
    gen = r"{{- '<|im_start|>assistant\n' -}}"
    no_think = r"{%- if enable_thinking is defined and not enable_thinking -%}"
    no_think += r"{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    head, found, tail = tok.chat_template.rpartition(gen)  # the last one: the generation prompt
    assert found and head.rstrip().endswith("{%- if add_generation_prompt -%}")
    tok.chat_template = head + gen + no_think + tail
    return tok


def test_template_kwargs_reach_the_dataset_every_loop_and_the_proxy(server, thinking_tok):
    from polyrl.agent.proxy import RecordingProxy

    tok, kw = thinking_tok, {"enable_thinking": False}

    def rendered(messages, tools=None, **extra):
        text = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **extra
        )
        return tok.encode(text, add_special_tokens=False)

    # The dataset: the argument changes the prompt, as apply_chat_template(**kw) renders it.
    row = {**ROW, "extra_info": {"env_kwargs": {"secret": 37}}}
    plain = RLDataset([row], tok, 4096)[0]
    sample = RLDataset([row], tok, 4096, apply_chat_template_kwargs=kw)[0]
    assert sample["input_ids"].tolist() == rendered(ROW["prompt"], **kw)
    assert sample["input_ids"].tolist() != plain["input_ids"].tolist()
    assert plain["input_ids"].tolist() == rendered(ROW["prompt"])

    tool = create_agent_loop("tool", tok, apply_chat_template_kwargs=kw)
    env = create_agent_loop("env", tok, env="guess_number", apply_chat_template_kwargs=kw)
    schemas = [t.schema() for t in tool.tools.values()]
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'

    async def go(client):
        scripted_tool = ScriptedClient(client, tok, [call, "42"])
        scripted_env = ScriptedClient(client, tok, ["50", "37"])
        await tool.run(sample, scripted_tool)
        env_traj = await env.run(sample, scripted_env)
        rec = RecordingClient(client)
        proxy = RecordingProxy(rec, tok, apply_chat_template_kwargs=kw)
        first, sid = await proxy.chat({"messages": ROW["prompt"], "max_tokens": 2}, None)
        again = [*ROW["prompt"], first["choices"][0]["message"], {"role": "user", "content": "?"}]
        await proxy.chat({"messages": again, "max_tokens": 2}, sid)
        return scripted_tool.calls, scripted_env.calls, env_traj, rec.calls

    tool_calls, env_calls, env_traj, proxy_calls = asyncio.run(run(go)(server.url))
    # Each sends the prompt the dataset would render with its additions (schemas, observation)
    # ...
    assert (
        tool_calls[0][0]
        == rendered(ROW["prompt"], schemas, **kw)
        != rendered(ROW["prompt"], schemas)
    )
    env_prompt = env_traj.messages[:2]  # the row's prompt and the first observation
    assert env_calls[0][0] == rendered(env_prompt, **kw) != rendered(env_prompt)
    assert proxy_calls[0][0] == rendered(ROW["prompt"], **kw)
    # ... and every later turn's delta ends with the same generation prompt.
    for later in (tool_calls[1][0], env_calls[1][0], proxy_calls[1][0]):
        assert tok.decode(later).endswith(NO_THINK)
    assert tool.prompt_ids_of(sample, tools=schemas, render=True)[0] == tool_calls[0][0]
    with pytest.raises(ValueError, match=r"may not set \['tools'\]"):
        create_agent_loop("single_turn", tok, apply_chat_template_kwargs={"tools": []})
