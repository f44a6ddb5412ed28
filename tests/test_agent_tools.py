"""Shipped tools and environments: calculator, countdown checker, Python sandbox containment."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from polyrl.agent.envs import create_env
from polyrl.agent.tools import (
    PythonSandboxTool,
    ToolError,
    create_tool,
    safe_calculate,
)


def call(tool, arguments, **context):
    out = asyncio.run(tool.call(arguments, **context))
    return out if isinstance(out, str) else out.text


def test_calculator_is_safe_and_correct():
    assert safe_calculate("(3 + 4) * 12") == 84
    assert safe_calculate("2 ** 10 - 7 // 2 + 7 % 4") == 1024 - 3 + 3
    assert safe_calculate("-1.5 * 2") == -3.0
    calc = create_tool("calculator")
    assert call(calc, {"expression": "10 / 4"}) == "2.5"
    assert call(calc, {"expression": "10 / 5"}) == "2"
    for bad, why in [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("(1).__class__", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("9 ** 9 ** 9", "exponents above"),
        ("1 / 0", "division by zero"),
        ("1 +", "not a valid arithmetic expression"),
        ("1" * 300, "longer than"),
        ("10.0 ** 64 * 10.0 ** 64", "range"),
    ]:
        with pytest.raises(ToolError, match=why):
            safe_calculate(bad)


def test_countdown_tool_and_envs():
    tool = create_tool("countdown_check")
    ctx = {"target": 24, "numbers": [4, 6, 1]}
    assert call(tool, {"expression": "4 * 6 * 1"}, **ctx) == "4 * 6 * 1 = 24: correct"
    assert "not 24" in call(tool, {"expression": "4 * 6 + 1"}, **ctx)
    assert "exactly once" in call(tool, {"expression": "4 * 6"}, **ctx)
    with pytest.raises(ToolError, match="invalid expression"):
        call(tool, {"expression": "4 ** 6"}, **ctx)
    with pytest.raises(ToolError, match="needs the puzzle"):
        call(tool, {"expression": "1"})

    env = create_env("countdown")
    first = env.reset(seed=3, numbers=[4, 6, 1], target=24, max_tries=2)
    assert "[4, 6, 1]" in first and "24" in first
    obs, reward, done, _ = env.step("I think 4 * 6 + 1")
    assert (reward, done) == (0.0, False) and "= 25, not 24" in obs
    obs, reward, done, info = env.step("<answer>(4 * 6) * 1</answer>")
    assert (obs, reward, done, info["solved"]) == ("Correct!", 1.0, True, 1.0)

    guess = create_env("guess_number")
    guess.reset(seed=0, low=1, high=10, max_guesses=2, secret=7)
    assert guess.step("5") == ("Higher. 1 guesses left.", 0.0, False, {"guesses": 1, "solved": 0.0})
    obs, reward, done, _ = guess.step("maybe nine")
    assert done and reward == 0.0 and "it was 7" in obs
    with pytest.raises(KeyError, match="did you mean 'countdown'"):
        create_env("countdwn")


@pytest.fixture(scope="module")
def listener():
    """A real TCP server on 127.0.0.1 that counts the connections it accepts."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    accepted = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            accepted.append(1)
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join()
    srv.close()


CONNECT = """
import socket
s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
print("CONNECTED")
"""


def control_connect(port, accepted, expected):
    """Connect from outside the sandbox and wait until the listener has counted ``expected``
    connections in all: proves it works and that no other connection came in."""
    socket.create_connection(("127.0.0.1", port), timeout=2).close()
    deadline = time.monotonic() + 5
    while len(accepted) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # a stray extra connection would be counted by now
    assert len(accepted) == expected


def run_code(tool, code):
    return asyncio.run(tool.run_code(code))


def test_sandbox_runs_code_and_truncates_output():
    tool = PythonSandboxTool(max_output_chars=100)
    ok = run_code(tool, "import math, json\nprint(json.dumps(math.factorial(5)))")
    assert ok.text == "120\n" and not ok.error
    big = run_code(tool, "print('a' * 100000)")
    assert big.text.startswith("a" * 100) and "[output truncated: 100001 bytes" in big.text
    crash = run_code(tool, "raise SystemExit(3)")
    assert crash.error and "[exit code 3]" in crash.text


