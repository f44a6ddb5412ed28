"""The environment of ``async_agent.py``, as a plugin module (``trainer.imports``).

Imported by the trainer and, with ``async.producer=process``, by the producer process too, so
both roll out the same environment: two turns whose ``reset`` and ``step`` each wait 0.2-0.5 s
without using the CPU (``asyncio.sleep``, as a remote sandbox or web call does), reward
``-len(turn) / 20`` per step. The demo's rows name no environment: the ``env`` loop's default
becomes this one.
"""

from __future__ import annotations

import asyncio
import random

from polyrl.agent import env_loop
from polyrl.agent.envs import Env, register_env

SLEEP_S = (0.2, 0.5)
NAME = "bench_waiting_tool"


@register_env(NAME)
class WaitingTool(Env):
    """Two turns; reset and every step wait 0.2-0.5 s without using the CPU."""

    async def reset(self, seed=None, **kwargs):
        self.rng, self.turns = random.Random(seed), 0
        await asyncio.sleep(self.rng.uniform(*SLEEP_S))
        return "Say something short."

    async def step(self, action):
        self.turns += 1
        await asyncio.sleep(self.rng.uniform(*SLEEP_S))
        return "The tool answered. Again.", -len(action) / 20.0, self.turns >= 2, {}


_original_init = env_loop.EnvAgentLoop.__init__


def _init(self, *args, **kwargs):
    _original_init(self, *args, **{**kwargs, "env": NAME})


env_loop.EnvAgentLoop.__init__ = _init
