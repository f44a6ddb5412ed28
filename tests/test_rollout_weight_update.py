"""The native engine's weight-update protocol on its own: a real runner, a stand-in engine.

:class:`WeightUpdater` reaches its engine only through :class:`EngineHooks`; here they belong to
``_Engine``, which runs commands on one named thread (as the engine thread does between steps),
checks that every hook that changes engine state is called there, and records what was asked.
The engine-level behaviour (requests decoding through a switch, 503s) is in
tests/test_rollout_engine.py and tests/test_weights_core.py.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from polyrl.core.rollout_api import EngineUnavailableError, InvalidRequestError
from polyrl.models.loader import load_causal_lm
from polyrl.rollout.native.runner import ModelRunner
from polyrl.rollout.native.weight_update import EngineHooks, WeightUpdater

_THREAD = "fake-engine"


class _Engine:
    """The engine side of a :class:`WeightUpdater`: a command thread, a pause flag, counters."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=_THREAD)
        self.paused = False
        self.aborts = 0
        self.prefix_resets = 0
        self.commands = 0
        # Run once on the caller's thread before the next command is queued (to race a command).
        self.interpose: Callable[[], Any] | None = None

    @staticmethod
    def _on_engine_thread() -> None:
        assert threading.current_thread().name.startswith(_THREAD)

    def between_steps(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        if self.interpose is not None:
            step, self.interpose = self.interpose, None
            step()
        self.commands += 1
        return self.pool.submit(fn)

    def is_paused(self) -> bool:
        self._on_engine_thread()
        return self.paused

    def set_paused(self, paused: bool) -> None:
        self._on_engine_thread()
        self.paused = paused

    def abort_requests(self) -> int:
        self._on_engine_thread()
        self.aborts += 1
        return 0

    def reset_prefix_cache(self) -> None:
        self._on_engine_thread()
        self.prefix_resets += 1

    def hooks(self) -> EngineHooks:
        return EngineHooks(
            between_steps=self.between_steps,
            is_paused=self.is_paused,
            set_paused=self.set_paused,
            abort_requests=self.abort_requests,
            reset_prefix_cache=self.reset_prefix_cache,
        )


@pytest.fixture(scope="module")
def new(tiny_qwen2_seed1_dir) -> dict[str, torch.Tensor]:
    """The other weights (seed 1), by parameter name."""
    return {n: p.detach() for n, p in load_causal_lm(tiny_qwen2_seed1_dir).named_parameters()}


@pytest.fixture
def parts(tiny_qwen2_dir):
    runner = ModelRunner(tiny_qwen2_dir)
    engine = _Engine()
    updater = WeightUpdater(runner, engine.hooks())
    old = {n: p.detach().clone() for n, p in runner.model.named_parameters()}
    try:
        yield runner, engine, updater, old
    finally:
        engine.pool.shutdown()


def _serving(runner: ModelRunner, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, weights[n]) for n, p in runner.model.named_parameters())


def _stream(updater: WeightUpdater, transfer_id: str, weights: dict[str, torch.Tensor]) -> None:
    for name, tensor in weights.items():
        updater.destination(transfer_id, name).copy_(tensor)


def test_load_versions_switches_and_refuses_bad_input(parts, new, tiny_qwen2_seed1_dir):
    runner, engine, updater, old = parts
    assert updater.version == 0
    assert updater.load(new.items()) == 1 and updater.version == 1
    assert _serving(runner, new) and engine.prefix_resets == 1
    assert updater.load(old.items(), version=7) == 7 and _serving(runner, old)
    for bad in (-1, True, "3"):
        with pytest.raises(InvalidRequestError, match="weight version must be an int >= 0"):
            updater.load(new.items(), version=bad)  # type: ignore[arg-type]
    name = next(iter(new))
    with pytest.raises(InvalidRequestError, match=r"parameter\(s\) missing from the new weights"):
        updater.load([(name, new[name])])
    assert updater.load([(name, new[name])], partial=True) == 8
    assert torch.equal(runner.live(name), new[name])
    assert updater.load_dir(tiny_qwen2_seed1_dir) == 9 and _serving(runner, new)
    assert updater.version == 9 and engine.prefix_resets == 4
    assert not engine.paused and engine.aborts == 0
    updater.check_serving()


