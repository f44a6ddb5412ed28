"""The ``native`` rollout backend: :class:`NativeEngine` behind the async backend interface."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from polyrl.core.rollout_api import (
    BackendStats,
    DeltaStream,
    GenerateRequest,
    ModelInfo,
    RolloutError,
    SampleDelta,
    WeightReceive,
)
from polyrl.rollout.base import check_backend_options, register_backend
from polyrl.rollout.native.engine import NativeEngine, NativeEngineConfig, Sink

__all__ = ["NativeBackend"]


class _EngineFailure(RolloutError):
    """The engine failed while running a request (HTTP 500)."""


@register_backend("native")
class NativeBackend:
    """Async face of the native engine; see :class:`polyrl.core.rollout_api.RolloutBackend`.

    Args:
        model_dir: local HF model directory.
        **options: :class:`NativeEngineConfig` fields.

    Raises:
        TypeError: an option that is not a :class:`NativeEngineConfig` field.
    """

    #: The dataclass whose fields are this backend's options.
    options_class = NativeEngineConfig
    #: Pushed weights stream into the engine's parameters (its shadows, or in place).
    weight_receive: WeightReceive = "stream"

    def __init__(self, model_dir: str | os.PathLike[str], **options: Any):
        check_backend_options("native", NativeEngineConfig, options)
        self.model_dir = str(model_dir)
        self.config = NativeEngineConfig(**options)
        self.engine: NativeEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _engine(self) -> NativeEngine:
        if self.engine is None:
            raise RuntimeError("the native backend is not started; await start() first")
        return self.engine

    @property
    def info(self) -> ModelInfo:
        """The served model."""
        return self._engine().info

    @property
    def weight_version(self) -> int:
        """Version of the weights in use."""
        return self._engine().weight_version

    def _deliver(self, items: list[tuple[Sink, Any]]) -> None:
        # Called on the engine thread once per step: one hop to the event loop for all.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_run_sinks, items)

    async def start(self) -> None:
        """Load the model (in a worker thread) and start the engine thread."""
        if self.engine is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.engine = await asyncio.to_thread(
            NativeEngine, self.model_dir, self.config, self._deliver
        )
        self.engine.start()

    async def shutdown(self) -> None:
        """Abort in-flight requests and stop the engine thread."""
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    async def generate(
        self, request: GenerateRequest, stream: bool = True
    ) -> AsyncIterator[SampleDelta]:
        """Submit ``request`` and return its delta stream.

        Validation errors raise here, before anything is queued. Closing the stream
        (``aclose``) before every sample finished aborts the request.

        Args:
            request: the request.
            stream: deliver tokens as they come; ``False`` delivers each sample once, finished
                (far fewer wake-ups when nobody reads partial output).
        """
        engine = self._engine()
        deltas = DeltaStream(
            request.params.n,
            cancel=lambda: engine.abort([request.request_id]),
            wrap_error=lambda exc: _EngineFailure(f"the engine failed on this request: {exc}"),
        )
        engine.submit(request, deltas.inbox.put_nowait, stream=stream)
        return deltas

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """End in-flight requests (all when ``None``) with ``abort``."""
        return await asyncio.wrap_future(self._engine().abort(request_ids))

    async def pause(self) -> None:
        """Stop stepping once the current step ends."""
        await asyncio.wrap_future(self._engine().pause())

    async def resume(self) -> None:
        """Resume stepping."""
        await asyncio.wrap_future(self._engine().resume())

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        """Release KV cache (and weights); see :meth:`NativeEngine.sleep`."""
        return await asyncio.wrap_future(self._engine().sleep(level))

    async def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Restore what sleep released; see :meth:`NativeEngine.wake_up`."""
        return await asyncio.wrap_future(self._engine().wake_up(tags))

    async def update_weights(self, path: str, version: int | None = None) -> int:
        """Load a safetensors directory and switch to it between two steps."""
        return await asyncio.to_thread(self._engine().update_weights_from_dir, path, version)

    async def load_weights(
        self,
        named_tensors: list[tuple[str, Any]],
        version: int | None = None,
        partial: bool = False,
    ) -> int:
        """Stage tensors and switch to them atomically; see :meth:`NativeEngine.load_weights`."""
        return await asyncio.to_thread(self._engine().load_weights, named_tensors, version, partial)

    def stats(self) -> BackendStats:
        """Counters and gauges of the engine."""
        return self._engine().stats()


def _run_sinks(items: list[tuple[Sink, Any]]) -> None:
    for sink, payload in items:
        sink(payload)