def test_sandbox_blocks_network_with_audit_hook(listener):
    port, accepted = listener
    before = len(accepted)
    tool = PythonSandboxTool(timeout=10)
    assert tool.isolation == "namespaces+audit"
    out = run_code(tool, CONNECT.format(port=port))
    assert out.error and "network access is disabled" in out.text
    assert "CONNECTED" not in out.text
    # control: a connection from outside the sandbox does reach the listener (the only one)
    control_connect(port, accepted, before + 1)


def test_sandbox_network_namespace_alone_blocks_network(listener):
    """The OS layer on its own (audit hook off): the child has no usable network at all."""
    port, accepted = listener
    before = len(accepted)
    tool = PythonSandboxTool(audit_hook=False, timeout=10)
    assert tool.isolation == "namespaces"
    out = run_code(tool, CONNECT.format(port=port))
    assert out.error and "CONNECTED" not in out.text
    assert "Network is unreachable" in out.text or "Connection refused" in out.text
    control_connect(port, accepted, before + 1)


def test_sandbox_contains_writes_outside_its_directory(tmp_path):
    # the sandbox's working directory is its private /tmp: the hook refuses anything outside
    target = f"/var/tmp/polyrl-escaped-{os.getpid()}.txt"
    tool = PythonSandboxTool()
    out = run_code(
        tool,
        f"open('inside.txt', 'w').write('ok')\nprint(open('inside.txt').read())\n"
        f"open({target!r}, 'w').write('pwned')",
    )
    assert out.text.startswith("ok\n") and out.error and "outside the sandbox" in out.text
    assert not os.path.exists(target)
    target = tmp_path / "escaped.txt"
    for code in [
        f"import os; os.rename('x', {str(tmp_path / 'y')!r})",
        f"import os; os.mkdir({str(tmp_path / 'd')!r})",
        "import subprocess; subprocess.run(['touch', '/tmp/polyrl-sandbox-escape'])",
    ]:
        assert run_code(tool, code).error
    assert not (tmp_path / "d").exists() and not os.path.exists("/tmp/polyrl-sandbox-escape")
    # OS layer alone: the host's directories are not even visible (tests/test_sandbox.py has
    # the ctypes and other attempts that the audit hook would not see)
    bare = PythonSandboxTool(audit_hook=False)
    out = run_code(bare, f"open({str(target)!r}, 'w').write('pwned')")
    assert out.error and "No such file or directory" in out.text and not target.exists()


def test_sandbox_contains_memory_bomb_infinite_loop_and_big_files():
    # the CPU limit gets a wall-clock margin: on a loaded machine 1 CPU second takes longer
    tool = PythonSandboxTool(memory_mb=256, cpu_seconds=1, timeout=15, file_size_mb=1)
    bomb = run_code(tool, "x = bytearray(4 * 1024 ** 3)\nprint('allocated')")
    assert bomb.error and "MemoryError" in bomb.text and "allocated" not in bomb.text
    spin = run_code(tool, "while True:\n    pass")
    assert spin.error and "CPU time limit" in spin.text
    sleep = run_code(PythonSandboxTool(timeout=2), "import time\ntime.sleep(60)")
    assert sleep.error and "wall-clock timeout of 2 s" in sleep.text
    fat = run_code(tool, "open('f', 'wb').write(b'0' * (4 << 20))")
    assert fat.error and ("SIGXFSZ" in fat.text or "File too large" in fat.text)
    # the parent is unharmed and the sandbox still works afterwards
    assert run_code(tool, "print(6 * 7)").text == "42\n"


def test_sandbox_tool_in_loop_context_and_bad_args():
    tool = create_tool("python", timeout=5)
    assert call(tool, {"code": "print(sum(range(10)))"}) == "45\n"
    with pytest.raises(ToolError, match="non-empty string"):
        call(tool, {"code": ""})
    with pytest.raises(ValueError, match="isolation must be"):
        PythonSandboxTool(isolation="chroot")
    with pytest.raises(ValueError, match="memory_mb must be"):
        PythonSandboxTool(memory_mb=0)
