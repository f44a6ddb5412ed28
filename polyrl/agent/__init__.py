"""The agent loop: multi-turn rollouts with tools and environments, token-in/token-out.

* :mod:`polyrl.agent.base`: ``Trajectory``, the ``AgentLoop`` ABC and registry, the collator;
* :mod:`polyrl.agent.single_turn`, :mod:`polyrl.agent.tool_loop`, :mod:`polyrl.agent.env_loop`:
  the shipped loops (``single_turn``, ``tool``, ``env``);
* :mod:`polyrl.agent.tools` and :mod:`polyrl.agent.envs`: tools (calculator, Python sandbox,
  countdown checker) and environments (guess-the-number, countdown, visual_color with images);
* :mod:`polyrl.agent.proxy`: an OpenAI-compatible recording proxy (``polyrl agent-proxy``).
"""

from polyrl.agent.base import (
    AgentLoop,
    ChatTemplateError,
    Trajectory,
    agent_name_of,
    available_agent_loops,
    chat_delta_ids,
    collate_trajectories,
    create_agent_loop,
    get_agent_loop,
    register_agent_loop,
    run_agent_loops,
    split_media,
    split_messages_media,
)
from polyrl.agent.env_loop import EnvAgentLoop
from polyrl.agent.envs import Env, available_envs, create_env, register_env
from polyrl.agent.single_turn import SingleTurnAgentLoop
from polyrl.agent.tool_loop import (
    HermesToolParser,
    ToolAgentLoop,
    ToolParser,
    register_tool_parser,
)
from polyrl.agent.tools import (
    Tool,
    ToolError,
    ToolResult,
    available_tools,
    register_tool,
)

__all__ = [
    "AgentLoop",
    "ChatTemplateError",
    "Env",
    "EnvAgentLoop",
    "HermesToolParser",
    "SingleTurnAgentLoop",
    "Tool",
    "ToolAgentLoop",
    "ToolError",
    "ToolParser",
    "ToolResult",
    "Trajectory",
    "agent_name_of",
    "available_agent_loops",
    "available_envs",
    "available_tools",
    "chat_delta_ids",
    "collate_trajectories",
    "create_agent_loop",
    "create_env",
    "get_agent_loop",
    "register_agent_loop",
    "register_env",
    "register_tool",
    "register_tool_parser",
    "run_agent_loops",
    "split_media",
    "split_messages_media",
]
