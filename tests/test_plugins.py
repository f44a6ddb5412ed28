"""User modules extend polyrl (issue 24, item 6): what they register, the config accepts.

The user module is written to ``tmp_path`` and put on the import path by its directory; its
functions write marker files (``<what>.<pid>``) so a test can see where they ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.config import ConfigError, PolyRLConfig, describe, load_config
from polyrl.controller import Dispatch, Worker, WorkerGroup, register
from polyrl.core.plugins import import_plugins, plugin_modules

REPO = Path(__file__).resolve().parents[1]

PLUGIN = '''
"""A user's extensions: one of each kind, each leaving a marker file when it runs."""
import os
import random

from polyrl.agent.base import AgentLoop, register_agent_loop
from polyrl.agent.envs import Env, register_env
from polyrl.agent.single_turn import SingleTurnAgentLoop
from polyrl.agent.tool_loop import HermesToolParser, register_tool_parser
from polyrl.agent.tools import Tool, register_tool
from polyrl.algo import register_advantage, register_policy_loss
from polyrl.algo.advantages import grpo
from polyrl.algo.losses import ppo_clip
from polyrl.data.schema import make_row
from polyrl.data.tasks import register_task
from polyrl.reward import register_scorer

MARKERS = {markers!r}


def mark(what):
    with open(os.path.join(MARKERS, f"{{what}}.{{os.getpid()}}"), "a") as f:
        f.write("x\\n")


@register_advantage("{prefix}_adv")
def my_advantage(token_level_rewards, response_mask, index=None, values=None,
                 baseline_rewards=None, **kwargs):
    mark("advantage")
    return grpo(token_level_rewards, response_mask, index)


@register_policy_loss("{prefix}_loss")
def my_policy_loss(log_prob, old_log_prob, advantages, response_mask, **kwargs):
    mark("policy_loss")
    return ppo_clip(log_prob, old_log_prob, advantages, response_mask, **kwargs)


@register_scorer("{prefix}_source")
def my_scorer(response, ground_truth, extra_info=None, prompt=None):
    mark("scorer")
    return float(len(response) % 3 == 0)


@register_task("{prefix}_task")
def my_task(num, seed, split="train", **kwargs):
    mark("task")
    rng = random.Random(f"{{seed}}/{{split}}")
    numbers = [str(rng.randrange(10**6)) for _ in range(num)]
    return [make_row("{prefix}_source", f"Repeat {{n}}.", n) for n in numbers]


@register_agent_loop("{prefix}_loop")
class MyLoop(SingleTurnAgentLoop):
    async def run(self, sample, client):
        mark("agent_loop")
        return await super().run(sample, client)


@register_env("{prefix}_env")
class MyEnv(Env):
    def reset(self, seed=None, **kwargs):
        return "go"

    def step(self, action):
        mark("env")
        return "", 1.0, True, {{}}


@register_tool("{prefix}_tool")
class MyTool(Tool):
    description = "Echo."

    async def call(self, arguments, **context):
        mark("tool")
        return "echo"


@register_tool_parser("{prefix}_parser")
class MyParser(HermesToolParser):
    pass
