"""Weight updates of the native engine: versions, staging, streamed updates and the switch.

A :class:`WeightUpdater` owns everything about changing the weights a
:class:`~.engine.NativeEngine` serves. There are two ways in:

* A whole set at once (:meth:`WeightUpdater.load`, :meth:`WeightUpdater.load_dir`): the
  tensors are validated and copied into the runner's shadows on the caller's thread while
  decoding goes on, then switched to in one in-place copy between two steps.
* A streamed update (what :mod:`polyrl.weights` feeds): :meth:`~WeightUpdater.begin`, then
  :meth:`~WeightUpdater.destination` per tensor, then :meth:`~WeightUpdater.commit` or
  :meth:`~WeightUpdater.abort`. ``staged``: tensors land in the shadows while decoding goes
  on, and commit swaps pointers. ``inplace``: the engine is paused and tensors land in the live
  parameters; an update that does not commit leaves the replica refusing requests (503) until
  one does.

Every switch bumps the weight version (or sets the one given) and drops the prefix cache,
whose keys and values belong to the old weights; in-flight sequences keep their KV and go on
under the new weights.

Threading: the updater changes its state (the version, the update in progress, why requests
are refused) and the engine's pause flag only inside commands the engine runs between two
steps (:attr:`EngineHooks.between_steps`), and the caller waits for them. Argument checks and
staging run on the caller's thread.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from polyrl.core.rollout_api import EngineUnavailableError, InvalidRequestError
from polyrl.rollout.native.runner import ModelRunner

__all__ = ["EngineHooks", "WeightUpdater"]

_STAGE_LOCK = threading.Lock()  # serialises staging into the shadows


@dataclasses.dataclass(frozen=True)
class EngineHooks:
    """What a :class:`WeightUpdater` does to the engine that holds it.

    Attributes:
        between_steps: queue a function to run on the engine thread between two steps; the
            future gives its result or raises its error.
        is_paused: whether stepping is paused (called in commands).
        set_paused: pause (``True``) or resume stepping (called in commands).
        abort_requests: end every in-flight request with ``abort`` (called in commands).
        reset_prefix_cache: forget the cached prompt prefixes (called in commands).
    """

    between_steps: Callable[[Callable[[], Any]], concurrent.futures.Future[Any]]
    is_paused: Callable[[], bool]
    set_paused: Callable[[bool], None]
    abort_requests: Callable[[], object]
    reset_prefix_cache: Callable[[], object]


class WeightUpdater:
    """The weight-update protocol of one engine: versions, staging, begin/commit/abort.

    Args:
        runner: the engine's model runner, whose parameters and shadows are updated.
        hooks: how the updater reaches the engine (its thread, pause flag, requests, cache).

    Attributes:
        version: the version of the weights in use (0 until the first update).
    """

    def __init__(self, runner: ModelRunner, hooks: EngineHooks):
        self.runner = runner
        self._hooks = hooks
        self.version = 0
        self._update: tuple[str, str, bool] | None = None  # (transfer id, mode, we paused)
        self._blocked: str | None = None  # why requests are refused (interrupted inplace update)
        self._blocked_resume = False  # whether repairing the weights should resume stepping

    def check_serving(self) -> None:
        """Raise unless the weights can serve requests.

        Raises:
            EngineUnavailableError: the weights were discarded by ``sleep(level=2)``, or an
                in-place update is in progress or was interrupted.
        """
        if self.runner.weights_discarded:
            raise EngineUnavailableError(
                "the weights were discarded by sleep(level=2); load new ones with "
                "/update_weights first"
            )
        if self._blocked is not None:
            raise EngineUnavailableError(self._blocked)

    # --------------------------------------------------------------------- whole sets

    def load(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int | None = None,
        partial: bool = False,
    ) -> int:
        """Stage new weights, then switch to them atomically between two decode steps.

        This is the hook weight-transfer transports feed: tensors are validated and copied to
        a staging area while decoding continues; the switch itself is one in-place copy done
        on the engine thread between steps, after which every new token reports the new
        version. The prefix cache is dropped (its keys and values belong to the old weights);
        in-flight sequences keep their KV and continue under the new weights.

        Args:
            named_tensors: ``(name, tensor)`` pairs named like ``model.named_parameters()``.
            version: the new weight version (default: current + 1).
            partial: allow updating a subset of the parameters.

        Returns:
            The new weight version.

        Raises:
            InvalidRequestError: unknown names, wrong shapes, missing parameters, bad version.
        """
        if version is not None and (
            not isinstance(version, int) or isinstance(version, bool) or version < 0
        ):
            raise InvalidRequestError(
                f"weight version must be an int >= 0, got {version!r}", param="version"
            )
        if partial and self.runner.weights_discarded:
            raise InvalidRequestError(
                "the weights were discarded by sleep(level=2); a partial update cannot "
                "restore them, send every parameter",
                param="partial",
            )
        self._check_not_streaming()
        with _STAGE_LOCK:  # the shadows are shared by every staging path
            staged = self.runner.stage_weights(named_tensors, partial=partial)
            return self._switch(staged, version)

    def load_dir(self, path: str | os.PathLike[str], version: int | None = None) -> int:
        """Load all weights of a HF model directory (safetensors) and switch to them.

        Returns:
            The new weight version.
        """
        self._check_not_streaming()
        with _STAGE_LOCK:
            staged = self.runner.load_dir(path)
            return self._switch(staged, version)

    def _switch(self, staged: dict[str, torch.Tensor], version: int | None) -> int:
        def run() -> int:
            self.runner.apply_weights(staged)
            self.version = self.version + 1 if version is None else version
            self._hooks.reset_prefix_cache()
            if self._blocked is not None and self._update is None:
                params = self.runner._params
                if len({id(params[n]) for n in staged}) == len({id(p) for p in params.values()}):
                    self._unblock()  # a complete set repairs an interrupted in-place update
            return self.version

        return self._hooks.between_steps(run).result()

    def _unblock(self) -> None:
        self._blocked = None
        if self._blocked_resume:
            self._hooks.set_paused(False)
        self._blocked_resume = False

    def _check_not_streaming(self) -> None:
        if self._update is not None:
            raise InvalidRequestError(
                f"streamed weight transfer {self._update[0]} is in progress; retry after it "
                "commits or aborts",
                param="weights",
            )

    # ---------------------------------------------------------------- streamed updates

    def begin(self, transfer_id: str, mode: str = "staged", inflight: str = "keep") -> None:
        """Start a streamed update (superseding any unfinished one).

        Args:
            transfer_id: the transfer's id.
            mode: ``staged`` (atomic: shadows, decoding goes on) or ``inplace`` (bounded
                memory: the engine is paused and the live parameters are overwritten).
            inflight: ``keep`` running requests (async RL; ``inplace`` can only pause them),
                ``pause`` stepping until the switch, or ``abort`` in-flight requests (on-policy).
        """
        if mode not in ("staged", "inplace"):
            raise InvalidRequestError(
                f"weight update mode {mode!r}; expected 'staged' or 'inplace'", param="mode"
            )
        if inflight not in ("keep", "pause", "abort"):
            raise InvalidRequestError(
                f"in-flight policy {inflight!r}; expected 'keep', 'pause' or 'abort'",
                param="inflight",
            )
        if self.runner.offloaded:
            raise InvalidRequestError(
                "the weights are offloaded (sleep level 1); wake_up(tags=['weights']) first",
                param="weights",
            )
        pause = mode == "inplace" or inflight != "keep"

        def run() -> None:
            if inflight == "abort":
                self._hooks.abort_requests()
            previous = self._update
            # Whether stepping was paused before any update paused it (by the user).
            user_paused = False if (previous and previous[2]) else self._hooks.is_paused()
            if self._blocked is not None:
                # Mixed weights from an interrupted in-place update: nothing may step on them.
                user_paused = user_paused and not self._blocked_resume
                self._blocked_resume = False
                stop = True
            else:
                stop = pause
            if mode == "inplace":
                self._blocked = (
                    f"an in-place weight update ({transfer_id}) is in progress; retry once it "
                    "commits"
                )
            # Remember whether *we* paused, so commit/abort resumes only what they stopped.
            self._update = (transfer_id, mode, not user_paused)
            self._hooks.set_paused(True if stop else user_paused)

        self._hooks.between_steps(run).result()

    def destination(self, transfer_id: str, name: str) -> torch.Tensor:
        """Where the bytes of parameter ``name`` go in update ``transfer_id`` (contiguous)."""
        update = self._update
        if update is None or update[0] != transfer_id:
            raise InvalidRequestError(
                f"weight transfer {transfer_id} is not in progress on this engine "
                f"(current: {update[0] if update else None})",
                param="weights",
            )
        if update[1] == "staged":
            return self.runner.shadow(name)
        return self.runner.live(name)

    def shared_destinations(self, transfer_id: str) -> dict[str, Any] | None:
        """Offer the shadows of staged update ``transfer_id`` as a shared arena, or ``None``.

        A same-host sender then writes every parameter straight into its shadow (one copy);
        see :meth:`ModelRunner.shared_shadows` for the layout and when it is not possible.
        """
        update = self._update
        if update is None or update[0] != transfer_id:
            raise InvalidRequestError(
                f"weight transfer {transfer_id} is not in progress on this engine",
                param="weights",
            )
        if update[1] != "staged":
            return None  # in place: the live weights are not offered to another process
        return self.runner.shared_shadows()

    def commit(
        self,
        transfer_id: str,
        names: Sequence[str],
        version: int | None = None,
        partial: bool = False,
    ) -> int:
        """Switch to the update's tensors between two steps; return the new version.

        Raises:
            InvalidRequestError: not the update in progress, or parameters missing (named).
        """
        update = self._update
        if update is None or update[0] != transfer_id:
            raise InvalidRequestError(
                f"weight transfer {transfer_id} is not in progress on this engine",
                param="weights",
            )
        params = self.runner._params
        covered = {id(params[n]) for n in names if n in params}
        missing = [n for n in self.runner._unique_names if id(params[n]) not in covered]
        if missing and not partial:
            self.abort(transfer_id, f"{len(missing)} parameter(s) never arrived")
            raise InvalidRequestError(
                f"{len(missing)} parameter(s) missing from weight transfer {transfer_id}, e.g. "
                f"{missing[:3]}; the old weights keep serving"
                + (
                    " (in-place: requests are refused until an update completes)"
                    if update[1] == "inplace"
                    else ""
                ),
                param="weights",
            )

        def run() -> int:
            if self._update is None or self._update[0] != transfer_id:
                raise InvalidRequestError(
                    f"weight transfer {transfer_id} was superseded", param="weights"
                )
            if update[1] == "staged":
                self.runner.swap_in(names)
            else:
                self.runner.mark_weights_changed()
            self.version = self.version + 1 if version is None else version
            self._hooks.reset_prefix_cache()
            resume = self._update[2]
            self._update = None
            if self._blocked is not None and (update[1] == "inplace" or not missing):
                self._blocked = None
            if resume and self._blocked is None:
                self._hooks.set_paused(False)
            elif self._blocked is not None:
                self._blocked_resume = resume
            return self.version

        return self._hooks.between_steps(run).result()

    def abort(self, transfer_id: str | None, reason: str) -> bool:
        """Drop update ``transfer_id`` (any when ``None``); True if one was in progress.

        Staged: the old weights keep serving. In-place: the live weights may be partly
        overwritten, so requests are refused (503, with ``reason``) until an update commits.
        """

        def run() -> bool:
            update = self._update
            if update is None or (transfer_id is not None and update[0] != transfer_id):
                return False
            self._update = None
            if update[1] == "inplace" or self._blocked is not None:
                if update[1] == "inplace":
                    self.runner.mark_weights_changed()
                    self._blocked = (
                        f"the in-place weight update {update[0]} was interrupted ({reason}); "
                        "the weights are incomplete, so this replica refuses requests until a "
                        f"weight update completes (still version {self.version})"
                    )
                self._blocked_resume = update[2]
            elif update[2]:
                self._hooks.set_paused(False)
            return True

        return bool(self._hooks.between_steps(run).result())
