"""Operating a replica: health, metrics, pause/resume, sleep/wake-up, reloading weights.

``GET /health`` (the one endpoint open without the bearer token), ``GET /metrics`` (Prometheus
text), ``POST /pause``, ``POST /resume``, ``POST /sleep``, ``POST /wake_up`` and
``POST /update_weights`` (a safetensors directory; streamed transfers are the ``/weights/*``
routes of :mod:`polyrl.weights`, added by whoever composes the app).
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from polyrl.core.http_guard import json_request_body
from polyrl.core.rollout_api import BackendStats, InvalidRequestError, ModelInfo, RolloutBackend
from polyrl.rollout.routes.common import json_body, json_object
from polyrl.rollout.schemas import SleepBody, UpdateWeightsBody, WakeUpBody, check_body

__all__ = ["admin_router", "render_metrics"]


def render_metrics(stats: BackendStats, info: ModelInfo) -> str:
    """Prometheus text exposition of a backend's stats."""
    label = f'model="{info.model}",backend="{info.backend}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float, extra: str = "") -> None:
        full = f"polyrl_rollout_{name}"
        if not any(line.startswith(f"# HELP {full} ") for line in lines):
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
        labels = label + (f",{extra}" if extra else "")
        lines.append(f"{full}{{{labels}}} {value}")

    metric("requests_running", "gauge", "Sequences admitted to the running batch.", stats.running)
    metric("requests_waiting", "gauge", "Sequences queued for admission.", stats.waiting)
    metric("paused", "gauge", "1 while stepping is paused.", int(stats.paused))
    metric("sleeping", "gauge", "1 while KV cache or weights are released.", int(stats.sleeping))
    metric("weight_version", "gauge", "Version of the weights in use.", stats.weight_version)
    metric("prompt_tokens_total", "counter", "Prompt tokens received.", stats.prompt_tokens_total)
    metric("generated_tokens_total", "counter", "Tokens generated.", stats.generated_tokens_total)
    metric(
        "generation_tokens_per_second",
        "gauge",
        "Generated tokens per second over the last few seconds.",
        round(stats.generated_tokens_per_s, 3),
    )
    metric("kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.", stats.kv_cache_usage)
    metric("kv_cache_blocks_total", "gauge", "KV-cache blocks.", stats.kv_cache_blocks_total)
    metric("kv_cache_blocks_used", "gauge", "KV-cache blocks held.", stats.kv_cache_blocks_used)
    metric("kv_cache_bytes", "gauge", "Bytes of KV-cache memory held.", stats.kv_cache_bytes)
    metric("weight_bytes", "gauge", "Bytes of weights on the device.", stats.weight_bytes)
    metric(
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        stats.prefix_cache_hit_tokens_total,
    )
    metric("preemptions_total", "counter", "Sequences preempted.", stats.preemptions_total)
    metric("engine_steps_total", "counter", "Engine steps run.", stats.steps_total)
    for reason in ("stop", "length", "abort"):
        metric(
            "requests_finished_total",
            "counter",
            "Samples finished, by reason.",
            stats.finished_total.get(reason, 0),
            f'finish_reason="{reason}"',
        )
    metric(
        "time_to_first_token_seconds_sum",
        "counter",
        "Sum of times from arrival to first token.",
        round(stats.ttft_seconds_sum, 6),
    )
    metric(
        "time_to_first_token_seconds_count",
        "counter",
        "Requests that produced a first token.",
        stats.ttft_count,
    )
    return "\n".join(lines) + "\n"


def _sleep_level(body: dict[str, Any]) -> int:
    level = body.get("level", 1)
    if level not in (1, 2) or isinstance(level, bool):
        raise InvalidRequestError(f"level must be 1 or 2, got {level!r}", param="level")
    return int(level)


def _check_update(body: dict[str, Any]) -> None:
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise InvalidRequestError("path must name a weights directory", param="path")


def admin_router(backend: RolloutBackend) -> APIRouter:
    """Build the router of the health, metrics and control endpoints of ``backend``."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, Any]:
        s = backend.stats()
        i = backend.info
        return {
            "status": "ok",
            "model": i.model,
            "backend": i.backend,
            "weight_version": s.weight_version,
            "paused": s.paused,
            "sleeping": s.sleeping,
            "running": s.running,
            "waiting": s.waiting,
            "max_model_len": i.max_model_len,
            "vocab_size": i.vocab_size,
            "eos_token_ids": list(i.eos_token_ids),
            "pid": os.getpid(),
        }

    @router.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            render_metrics(backend.stats(), backend.info), media_type="text/plain; version=0.0.4"
        )

    @router.post("/pause")
    async def pause() -> dict[str, Any]:
        await backend.pause()
        return {"paused": True}

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        await backend.resume()
        return {"paused": False}

    @router.post("/sleep", openapi_extra=json_request_body(SleepBody, required=False))
    async def sleep(request: Request) -> dict[str, Any]:
        body = json_object(await json_body(request, required=False), "/sleep")
        check_body(SleepBody, body, "/sleep", _sleep_level)
        return await backend.sleep(_sleep_level(body))

    @router.post("/wake_up", openapi_extra=json_request_body(WakeUpBody, required=False))
    async def wake_up(request: Request) -> dict[str, Any]:
        body = json_object(await json_body(request, required=False), "/wake_up")
        check_body(WakeUpBody, body, "/wake_up")
        tags = body.get("tags")
        if tags is not None and not (
            isinstance(tags, list) and all(isinstance(t, str) for t in tags)
        ):
            raise InvalidRequestError("tags must be a list of strings", param="tags")
        return await backend.wake_up(tags)

    @router.post("/update_weights", openapi_extra=json_request_body(UpdateWeightsBody))
    async def update_weights(request: Request) -> dict[str, Any]:
        body = json_object(await json_body(request), "/update_weights")
        check_body(UpdateWeightsBody, body, "/update_weights", _check_update)
        unknown = set(body) - {"path", "version"}
        if unknown:
            raise InvalidRequestError(
                f"unknown field(s) {sorted(unknown)} for /update_weights; expected path, version",
                param=sorted(unknown)[0],
            )
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise InvalidRequestError("path must name a weights directory", param="path")
        version = body.get("version")
        if version is not None and (
            not isinstance(version, int) or isinstance(version, bool) or version < 0
        ):
            raise InvalidRequestError(
                f"version must be an int >= 0, got {version!r}", param="version"
            )
        return {"weight_version": await backend.update_weights(path, version)}

    return router
