"""The environment loop: a Gym-style environment answers each model turn.

The environment's first observation is appended to the sample's prompt messages as a user turn
(part of the prompt); then each model turn is passed to ``env.step`` and, unless the episode is
done, the next observation is appended as a user message through the chat template's token delta
(mask 0). Per-step rewards go to ``turn_rewards``; the final reward is their sum. An
environment with a ``finish() -> (reward, info)`` method is asked for it when the loop ends an
episode the environment did not end (turn or length limit); that reward is added to the last
turn's.

An observation is a string or chat content parts (``{"type": "text", "text": ...}``,
``{"type": "image", "image": <PIL image, PNG bytes, base64, data: URL...>}``); images need the
loop's ``processor`` and join the trajectory's ``multi_modal`` in token order, so every later
turn is sent the media of its whole context.

A sample names its environment with ``extra_info["env_name"]`` (else the loop's default), its
reset arguments with ``extra_info["env_kwargs"]`` and its seed with ``extra_info["seed"]``.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Mapping
from typing import Any

from polyrl.agent.base import (
    AgentLoop,
    GenerateClient,
    Trajectory,
    register_agent_loop,
    require_chat_prompt,
    split_messages_media,
)
from polyrl.agent.envs import create_env
from polyrl.core.rollout_api import SamplingParams

__all__ = ["EnvAgentLoop"]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _content(obs: Any) -> Any:
    """Return an observation as message content: parts stay parts, anything else is text."""
    return list(obs) if isinstance(obs, list | tuple) else str(obs)


@register_agent_loop("env")
class EnvAgentLoop(AgentLoop):
    """Multi-turn interaction with a registered environment (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer.
        env: default environment name.
        env_kwargs: default reset kwargs (a sample's ``env_kwargs`` override them).
        max_turns: most model turns.
        max_response_length: budget of response tokens in all.
        sampling_params: per-turn sampling.
        max_prompt_length: ``data.max_prompt_length`` (see :meth:`AgentLoop.start`).
        truncation: ``data.truncation`` (see :meth:`AgentLoop.start`).
        apply_chat_template_kwargs: ``data.apply_chat_template_kwargs`` (see
            :class:`AgentLoop`).
        processor: the policy's vision processor, for image observations (see
            :class:`AgentLoop`).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        env: str = "guess_number",
        env_kwargs: Mapping[str, Any] | None = None,
        max_turns: int = 8,
        max_response_length: int = 1024,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        max_prompt_length: int | None = None,
        truncation: str = "error",
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        processor: Any = None,
    ):
        super().__init__(
            tokenizer,
            sampling_params=sampling_params,
            max_response_length=max_response_length,
            max_turns=max_turns,
            max_prompt_length=max_prompt_length,
            truncation=truncation,
            apply_chat_template_kwargs=apply_chat_template_kwargs,
            processor=processor,
        )
        self.env_name = env
        self.env_kwargs = dict(env_kwargs or {})

    async def run(self, sample: Mapping[str, Any], client: GenerateClient) -> Trajectory:
        """Play one episode."""
        extra = sample.get("extra_info") or {}
        env_name = str(extra.get("env_name", self.env_name))
        env = create_env(env_name)
        kwargs = {**self.env_kwargs, **dict(extra.get("env_kwargs") or {})}
        obs = await _maybe_await(env.reset(seed=extra.get("seed"), **kwargs))
        require_chat_prompt(sample, "adding the observations as user turns")
        added = [{"role": "user", "content": _content(obs)}] if obs else []
        if not added and not sample.get("raw_prompt", sample.get("prompt")):
            raise ValueError("the environment gave no observation and the sample has no prompt")
        prompt_ids, messages, media = self.prompt_of(
            sample, render=True, added=added, what=f"environment {env_name!r} first observation"
        )
        # The dataset measured the prompt without the observation: fit the one sent.
        traj = self.start(
            sample, prompt_ids, messages, "with the first observation", multi_modal=media
        )
        if traj.finish_reason == "filtered":
            traj.reward = 0.0  # no episode was played
            return traj
        session = str(sample.get("session_id") or f"env-{uuid.uuid4().hex}")
        info: Mapping[str, Any] = {}
        while True:
            ids, action = await self.generate_turn(traj, client, session)
            obs, reward, done, info = await _maybe_await(env.step(action))
            traj.turn_rewards.append(float(reward))
            if done:
                traj.finish_reason = "done"
                break
            if traj.finish_reason in ("length", "abort"):
                break
            if len(traj.response_ids) >= self.max_response_length:
                traj.finish_reason = "length"
                break
            if traj.num_turns >= self.max_turns:
                traj.finish_reason = "max_turns"
                break
            what = f"environment {env_name!r} observation {traj.num_turns}"
            obs_message = {"role": "user", "content": _content(obs)}
            (message,), items = split_messages_media([obs_message], what, join_text=True)
            self.check_media(items, what)  # a missing processor fails on every episode alike
            traj.messages.append(message)
            delta = self.chat_delta_ids(
                traj.messages, 1, last_ended_with_eos=self.ended_with_eos(ids)
            )
            if len(traj.response_ids) + len(delta) >= self.max_response_length:
                traj.finish_reason = "length"
                break
            # Images are processed only once the text delta fits (no pixel work for a turn
            # that is never sent); their full runs make the delta longer: check again.
            delta, media = self.encode_media(delta, items, what)
            if len(traj.response_ids) + len(delta) >= self.max_response_length:
                traj.finish_reason = "length"
                break
            traj.append_env(delta, media)
        finish = getattr(env, "finish", None)
        if traj.finish_reason != "done" and callable(finish):
            # The loop ended the episode (turns, length): an environment that rewards only at
            # the end (e.g. swe's tests) scores it now; the reward belongs to the last turn.
            reward, info = await _maybe_await(finish())
            traj.turn_rewards[-1] += float(reward)
        traj.reward = float(sum(traj.turn_rewards))
        for key, value in dict(info or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                traj.metrics[f"env/{key}"] = float(value)
        return traj