'''


def write_plugin(folder: Path, name: str, markers: Path) -> Path:
    """Write the user module ``name`` into ``folder``; its names start with ``name``."""
    markers.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(PLUGIN.format(markers=str(markers), prefix=name))
    return path


def marks(markers: Path, what: str) -> set[int]:
    """Process ids that left a ``what`` marker."""
    return {int(p.suffix[1:]) for p in markers.glob(f"{what}.*")}


@pytest.fixture(autouse=True)
def _forget_plugins(monkeypatch):
    """Keep this file's modules out of the worker processes other tests start."""
    from polyrl.core import plugins

    monkeypatch.setattr(plugins, "_IMPORTED", list(plugins._IMPORTED))
    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A fresh user module on sys.path: ``(module name, markers directory)``."""
    name = f"user_ext_{tmp_path.name.replace('-', '_')}"[:60]
    write_plugin(tmp_path, name, tmp_path / "markers")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, tmp_path / "markers"


def _uses(name: str) -> list[str]:
    return [
        f"algorithm.adv_estimator={name}_adv",
        f"actor.policy_loss={name}_loss",
        f"data.task={name}_task",
        f"agent.default_loop={name}_loop",
        f"agent.tools=[calculator,{name}_tool]",
        f"agent.tool_parser={name}_parser",
    ]


def _check_uses(cfg: PolyRLConfig, name: str) -> None:
    assert cfg.algorithm.adv_estimator == f"{name}_adv"
    assert cfg.actor.policy_loss == f"{name}_loss"
    assert cfg.data.task == f"{name}_task"
    assert cfg.agent.default_loop == f"{name}_loop"
    assert cfg.agent.tools == ["calculator", f"{name}_tool"]
    assert cfg.agent.tool_parser == f"{name}_parser"


def test_overrides_may_name_what_trainer_imports_registers_in_any_order(plugin):
    name, _ = plugin
    # The names come before the import that registers them.
    cfg = load_config("grpo", [*_uses(name), f"trainer.imports=[{name}]"])
    _check_uses(cfg, name)
    assert cfg.trainer.imports == [name]
    assert name in plugin_modules()


def test_a_preset_file_may_name_what_its_imports_register(plugin, tmp_path):
    name, _ = plugin
    preset = tmp_path / "mine.yaml"
    preset.write_text(
        f"trainer: {{imports: [{name}]}}\n"
        f"algorithm: {{adv_estimator: {name}_adv}}\n"
        f"data: {{task: {name}_task}}\n"
    )
    cfg = load_config(str(preset), [f"actor.policy_loss={name}_loss"])
    assert cfg.algorithm.adv_estimator == f"{name}_adv"
    assert cfg.data.task == f"{name}_task"


def test_python_config_imports_the_modules_before_checking_the_groups(plugin):
    name, _ = plugin
    cfg = PolyRLConfig(
        data={"task": f"{name}_task"},  # a group checked before trainer, in field order
        trainer={"imports": [name]},
        algorithm={"adv_estimator": f"{name}_adv"},
    )
    assert cfg.data.task == f"{name}_task"
    cfg.actor.policy_loss = f"{name}_loss"  # assignment: registered now, so accepted


def test_validating_a_config_imports_modules_assigned_to_it(tmp_path, monkeypatch):
    from polyrl.config.schema import validate_tree

    name = "assigned_ext_" + tmp_path.name.replace("-", "_")[:40]
    write_plugin(tmp_path, name, tmp_path / "markers")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = PolyRLConfig()
    cfg.trainer.imports = [name]  # the trainers validate the whole config before they start
    assert name not in sys.modules
    validate_tree(cfg)
    assert name in sys.modules and name in plugin_modules()


def test_a_registered_name_needs_its_module_and_the_error_says_so():
    with pytest.raises(ConfigError) as info:
        load_config("grpo", ["algorithm.adv_estimator=grpoo"])
    msg = str(info.value)
    assert msg.startswith("algorithm.adv_estimator: unknown advantage estimator 'grpoo'")
    assert "did you mean 'grpo'" in msg and "trainer.imports" in msg
    with pytest.raises(ConfigError, match=r"agent\.tools: unknown tool 'nope' at index 1"):
        load_config("grpo", ["agent.tools=[calculator,nope]"])
    with pytest.raises(ConfigError, match=r"actor\.policy_loss: unknown policy loss"):
        PolyRLConfig(actor={"policy_loss": "not_registered"})


def test_a_module_that_cannot_be_imported_names_trainer_imports(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer\.imports: cannot import 'no_such_mod_x'"):
        load_config("grpo", ["trainer.imports=[no_such_mod_x]"])
    broken = tmp_path / "broken_ext_mod.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"RuntimeError: boom"):
        load_config("grpo", [f"trainer.imports=[{broken}]"])


def test_a_py_file_entry_is_imported_by_its_stem(tmp_path):
    name = "file_ext_" + tmp_path.name.replace("-", "_")[:40]
    path = write_plugin(tmp_path, name, tmp_path / "markers")
    modules = import_plugins([str(path)])
    assert modules[0].__name__ == name
    assert str(path) in plugin_modules()
    cfg = load_config("grpo", [f"trainer.imports=[{path}]", f"algorithm.adv_estimator={name}_adv"])
    assert cfg.algorithm.adv_estimator == f"{name}_adv"


def test_describe_lists_the_built_in_names_of_registry_backed_options():
    rows = {r.key: r for r in describe()}
    assert rows["algorithm.adv_estimator"].type.startswith("{gae,grpo,")
    assert rows["algorithm.adv_estimator"].type.endswith("} | registered")
    assert (
        rows["agent.tools"].type
        == "list[{calculator,countdown_check,gsm8k_check,python} | registered]"
    )
    assert rows["algorithm.kl_penalty"].type.endswith("}")  # a closed choice stays closed
    assert rows["trainer.imports"].type == "list[str]"


def test_the_built_in_names_are_those_the_registries_hold():
    from polyrl.agent.base import AGENT_LOOPS
    from polyrl.agent.tool_loop import TOOL_PARSERS
    from polyrl.agent.tools import TOOLS
    from polyrl.algo.advantages import ADVANTAGE_ESTIMATORS
    from polyrl.algo.losses import POLICY_LOSSES
    from polyrl.config import schema
    from polyrl.data.tasks import TASKS

    def builtin(registry) -> set[str]:  # what polyrl itself registers (not other tests)
        return {
            n
            for n in registry.names()
            if n in getattr(registry, "_lazy", {})
            or getattr(registry.get(n), "__module__", "").startswith("polyrl.")
        }

    assert set(schema.ADV_ESTIMATORS) == builtin(ADVANTAGE_ESTIMATORS)
    assert set(schema.POLICY_LOSSES) == builtin(POLICY_LOSSES)
    assert set(schema.TASKS) - {""} == builtin(TASKS)
    assert set(schema.AGENT_LOOPS) == builtin(AGENT_LOOPS)
    assert set(schema.TOOLS) == builtin(TOOLS)
    assert set(schema.TOOL_PARSERS) == builtin(TOOL_PARSERS)


def test_built_in_names_cost_no_torch_import():
    code = (
        "import sys\n"
        "from polyrl.config import load_config\n"
        "load_config('grpo', ['algorithm.adv_estimator=rloo', 'actor.policy_loss=gspo',"
        " 'agent.tools=[python]', 'data.task=countdown'])\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    ).stdout
    assert out.strip() == "False"


def test_polyrl_config_show_imports_the_users_module(plugin, tmp_path):
    name, markers = plugin
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "config", "show", "grpo", *_uses(name)]
        + [f"trainer.imports=[{name}]"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"adv_estimator: {name}_adv" in proc.stdout
    assert f"default_loop: {name}_loop" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "polyrl.cli", "config", "show", "grpo", f"data.task={name}_task"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "list the module" in proc.stderr, proc.stderr


def test_the_registered_entries_run_after_import(plugin):
    import asyncio

    from polyrl.agent.base import get_agent_loop
    from polyrl.agent.envs import create_env
    from polyrl.agent.tools import create_tool
    from polyrl.data.tasks import generate
    from polyrl.reward.registry import get_scorer

    name, markers = plugin
    import_plugins([name])
    rows = generate(f"{name}_task", 3, seed=0)
    assert [r["data_source"] for r in rows] == [f"{name}_source"] * 3
    assert get_scorer(f"{name}_source")("abc", "1") == 1.0
    assert asyncio.run(create_tool(f"{name}_tool").call({})) == "echo"
    assert create_env(f"{name}_env").step("x")[2] is True
    assert get_agent_loop(f"{name}_loop").name == f"{name}_loop"
    for what in ("task", "scorer", "tool", "env"):
        assert marks(markers, what) == {os.getpid()}, what


class LossLookupWorker(Worker):
    """Looks a policy loss up by name in its own process and runs it."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def run_loss(self, name: str) -> tuple[int, float]:
        import torch

        from polyrl.algo import get_policy_loss

        ones = torch.ones(1, 3)
        loss, _ = get_policy_loss(name)(ones * 0, ones * 0, ones, ones)
        return os.getpid(), float(loss)


def test_worker_processes_import_the_users_modules(plugin):
    name, markers = plugin
    import_plugins([name])
    group = WorkerGroup(LossLookupWorker, world_size=1, backend="local", local_mode="process")
    try:
        ((pid, loss),) = group.run_loss(f"{name}_loss")
    finally:
        group.shutdown()
    assert pid != os.getpid()
    assert loss == pytest.approx(-1.0)
    assert marks(markers, "policy_loss") == {pid}


@pytest.mark.slow
def test_polyrl_train_runs_the_users_estimator_loss_and_scorer(tmp_path):
    """``polyrl train`` with trainer.imports: 2 GRPO steps on two local rank processes."""
    name = "train_ext_mod"
    markers = tmp_path / "markers"
    (tmp_path / "src").mkdir()
    write_plugin(tmp_path / "src", name, markers)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "polyrl.cli",
        "train",
        "demo",
        f"trainer.imports=[{name}]",
        f"algorithm.adv_estimator={name}_adv",
        f"actor.policy_loss={name}_loss",
        f"data.task={name}_task",
        f"trainer.output_dir={out}",
        "trainer.total_steps=2",
        "trainer.n_gpus_per_node=2",  # two rank processes: the loss runs outside the driver
        "trainer.loggers=[jsonl]",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",
        "trainer.export_hf=false",
        "data.num_train=32",
        "data.num_val=8",
        "data.train_batch_size=4",
        "rollout.n=4",
        "reward.num_workers=1",
        "actor.use_kl_loss=false",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path / "src")])}
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [
        json.loads(line)["step"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if "critic/score/mean" in line
    ]
    assert steps == [1, 2]
    driver = marks(markers, "task")  # the data is generated by the driver
    assert len(driver) == 1
    assert marks(markers, "advantage") == driver
    scorers = marks(markers, "scorer")  # a reward worker process
    assert scorers and not scorers & driver
    losses = marks(markers, "policy_loss")  # both rank processes
    assert len(losses) == 2 and not losses & driver
