"""The single-turn loop: one model response per prompt (what the RL trainer samples today)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from polyrl.agent.base import (
    AgentLoop,
    GenerateClient,
    Trajectory,
    register_agent_loop,
)

__all__ = ["SingleTurnAgentLoop"]


@register_agent_loop("single_turn")
class SingleTurnAgentLoop(AgentLoop):
    """Generate once from the sample's prompt; every response token is a model token.

    A sample's ``multi_modal`` (its prompt's images, ``input_ids`` expanded) is kept as the
    trajectory's and sent with the generate call.
    """

    async def run(self, sample: Mapping[str, Any], client: GenerateClient) -> Trajectory:
        """Roll out one sample with a single model turn."""
        prompt_ids, messages, media = self.prompt_of(sample)
        traj = self.start(sample, prompt_ids, messages, "as given", multi_modal=media)
        if traj.finish_reason == "filtered":
            return traj
        await self.generate_turn(traj, client, session_id=sample.get("session_id"))
        return traj
