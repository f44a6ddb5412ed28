"""Online training of agents written against the stock ``openai`` client (loop ``openai_agent``).

A user's agent is an ``async def agent(client: openai.AsyncOpenAI, task: dict)`` returning its
reward (a number), ``(reward, info)`` or ``{"reward": ..., **info}``; ``info``'s numbers are
logged as ``agent_info/<name>``. ``polyrl train grpo agent.entrypoint=module:function`` makes it
the rollout: each of a task's ``rollout.n`` episodes is one call of the function with a client
of its own.

How an episode is recorded:

* The loop serves a :class:`~polyrl.agent.proxy.RecordingProxy` on ``127.0.0.1`` (one per
  process and tokenizer, in a thread of its own, behind a random API key) and gives each
  episode a fresh session: the episode's client sends the key and an ``X-Session-Id`` header,
  so every call lands in that session and nowhere else.
* The proxy forwards each call token-in/token-out through the trainer's own rollout client
  (on the trainer's event loop, so weight versions, pauses and failover are the trainer's) and
  records the server's token ids and log-probs as they came back.
* The sampling that training assumes wins over the agent's: ``temperature``, ``top_p``,
  ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids`` and the seed are the run's;
  the agent's ``max_tokens`` only lowers the per-call cap (``rollout.max_new_tokens``), which
  is also held to the episode's remaining ``data.max_response_length`` budget.

Which calls become what (the choice, and why): when every call's prompt extends the previous
call's prompt and completion (the usual chat agent that appends the reply and a tool/user
message), the proxy keeps one segment and the episode is one trajectory: the first call's
prompt, then model tokens (mask 1) interleaved with the chat template's tokens for the new
messages (mask 0). An episode whose calls do not extend one another (it rewrote or summarised
its history, or ran two conversations) makes several segments, each a maximal chain of calls
that extend one another (a call continues the latest segment it extends, else starts one).
With ``non_extending="split"`` (``agent.non_extending``, the default) each segment is a
*linked sample*: its own row, laid out as above with its first call's prompt as the prompt,
carrying the episode's reward, and linked to the others by the episode
(:data:`~polyrl.core.columns.EPISODE`). Every trained token is still exactly what the server
generated, in the context it was generated in. The advantage is the episode's: the group
baseline is taken over the ``n`` episodes, each counted once however many samples it split
into, and every linked sample gets its episode's advantage
(:func:`polyrl.trainer.rl.advantage.episode_advantages`), so a summarising agent's episode
weighs as much in its group as a plain one. ``"refuse"`` instead counts the episode
(``agent/non_extending``) and trains on it as a failure (below).

Failures are never trained on: an agent that raises, exceeds ``agent.timeout_s``, makes no
call, does not extend its calls, returns no finite reward or sends a first prompt longer than
``data.max_prompt_length`` yields a row with an empty response (no token is in the loss) and
reward 0.0, counted in ``agent/failed`` and one of ``agent/error``, ``agent/timed_out``,
``agent/no_calls``, ``agent/non_extending``, ``agent/bad_reward``, ``agent/prompt_too_long``
(per-batch means). The 0.0 still counts in its group's baseline, as a failing reward function
would.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import secrets
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from polyrl.agent.base import (
    AgentLoop,
    GenerateClient,
    Trajectory,
    prompt_ids_of,
    register_agent_loop,
)

__all__ = ["OpenAIAgentLoop", "ProxyHost", "load_entrypoint", "proxy_host"]

#: Sampling fields the run decides (training assumes them), whatever the agent sends.
_FORCED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids")
#: Why an episode failed -> the metric that counts it.
_FAILURES = ("error", "timed_out", "no_calls", "non_extending", "bad_reward", "prompt_too_long")


def load_entrypoint(spec: str) -> Callable[..., Any]:
    """Return the function named by ``module:function`` or ``path/to/file.py:function``.

    Raises:
        ValueError: the spec is malformed, or names something that is not an async function.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"agent.entrypoint must be 'module:function', got {spec!r}")
    if module_name.endswith(".py"):
        path = Path(module_name).resolve()
        name = f"_polyrl_agent_{abs(hash(str(path)))}"
        module = sys.modules.get(name)
        if module is None:
            loader = importlib.util.spec_from_file_location(name, path)
            if loader is None or loader.loader is None:
                raise ValueError(f"agent.entrypoint: cannot load {path}")
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module
            loader.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"agent.entrypoint: {module_name!r} has no attribute {attr!r}")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"agent.entrypoint {spec!r} must be an async function "
            "(async def agent(client: openai.AsyncOpenAI, task: dict) -> float)"
        )
    return fn


@dataclasses.dataclass
class _Route:
    """Where a session's calls go: the trainer's client on the trainer's loop, and its rules."""

    client: GenerateClient
    loop: asyncio.AbstractEventLoop
    forced: dict[str, Any]
    max_response_length: int
    seed: int | None
    prompt_length: int | None = None
    calls: int = 0


