"""The environment of ``async_agent.py``, as a plugin module (``trainer.imports``).

Imported by the trainer and, with ``async.producer=process``, by the producer process too, so
both roll out the same environment: a tool-using agent's episode of ``TOOL_CALLS`` round-trips.
``reset`` (the task's set-up, e.g. a sandbox starting) and every ``step`` (the tool call the
model's turn makes, e.g. a remote sandbox or web call) wait 0.3-0.5 s without using the CPU
(``asyncio.sleep``); the episode ends with the ``TOOL_CALLS``-th tool result, so the model
takes ``TOOL_CALLS`` short turns and the episode waits ``TOOL_CALLS + 1`` times. Reward
``-len(turn) / 20`` per step (dense: a tiny model moves it).

Each episode reports ``in_flight``: the most episodes of this process it saw running at once
(``env/in_flight/mean`` in the step's metrics), which shows how many episodes the producer
keeps in flight. The demo's rows name no environment: the ``env`` loop's default becomes this
one.
"""

from __future__ import annotations

import asyncio
import random

from polyrl.agent import env_loop
from polyrl.agent.envs import Env, register_env

#: Seconds each tool call (and the set-up) waits, uniformly drawn per call.
SLEEP_S = (0.3, 0.5)
#: Tool round-trips per episode (model turns).
TOOL_CALLS = 6
NAME = "bench_waiting_tool"

_running = 0  # episodes of this process between reset and their end


@register_env(NAME)
class WaitingTool(Env):
    """``TOOL_CALLS`` turns; reset and every step wait 0.3-0.5 s without using the CPU."""

    async def reset(self, seed=None, **kwargs):
        global _running
        self.rng, self.turns, self.ended = random.Random(seed), 0, False
        _running += 1
        self.peak = _running
        await asyncio.sleep(self.rng.uniform(*SLEEP_S))
        return "Call the tool."

    async def step(self, action):
        self.turns += 1
        self.peak = max(self.peak, _running)
        await asyncio.sleep(self.rng.uniform(*SLEEP_S))
        done = self.turns >= TOOL_CALLS
        info = self._end() if done else {}
        return "ok", -len(action) / 20.0, done, info

    def finish(self):
        """The loop cut the episode (length): it stops running too."""
        return 0.0, self._end()

    def _end(self):
        global _running
        if not self.ended:
            self.ended, _running = True, _running - 1
        return {"in_flight": self.peak}


_original_init = env_loop.EnvAgentLoop.__init__


def _init(self, *args, **kwargs):
    _original_init(self, *args, **{**kwargs, "env": NAME})


env_loop.EnvAgentLoop.__init__ = _init
