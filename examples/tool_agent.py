"""A multi-turn tool agent: a custom tool, the ``tool`` agent loop, and GRPO over it.

What it shows:

1. Registering a tool with ``@register_tool`` (a ``Tool`` subclass with a JSON-schema
   ``parameters`` and an async ``call``).
2. One trajectory of the ``tool`` loop, token-in/token-out, with a scripted "model" standing in
   for the rollout server (a random tiny model never writes a tool call): the model's tokens
   get mask 1, the tool response appended by the chat template gets mask 0.
3. GRPO training where every sample goes through the tool loop, as in ``polyrl train
   grpo_tool``: ``agent.enable=true``, ``agent.default_loop=tool``, ``agent.tools=[...]``. The
   trainer logs ``num_turns/mean``, ``tool_calls/mean`` and ``tool_errors/mean``.

Run it::

    python examples/tool_agent.py --smoke     # 1 training step on a nano model (tests use this)
    python examples/tool_agent.py             # 20 steps on a micro model, CPU

At full size, with an instruction-tuned model that knows the Hermes tool-call format:
``--model /models/Qwen2.5-1.5B-Instruct --steps 100 --set trainer.device=cuda``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from types import SimpleNamespace

from polyrl import GRPOTrainer
from polyrl.agent import Tool, ToolResult, collate_trajectories, register_tool, run_agent_loops
from polyrl.config import load_config


@register_tool("letter_count")
class LetterCountTool(Tool):
    """Counts one letter in a word; the trainer and the loop look it up by name."""

    description = "Count how often a letter occurs in a word."
    parameters = {
        "type": "object",
        "properties": {"word": {"type": "string"}, "letter": {"type": "string"}},
        "required": ["word", "letter"],
    }

    async def call(self, arguments, **context) -> ToolResult:
        word, letter = str(arguments["word"]), str(arguments["letter"])
        return ToolResult(text=str(word.count(letter)))


def make_rows(num: int) -> list[dict]:
    words = ["banana", "abracadabra", "cocoa", "mississippi", "letter", "balloon"]
    rows = []
    for i in range(num):
        word, letter = words[i % len(words)], "aaosla"[i % 6]
        rows.append(
            {
                "data_source": "letter_count",
                "prompt": [{"role": "user", "content": f"How many '{letter}' in {word}?"}],
                "reward_model": {"ground_truth": str(word.count(letter))},
            }
        )
    return rows


def reward(solution_str, ground_truth):
    """1 when the last word of the final answer is the right count."""
    words = solution_str.strip().split()
    return float(bool(words) and words[-1].strip(".") == ground_truth)


class ScriptedModel:
    """Stands in for a RolloutClient: answers each turn with the next scripted text."""

    def __init__(self, tokenizer, script: list[str]):
        self.tok, self.script = tokenizer, list(script)

    async def generate(self, input_ids, sampling_params=None, *, session_id=None, **_):
        ids = self.tok.encode(self.script.pop(0), add_special_tokens=False)
        ids.append(self.tok.eos_token_id)
        out = SimpleNamespace(
            output_ids=ids, logprobs=[-0.1] * len(ids), finish_reason="stop", weight_version=0
        )
        return SimpleNamespace(outputs=[out])


def show_one_trajectory(model_dir: str) -> None:
    from polyrl.models.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    script = [
        '<tool_call>{"name": "letter_count", '
        '"arguments": {"word": "banana", "letter": "a"}}</tool_call>',
        "The answer is 3.",
    ]
    rows = make_rows(1)
    trajs = asyncio.run(
        run_agent_loops(
            rows,
            ScriptedModel(tok, script),
            tok,
            default_agent="tool",
            loop_kwargs={"tool": {"tools": ["letter_count"], "max_turns": 4}},
        )
    )
    t = trajs[0]
    print(f"turns={t.num_turns} tool_calls={t.tool_calls} tool_errors={t.tool_errors}")
    print(
        "model tokens:", sum(t.response_mask), "| tool/template tokens:", t.response_mask.count(0)
    )
    print("conversation:", [m["role"] for m in t.messages], "->", t.messages[-2]["content"])
    batch = collate_trajectories(trajs, tok.pad_token_id)
    print("collated:", sorted(batch.tensor_keys), "loss_mask sum", float(batch["loss_mask"].sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1 tiny step (for the tests)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="", help="HF model directory (default: a tiny one)")
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="polyrl-example-"))
    model = args.model
    if not model:
        from polyrl.models.tiny import build_tiny_model

        size = "nano" if args.smoke else "micro"
        model = str(build_tiny_model("qwen2", out / f"tiny-{size}", size=size))

    show_one_trajectory(model)

    steps = 1 if args.smoke else args.steps
    config = load_config(
        "grpo_tool",
        [
            f"trainer.output_dir={out / 'run'}",
            f"trainer.total_steps={steps}",
            "trainer.device=cpu",
            "trainer.worker_backend=local",
            "trainer.test_freq=0",
            "agent.tools=[letter_count,calculator]",
            "agent.max_turns=2" if args.smoke else "agent.max_turns=4",
            "data.train_batch_size=4",
            "data.max_response_length=48" if args.smoke else "data.max_response_length=256",
            "rollout.n=2" if args.smoke else "rollout.n=8",
            "rollout.max_new_tokens=16" if args.smoke else "rollout.max_new_tokens=128",
            *args.set,
        ],
    )
    trainer = GRPOTrainer(model=model, config=config, reward_fn=reward, train_dataset=make_rows(24))
    summary = trainer.train()
    print({k: summary.get(k) for k in ("steps", "last_score", "metrics")})


if __name__ == "__main__":
    main()
