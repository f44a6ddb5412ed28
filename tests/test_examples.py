"""Every script in examples/ runs end to end in its smoke size (a subprocess each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"

#: script -> what its output must contain.
SMOKE = {
    # The script's four critic-free trainers differ only in class and preset: one run covers
    # its --trainer plumbing; ReMax is the one with a code path of its own (greedy baselines).
    "grpo_custom_reward.py": "remax {'steps': 2",
    "ppo_critic.py": "'steps': 2",
    "tool_agent.py": "turns=2 tool_calls=1 tool_errors=0",
    "openai_agent.py": "step 2: score",
    "custom_env.py": "'steps': 1",
    "rollout_server.py": "httpx chat:",
    "transfer_queue.py": "actor takes the last 4 samples",
    "dpo_pairs.py": "'steps': 2",
    "rm_pairs.py": "score of '194'",
    "prime_arithmetic.py": "step 2: score",
    "sft_chat.py": "'steps': 2",
    "vlm_grpo.py": "vlm grpo {'steps': 2",
}
#: script -> arguments its smoke run adds to --smoke.
ARGS = {"grpo_custom_reward.py": ["--trainer", "remax"]}


def test_every_example_is_covered():
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SMOKE)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_example_runs(script, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "TMPDIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--smoke", *ARGS.get(script, [])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert SMOKE[script] in output, output[-4000:]
