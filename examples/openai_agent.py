"""An agent written only against the stock ``openai`` client, trained online by polyrl.

Train it (tiny demo model, CPU)::

    polyrl train demo agent.entrypoint=examples/openai_agent.py:agent trainer.total_steps=3

Each episode: the model answers the task, a local Python "tool" measures the answer, its
result goes back as a user message, and the model answers again. The reward is the agent's own
(here: shorter answers score higher, something a tiny random model can learn in a few steps).
Nothing here knows about polyrl: the ``client`` is an ``openai.AsyncOpenAI`` whose base URL and
key point at polyrl's recording proxy, one session per episode.
"""

from __future__ import annotations

from typing import Any

import openai


def count_characters(text: str) -> int:
    """The "tool": any local Python function (a sandbox call, a web request...) would do."""
    return len(text)


def _messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The task's chat prompt (``raw_prompt`` of polyrl's RL dataset), else its text."""
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

