"""On-policy distillation teachers served by rollout servers (``algorithm.teacher_source=server``).

A teacher scores the student's samples through a rollout server's ``/generate``: each row's
tokens (prompt and response) go in as the *prompt*, with ``prompt_logprobs`` asked and one
token to generate, and the answer's prompt log-probs are the teacher's log-probs of every
token given the ones before it -- what the reference engine role computes for
``ref_log_probs``, so the two sources give the same column. With ``algorithm.teacher_topk=k``
the answer also holds the teacher's ``k`` most likely tokens at each position, the support of
the top-k distillation loss. The native backend and the vLLM backend return prompt log-probs.

Several teachers (``algorithm.teachers``, by ``data_source``) each get their own server; a
teacher named by a model directory gets a server this run starts (one replica, the rollout
backend and options of the policy's replicas), one named by an ``http(s)://`` URL is a running
server (its key, if any, in the environment variable of ``rollout.urls``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from polyrl.config import ConfigError, PolyRLConfig
from polyrl.core.batch import Batch
from polyrl.core.columns import (
    ATTENTION_MASK,
    INPUT_IDS,
    TEACHER_LOG_PROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOG_PROBS,
)
from polyrl.core.rollout_api import SamplingParams

__all__ = ["TeacherServers", "teacher_columns"]


def teacher_columns(
    shape: tuple[int, int],
    starts: Sequence[int],
    scores: Sequence[tuple[Sequence[float | None], Sequence[Sequence[tuple[int, float]]] | None]],
    topk: int,
) -> dict[str, torch.Tensor]:
    """Lay each row's prompt log-probs out as the step's ``(B, T)`` (and ``(B, T, k)``) columns.

    Row ``i``'s real tokens start at column ``starts[i]``; ``scores[i]`` is the server's
    ``(prompt_logprobs, prompt_top_logprobs)`` for them: entry ``j`` scores the token at
    ``starts[i] + j`` (``None`` at ``j = 0``, nothing predicts it; the column holds 0 there and
    on padding, as the engines' log-prob columns do).
    """
    b, t = shape
    out = {TEACHER_LOG_PROBS: torch.zeros(b, t)}
    if topk:
        out[TEACHER_TOPK_IDS] = torch.zeros(b, t, topk, dtype=torch.long)
        out[TEACHER_TOPK_LOG_PROBS] = torch.zeros(b, t, topk)
    for row, (start, (values, tops)) in enumerate(zip(starts, scores, strict=True)):
        if start + len(values) > t:
            raise ValueError(f"row {row}: {len(values)} scores from column {start} exceed {t}")
        body = [0.0 if v is None else float(v) for v in values[1:]]
        out[TEACHER_LOG_PROBS][row, start + 1 : start + len(values)] = torch.tensor(body)
        if topk:
            if tops is None:
                raise ValueError(f"row {row}: the teacher returned no top-k log-probs")
            for j, alts in enumerate(tops[1:], start=start + 1):
                if len(alts) < topk:  # a vocabulary smaller than k: nothing to fill
                    raise ValueError(f"row {row}: {len(alts)} top log-probs, expected {topk}")
                out[TEACHER_TOPK_IDS][row, j] = torch.tensor([a for a, _ in alts[:topk]])
                out[TEACHER_TOPK_LOG_PROBS][row, j] = torch.tensor([v for _, v in alts[:topk]])
    return out


class TeacherServers:
    """The distillation teachers' rollout servers, and the scoring of a step's rows by them.

    Args:
        cfg: the run's configuration (``algorithm.teacher_model_path``, ``teachers``,
            ``teacher_topk``; ``rollout.*`` for the servers this run starts).
        closers: the run's clean-up list; the started servers' stops go onto it.
    """

    def __init__(self, cfg: PolyRLConfig, closers: list[Callable[[], Any]]) -> None:
        from polyrl.rollout.client import RolloutClient
        from polyrl.rollout.options import API_KEY_ENV

        algo = cfg.algorithm
        self.cfg = cfg
        self.topk = algo.teacher_topk
        self.by_source = dict(algo.teachers)
        self.default = algo.teacher_model_path
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="polyrl-teachers", daemon=True
        )
        self._thread.start()
        closers.append(self.close)
        #: Per teacher (model directory or URL): its client and the URLs it asks.
        self.clients: dict[str, Any] = {}
        self.urls: dict[str, list[str]] = {}
        for spec in sorted({*self.by_source.values(), *([self.default] if self.default else [])}):
            if spec.startswith(("http://", "https://")):
                urls, key = [spec], os.environ.get(API_KEY_ENV) or None
            else:
                urls, key = self._start_server(spec, closers)
            client = RolloutClient(urls, api_key=key, max_concurrency=256, health_interval=0.0)
            self._call(client.start())
            self.clients[spec], self.urls[spec] = client, urls
        for client in self.clients.values():
            self._call(client.wait_ready(timeout=300.0))

    def _start_server(
        self, model_dir: str, closers: list[Callable[[], Any]]
    ) -> tuple[list[str], str]:
        from polyrl.rollout.launcher import ServerProcess
        from polyrl.trainer.rl.build import replica_options, run_api_key

        key = run_api_key()
        proc = ServerProcess(
            model_dir,
            backend=self.cfg.rollout.backend,
            api_key=key,
            options=replica_options(self.cfg),
        )
        proc.start()
        closers.append(proc.stop)
        return [str(proc.url)], key

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def teacher_of(self, source: str | None) -> str:
        """Return the teacher (model directory or URL) that scores rows of ``source``.

        Raises:
            ConfigError: no teacher for ``source`` and no default teacher.
        """
        spec = self.by_source.get(str(source)) if source is not None else None
        if spec is None:
            spec = self.default
        if not spec:
            raise ConfigError(
                f"no distillation teacher for data_source {source!r}: add it to "
                f"algorithm.teachers (now for {sorted(self.by_source)}) or set "
                "algorithm.teacher_model_path for the other sources",
                key="algorithm.teachers",
            )
        return spec

    def score(self, batch: Batch, temperature: float) -> Batch:
        """Add the teachers' columns (:func:`teacher_columns`) to ``batch``; return it.

        Log-probs are under ``log_softmax(logits / temperature)``, the temperature the engines
        compute the step's log-probs at (``batch.meta[TEMPERATURE_KEY]``).
        """
        ids, attn = batch[INPUT_IDS], batch[ATTENTION_MASK]
        sources = batch.non_tensors.get("data_source")
        params = SamplingParams(
            max_new_tokens=1, temperature=temperature, seed=0, prompt_logprobs=self.topk
        )
        spans: list[tuple[int, int]] = []
        teachers: list[str] = []
        for row in range(ids.shape[0]):
            on = attn[row].nonzero().flatten()
            spans.append((int(on[0]), int(on[-1]) + 1) if on.numel() else (0, 0))
            teachers.append(self.teacher_of(None if sources is None else sources[row]))
        starts = [start for start, _ in spans]

        async def gather() -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        self.clients[spec].generate(ids[row, start:end].tolist(), params)
                        for row, (spec, (start, end)) in enumerate(
                            zip(teachers, spans, strict=True)
                        )
                    )
                )
            )

        results = self._call(gather())
        scores = []
        for row, res in enumerate(results):
            if res.prompt_logprobs is None:
                raise RuntimeError(
                    f"the teacher server at {res.replica} returned no prompt log-probs for row "
                    f"{row}; it needs a backend that returns them (native or vllm)"
                )
            scores.append((res.prompt_logprobs, res.prompt_top_logprobs))
        for name, column in teacher_columns(tuple(ids.shape), starts, scores, self.topk).items():
            batch[name] = column
        return batch

    def close(self) -> None:
        """Close the clients and the event loop (the started servers stop through closers)."""
        loop = self._loop
        if loop.is_closed():
            return
        for client in self.clients.values():
            try:
                self._call(client.close())
            except Exception:  # best effort at shutdown
                pass
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=5)
        loop.close()
