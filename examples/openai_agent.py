"""An agent written only against the stock ``openai`` client, trained online by polyrl.

Train it::

    python examples/openai_agent.py --smoke   # 2 GRPO steps on a nano model (tests use this)
    python examples/openai_agent.py           # 10 steps on a micro model, CPU
    # the same from the command line, on the demo task:
    polyrl train demo agent.entrypoint=examples/openai_agent.py:agent trainer.total_steps=3

Each episode: the model answers the task, a local Python "tool" measures the answer, its
result goes back as a user message, and the model answers again. The reward is the agent's own
(here: shorter answers score higher, something a tiny random model can learn in a few steps).
Nothing here knows about polyrl: the ``client`` is an ``openai.AsyncOpenAI`` whose base URL and
key point at polyrl's recording proxy, one session per episode.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import openai


def count_characters(text: str) -> int:
    """Count characters: the "tool" (any local function, a sandbox, a web call would do)."""
    return len(text)


def _messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """Return the task's chat prompt (``raw_prompt`` of polyrl's RL dataset), else its text."""
    raw = task.get("raw_prompt")
    if raw is not None and len(raw):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in raw]
    return [{"role": "user", "content": str(task.get("prompt", "Say something."))}]


async def agent(client: openai.AsyncOpenAI, task: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Two calls with one tool round-trip between them; returns ``(reward, info)``."""
    messages = _messages(task)
    first = await client.chat.completions.create(model="policy", messages=messages)
    reply = first.choices[0].message.content or ""
    length = count_characters(reply)
    # The usual chat agent: the reply is echoed back and the tool's result appended, so the
    # second prompt extends the first call's prompt and completion (one trajectory).
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": f"That answer has {length} characters. Answer once more."},
    ]
    second = await client.chat.completions.create(model="policy", messages=messages)
    answer = second.choices[0].message.content or ""
    reward = -(length + count_characters(answer)) / 50.0
    return reward, {"characters": length + len(answer)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="2 tiny steps (for the tests)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="", help="output directory (default: a temp dir)")
    parser.add_argument("--set", action="append", default=[], help="config override key=value")
    args = parser.parse_args()
    from polyrl.config import load_config
    from polyrl.trainer.rl import RLTrainer

    out = Path(args.out or tempfile.mkdtemp(prefix="polyrl-example-"))
    config = load_config(
        "demo",
        [
            f"trainer.output_dir={out / 'run'}",
            # The only agent-specific line: this file's agent is the rollout.
            f"agent.entrypoint={Path(__file__).resolve()}:agent",
            f"trainer.total_steps={2 if args.smoke else args.steps}",
            f"model.tiny_size={'nano' if args.smoke else 'micro'}",
            "trainer.device=cpu",
            "trainer.worker_backend=local",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.loggers=[jsonl]",
            "data.train_batch_size=4",
            "rollout.n=4",
            "rollout.max_new_tokens=8",
            "data.max_response_length=64",
            *args.set,
        ],
    )
    RLTrainer(config).fit()
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    for r in (json.loads(x) for x in lines):
        if "agent/calls/mean" in r:
            print(
                f"step {r['step']}: score {r['critic/score/mean']:.3f} "
                f"calls/episode={r['agent/calls/mean']:.1f} failed={r['agent/failed/mean']:.2f}"
            )


if __name__ == "__main__":
    main()