class _Bridge:
    """The proxy's rollout client: sends each call to its session's route, on that route's loop.

    The proxy runs on its own event loop (its thread); the trainer's client belongs to the
    trainer's loop, so each call is handed over with ``run_coroutine_threadsafe``.
    """

    def __init__(self) -> None:
        self.routes: dict[str, _Route] = {}

    async def start(self) -> None:
        """Nothing to start: the routes' clients are the trainer's."""

    async def close(self) -> None:
        """Nothing to close (see :meth:`start`)."""

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: Mapping[str, Any] | None = None,
        *,
        session_id: str | None = None,
        **extra: Any,
    ) -> Any:
        """Forward one call of a routed session, with the run's sampling rules applied."""
        from polyrl.core.rollout_api import InvalidRequestError

        route = self.routes.get(session_id or "")
        if route is None:
            raise InvalidRequestError("unknown or finished agent session", param="user")
        if route.prompt_length is None:
            route.prompt_length = len(input_ids)
        room = route.max_response_length - (len(input_ids) - route.prompt_length)
        if room < 1:
            raise InvalidRequestError(
                f"the episode used its whole data.max_response_length="
                f"{route.max_response_length} tokens",
                param="max_tokens",
            )
        params = dict(sampling_params or {})
        asked = params.get("max_new_tokens")
        cap = route.forced.get("max_new_tokens")
        params.update({k: v for k, v in route.forced.items() if k != "max_new_tokens"})
        params["max_new_tokens"] = min(x for x in (asked, cap, room) if x is not None)
        params["logprobs"] = True
        if route.seed is not None:
            # Each call of each copy samples differently, and reproducibly.
            params["seed"] = route.seed + route.calls
        route.calls += 1
        coro = route.client.generate(input_ids, params, session_id=session_id, **extra)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, route.loop))


class ProxyHost:
    """A recording proxy served on 127.0.0.1 from a daemon thread, for in-process episodes.

    Args:
        tokenizer: the policy's tokenizer.
        apply_chat_template_kwargs: the dataset's template arguments.
        processor: the policy's vision processor (``None``: text only).
    """

    def __init__(
        self,
        tokenizer: Any,
        apply_chat_template_kwargs: Mapping[str, Any] | None = None,
        processor: Any = None,
    ):
        import uvicorn

        from polyrl.agent.proxy import RecordingProxy, create_proxy_app, owner_of

        self.bridge = _Bridge()
        self.proxy = RecordingProxy(
            self.bridge,
            tokenizer,
            model_name="polyrl-policy",
            apply_chat_template_kwargs=apply_chat_template_kwargs,
            processor=processor,
        )
        # A key of its own: other local processes can neither call nor read these sessions.
        self.api_key = secrets.token_hex(16)
        self.owner = owner_of(self.api_key.encode())
        app = create_proxy_app(self.proxy, api_keys=[self.api_key])
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        self._sock = sock
        self.base_url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
            name="polyrl-agent-proxy",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and join the thread."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


_HOSTS: dict[tuple[int, str, int], ProxyHost] = {}
_HOSTS_LOCK = threading.Lock()


def proxy_host(
    tokenizer: Any,
    apply_chat_template_kwargs: Mapping[str, Any] | None = None,
    processor: Any = None,
) -> ProxyHost:
    """Return this process's proxy for ``tokenizer`` (started on first use, closed at exit)."""
    key = (
        id(tokenizer),
        json.dumps(dict(apply_chat_template_kwargs or {}), sort_keys=True, default=str),
        id(processor),
    )
    with _HOSTS_LOCK:
        host = _HOSTS.get(key)
        if host is None:
            host = _HOSTS[key] = ProxyHost(tokenizer, apply_chat_template_kwargs, processor)
        return host


@atexit.register
def _close_hosts() -> None:
    with _HOSTS_LOCK:
        for host in _HOSTS.values():
            host.close()
        _HOSTS.clear()