def test_staged_update_streams_into_shadows_and_swaps_at_commit(parts, new):
    runner, engine, updater, old = parts
    updater.begin("t1")
    assert not engine.paused  # staged + keep: decoding goes on
    name = next(iter(new))
    assert updater.destination("t1", name).data_ptr() != runner.live(name).data_ptr()
    with pytest.raises(InvalidRequestError, match=r"t0 is not in progress .*\(current: t1\)"):
        updater.destination("t0", name)
    busy = "streamed weight transfer t1 is in progress; retry after it commits or aborts"
    with pytest.raises(InvalidRequestError, match=busy):
        updater.load(new.items())
    with pytest.raises(InvalidRequestError, match=busy):
        updater.load_dir("/nonexistent")
    _stream(updater, "t1", new)
    assert _serving(runner, old) and updater.version == 0  # nothing switched yet
    ptrs = {n: p.data_ptr() for n, p in runner.model.named_parameters()}
    assert updater.commit("t1", list(new)) == 1
    assert _serving(runner, new) and engine.prefix_resets == 1 and not engine.paused
    assert all(p.data_ptr() != ptrs[n] for n, p in runner.model.named_parameters())  # swapped
    with pytest.raises(InvalidRequestError, match="weight transfer t1 is not in progress"):
        updater.commit("t1", list(new))
    assert updater.abort("t1", "late") is False
    # A partial commit switches what was sent and keeps the rest.
    updater.begin("t2")
    updater.destination("t2", name).copy_(old[name])
    assert updater.commit("t2", [name], version=5, partial=True) == 5
    assert torch.equal(runner.live(name), old[name])


def test_inflight_policies_resume_only_what_the_update_paused(parts, new):
    _, engine, updater, _ = parts
    updater.begin("a", inflight="abort")
    assert engine.aborts == 1 and engine.paused
    assert updater.abort("a", "test") is True and not engine.paused
    updater.begin("p", inflight="pause")
    assert engine.paused and engine.aborts == 1
    _stream(updater, "p", new)
    updater.commit("p", list(new))
    assert not engine.paused
    # Paused by the user before the update: commit and abort leave it paused.
    engine.paused = True
    updater.begin("u", inflight="pause")
    _stream(updater, "u", new)
    updater.commit("u", list(new))
    assert engine.paused
    updater.begin("k")
    assert engine.paused
    assert updater.abort(None, "any") is True and engine.paused
    engine.paused = False
    # Superseding a pausing update with a keeping one resumes stepping at once.
    updater.begin("x", inflight="pause")
    assert engine.paused
    updater.begin("y")
    assert not engine.paused
    with pytest.raises(InvalidRequestError, match="weight transfer x is not in progress"):
        updater.commit("x", list(new))
    assert updater.abort("x", "stale") is False and updater.abort("y", "done") is True
    assert updater.version == 2 and not engine.paused


