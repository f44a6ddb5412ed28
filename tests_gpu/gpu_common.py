"""Helpers shared by the GPU tests (kept out of conftest so tests can import them)."""

from __future__ import annotations

import threading


def run_engine(
    engine, requests, timeout: float = 120.0, logprobs: dict[str, list[float]] | None = None
) -> dict[str, list[int]]:
    """Submit ``requests`` (one sample each) to a started native engine; wait for all.

    Returns each request's generated token ids by request id; with ``logprobs`` (a dict),
    fills it with each request's token log-probs (requests asked with ``logprobs=True``).
    """
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    left = [len(requests)]
    done = threading.Event()
    errors: list[BaseException] = []

    def sink_for(rid: str):
        def sink(payload):
            if isinstance(payload, BaseException):
                errors.append(payload)
                done.set()
                return
            for delta in payload:
                out[rid].extend(delta.token_ids)
                if logprobs is not None and delta.logprobs:
                    logprobs.setdefault(rid, []).extend(delta.logprobs)
                if delta.finish_reason is not None:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        return sink

    for r in requests:
        engine.submit(r, sink_for(r.request_id), stream=False)
    assert done.wait(timeout), "the native engine did not finish in time"
    assert not errors, errors
    return out