def _parse_result(result: Any) -> tuple[float, dict[str, float]]:
    """Split an agent's return value into ``(reward, numeric info)``; raise on anything else."""
    info: Mapping[str, Any] = {}
    if isinstance(result, Mapping):
        info = {k: v for k, v in result.items() if k != "reward"}
        result = result.get("reward")
    elif isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], Mapping):
        result, info = result
    if isinstance(result, bool) or not isinstance(result, int | float):
        raise TypeError(f"the agent returned {type(result).__name__}, not a number")
    reward = float(result)
    if not math.isfinite(reward):
        raise TypeError(f"the agent returned a non-finite reward {reward}")
    numbers = {
        str(k): float(v)
        for k, v in info.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    return reward, numbers


@register_agent_loop("openai_agent")
class OpenAIAgentLoop(AgentLoop):
    """Runs a user's ``openai.AsyncOpenAI`` agent per sample and records it through the proxy.

    Args:
        tokenizer: the policy's tokenizer.
        entrypoint: ``module:function`` (or ``file.py:function``) of the agent.
        timeout_s: seconds an episode may take (it is cancelled and counted after that).
        non_extending: ``"split"`` an episode whose calls do not extend one another into
            linked samples, or ``"refuse"`` it (see the module docstring).
        **kwargs: :class:`~polyrl.agent.base.AgentLoop`'s (``max_turns`` is not used: the
            agent decides how many calls it makes, within the response budget).
    """

    name = "openai_agent"

    def __init__(
        self,
        tokenizer: Any,
        *,
        entrypoint: str = "",
        timeout_s: float = 300.0,
        non_extending: str = "split",
        **kwargs: Any,
    ):
        super().__init__(tokenizer, **kwargs)
        if non_extending not in ("split", "refuse"):
            raise ValueError(f"non_extending must be 'split' or 'refuse', got {non_extending!r}")
        self.non_extending = non_extending
        if not entrypoint:
            raise ValueError(
                "the openai_agent loop needs agent.entrypoint=module:function (an async "
                "function taking an openai.AsyncOpenAI client and the task)"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.entrypoint = entrypoint
        self.fn = load_entrypoint(entrypoint)
        self.timeout_s = float(timeout_s)

    async def run(
        self, sample: Mapping[str, Any], client: GenerateClient
    ) -> Trajectory | list[Trajectory]:
        """Run one episode; return its trajectory, its linked samples or a failure row."""
        import openai

        host = proxy_host(self.tokenizer, self.apply_chat_template_kwargs, self.processor)
        sid = f"episode-{uuid.uuid4().hex}"
        forced = {k: self.sampling_params[k] for k in _FORCED if k in self.sampling_params}
        if self.sampling_params.get("max_new_tokens") is not None:
            forced["max_new_tokens"] = int(self.sampling_params["max_new_tokens"])
        seed = sample.get("seed", self.sampling_params.get("seed"))
        route = _Route(
            client,
            asyncio.get_running_loop(),
            forced,
            self.max_response_length,
            None if seed is None else int(seed),
        )
        host.bridge.routes[sid] = route
        oai = openai.AsyncOpenAI(
            base_url=host.base_url,
            api_key=host.api_key,
            default_headers={"X-Session-Id": sid},
            # A retried call would be a second, unrecorded-context sample: fail it instead.
            max_retries=0,
            timeout=self.timeout_s,
        )
        why, reward, info = None, 0.0, {}
        try:
            result = await asyncio.wait_for(self.fn(oai, dict(sample)), self.timeout_s)
            reward, info = _parse_result(result)
        except TimeoutError:
            why = "timed_out"
        except TypeError as exc:
            why = "bad_reward" if "the agent returned" in str(exc) else "error"
        except Exception:  # the user's code: any failure is counted, never trained on
            why = "error"
        finally:
            host.bridge.routes.pop(sid, None)
            with contextlib.suppress(Exception):
                await oai.close()
        # Every call the agent awaited is recorded; one it abandoned (timeout) no longer matters.
        segments = host.proxy.trajectories(sid, host.owner)
        host.proxy.end(sid, host.owner)
        calls = sum(s.num_turns for s in segments)
        if why is None and not segments:
            why = "no_calls"
        elif why is None and len(segments) > 1 and self.non_extending == "refuse":
            why = "non_extending"
        if why is None and self.max_prompt_length is not None:
            if len(segments[0].prompt_ids) > self.max_prompt_length:
                why = "prompt_too_long"
        if why is not None:
            return self._failed(sample, why, calls)
        # A later segment's prompt holds at most the episode's response budget more than the
        # first's (the bridge refuses calls past it): only the first is held to the rule.
        for traj in segments:
            traj.seed = route.seed
            traj.reward = reward
            if traj.truncate(self.max_response_length):
                traj.finish_reason = "length"
            traj.metrics.update({"agent/failed": 0.0, "agent/calls": float(calls)})
            traj.metrics.update({f"agent/{w}": 0.0 for w in _FAILURES})
            traj.metrics["agent/linked_samples"] = float(len(segments))
            traj.metrics.update({f"agent_info/{k}": v for k, v in info.items()})
        return segments[0] if len(segments) == 1 else segments

    def _failed(self, sample: Mapping[str, Any], why: str, calls: int) -> Trajectory:
        """Return the row of a failed episode: the dataset's prompt, no response, reward 0."""
        try:
            ids, _ = prompt_ids_of(sample, self.tokenizer)
        except ValueError:
            ids = [min(self.eos_ids)]
        if self.max_prompt_length is not None:
            ids = ids[-self.max_prompt_length :]
        traj = Trajectory(prompt_ids=ids, reward=0.0, finish_reason=f"agent_{why}")
        traj.seed = sample.get("seed")
        traj.multi_modal = None
        traj.metrics.update({"agent/failed": 1.0, "agent/calls": float(calls)})
        traj.metrics["agent/linked_samples"] = 1.0
        traj.metrics.update({f"agent/{w}": float(w == why) for w in _FAILURES})
        return traj