def test_interrupted_inplace_update_blocks_until_a_complete_set(parts, new):
    runner, engine, updater, old = parts
    updater.begin("i1", mode="inplace")
    assert engine.paused  # in place can only pause running requests
    with pytest.raises(EngineUnavailableError, match=r"in-place weight update \(i1\) is in prog"):
        updater.check_serving()
    assert updater.shared_destinations("i1") is None  # the live weights are not offered
    name = next(iter(new))
    dest = updater.destination("i1", name)
    assert dest.data_ptr() == runner.live(name).data_ptr()
    dest.copy_(new[name])
    assert updater.abort("i1", "sender died") is True
    assert engine.paused  # mixed weights: nothing may step on them
    blocked = r"update i1 was interrupted \(sender died\);.* \(still version 0\)"
    with pytest.raises(EngineUnavailableError, match=blocked):
        updater.check_serving()
    # A partial set does not repair the weights; a complete one does, and resumes.
    assert updater.load([(name, old[name])], partial=True) == 1
    with pytest.raises(EngineUnavailableError, match=blocked):
        updater.check_serving()
    assert engine.paused
    assert updater.load(old.items()) == 2
    updater.check_serving()
    assert not engine.paused and _serving(runner, old)
    # Or a retried in-place update that commits.
    updater.begin("i2", mode="inplace")
    assert updater.abort("i2", "again") is True
    updater.begin("i3", mode="inplace")
    assert engine.paused
    _stream(updater, "i3", new)
    assert updater.commit("i3", list(new)) == 3
    updater.check_serving()
    assert not engine.paused and _serving(runner, new)


def test_commit_with_missing_parameters_aborts_and_names_them(parts, new):
    runner, engine, updater, old = parts
    names = list(new)
    sent, last = names[:-1], names[-1]
    updater.begin("m", inflight="pause")
    _stream(updater, "m", {n: new[n] for n in sent})
    message = (
        f"1 parameter(s) missing from weight transfer m, e.g. {[last]}; the old weights keep "
        "serving"
    )
    with pytest.raises(InvalidRequestError, match=re.escape(message) + "$"):
        updater.commit("m", sent)
    assert updater.version == 0 and not engine.paused and _serving(runner, old)
    with pytest.raises(InvalidRequestError, match="weight transfer m is not in progress"):
        updater.destination("m", sent[0])
    updater.check_serving()
    updater.begin("mi", mode="inplace")
    note = " (in-place: requests are refused until an update completes)"
    with pytest.raises(InvalidRequestError, match=re.escape(message.replace(" m,", " mi,") + note)):
        updater.commit("mi", sent)
    with pytest.raises(EngineUnavailableError, match=r"\(1 parameter\(s\) never arrived\)"):
        updater.check_serving()
    assert engine.paused and updater.version == 0


def test_a_commit_superseded_before_it_runs_is_refused(parts, new):
    runner, engine, updater, old = parts
    updater.begin("s1")
    _stream(updater, "s1", new)
    # Another begin lands between commit's checks and its command.
    engine.interpose = lambda: updater.begin("s2")
    with pytest.raises(InvalidRequestError, match="weight transfer s1 was superseded"):
        updater.commit("s1", list(new))
    assert updater.version == 0 and _serving(runner, old)
    assert updater.abort(None, "cleanup") is True


def test_arguments_and_sleep_states_are_checked(parts, new, monkeypatch):
    runner, engine, updater, _ = parts
    with pytest.raises(InvalidRequestError, match="mode 'x'; expected 'staged' or 'inplace'"):
        updater.begin("b", mode="x")
    with pytest.raises(InvalidRequestError, match="policy 'x'; expected 'keep', 'pause' or"):
        updater.begin("b", inflight="x")
    with pytest.raises(InvalidRequestError, match="not in progress on this engine"):
        updater.shared_destinations("b")
    assert engine.commands == 0  # refused before reaching the engine
    with monkeypatch.context() as m:  # CPU weights never offload; pretend they did
        m.setattr(ModelRunner, "offloaded", property(lambda self: True))
        with pytest.raises(InvalidRequestError, match=r"offloaded \(sleep level 1\)"):
            updater.begin("b")
    runner.discard()
    with pytest.raises(EngineUnavailableError, match=r"discarded by sleep\(level=2\)"):
        updater.check_serving()
    name = next(iter(new))
    with pytest.raises(InvalidRequestError, match="a partial update cannot restore them"):
        updater.load([(name, new[name])], partial=True)
    assert updater.load(new.items()) == 1
    updater.check_serving()
    assert _serving(runner, new)
