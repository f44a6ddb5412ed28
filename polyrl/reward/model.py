"""Scalar reward models: a Hugging Face sequence-classification checkpoint scores responses.

Any ``AutoModelForSequenceClassification`` directory with ``num_labels=1`` works (e.g.
``Qwen2ForSequenceClassification``, what a reward-model trainer exports): the score of a text is
the model's single logit, which Hugging Face takes at the last token that is not padding.

The text a response is scored as is :func:`reward_model_text`: the prompt's chat messages plus
the response as the assistant's turn, rendered with the reward model's own chat template (its
tokenizer may differ from the policy's) up to the turn's end-of-sequence token; without a chat
template, or for a plain-string prompt, the prompt text, the response and the end-of-sequence
token. This is the text ``polyrl rm`` trains on, so a model it exported scores what it learned.

:class:`RewardModelProcess` runs the model in a worker process of its own (started with
``spawn``), so the driver's process imports no model code for it and a crash there is an
error, not the end of the run; :class:`SequenceRewardModel` is the same model in the calling
process.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["RewardModelProcess", "SequenceRewardModel", "reward_model_text"]


def reward_model_text(tokenizer: Any, prompt: Any, response: str) -> str:
    """Render ``prompt`` (chat messages or a string) and ``response`` for the reward model.

    The text is what ``polyrl rm`` trains on (:func:`~polyrl.trainer.preference_data.
    tokenize_completion`), so the score is read at the same token, the end-of-sequence one:

    * chat messages and a tokenizer with a chat template: the conversation with the response
      appended as the assistant's message, rendered by the template and cut after its last
      end-of-sequence token (what a template adds after the turn's end, e.g. a newline, is
      dropped);
    * otherwise the prompt's text (a string, or message contents joined by newlines), the
      response and the end-of-sequence token (unless the response already ends with it).
    """
    eos = getattr(tokenizer, "eos_token", None) or ""
    if isinstance(prompt, Sequence) and not isinstance(prompt, str):
        messages = [dict(m) for m in prompt if isinstance(m, Mapping)]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [*messages, {"role": "assistant", "content": response}], tokenize=False
            )
            end = text.rfind(eos) if eos else -1
            return text[: end + len(eos)] if end >= 0 else text
        prompt = "\n".join(str(m.get("content", "")) for m in messages)
    text = f"{prompt or ''}{response}"
    return text if text.endswith(eos) else text + eos


class SequenceRewardModel:
    """A sequence-classification reward model in this process, scoring texts in batches.

    Args:
        path: local Hugging Face directory of a ``*ForSequenceClassification`` model with
            ``num_labels=1``.
        device: ``"cpu"``, ``"cuda"`` or ``"auto"`` (CUDA when available).
        dtype: parameter dtype name (``"float32"``, ``"bfloat16"``...).
        batch_size: texts per forward pass.
        max_length: texts are cut to this many tokens (from the left: the response's end,
            where the score is read, is kept).
        trust_remote_code: allow modelling code shipped in the directory.

    Raises:
        ValueError: If the checkpoint has more than one label (not a scalar reward model).
    """

    def __init__(
        self,
        path: str,
        *,
        device: str = "auto",
        dtype: str = "float32",
        batch_size: int = 16,
        max_length: int = 4096,
        trust_remote_code: bool = False,
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from polyrl.core.dtypes import resolve_dtype

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                path, trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"reward model {path!r}: cannot load its tokenizer ({exc}); save the tokenizer "
                "the reward model was trained with into the same directory"
            ) from None
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code
        )
        labels = int(getattr(self.model.config, "num_labels", 1))
        if labels != 1:
            raise ValueError(
                f"reward model {path!r} has num_labels={labels}; a scalar reward model "
                "(num_labels=1, e.g. Qwen2ForSequenceClassification) is needed"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # Right padding: position ids then match the unpadded text's, and Hugging Face reads the
        # score at the last token that is not padding.
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        self.model.to(self.device).eval()

    def render(self, prompt: Any, response: str) -> str:
        """:func:`reward_model_text` with this model's tokenizer."""
        return reward_model_text(self.tokenizer, prompt, response)

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """Score each text (one float per text, in order)."""
        import torch

        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start : start + self.batch_size])
            enc = self.tokenizer(
                chunk,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(self.device)
            with torch.no_grad():
                logits = self.model(**enc).logits
            out.extend(float(x) for x in logits[:, 0].float().cpu())
        return out

    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[float]:
        """Score each (prompt, response) pair, rendered by :meth:`render`."""
        return self.score_texts(
            [self.render(p, r) for p, r in zip(prompts, responses, strict=True)]
        )


def _serve(conn: Connection, kwargs: dict[str, Any]) -> None:
    try:
        import torch

        torch.set_num_threads(max(1, int(kwargs.pop("num_threads", 0)) or torch.get_num_threads()))
        model = SequenceRewardModel(**kwargs)
    except BaseException:
        conn.send(("error", traceback.format_exc(limit=-4)))
        return
    conn.send(("ready", str(model.device)))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            return
        try:
            conn.send(("ok", model.score(message[1], message[2])))
        except BaseException:
            conn.send(("error", traceback.format_exc(limit=-4)))


class RewardModelProcess:
    """A :class:`SequenceRewardModel` served by a worker process of its own.

    Takes :class:`SequenceRewardModel`'s keywords, plus ``num_threads`` (CPU threads of the
    worker; 0 keeps torch's default) and ``startup_timeout_s``. The model loads while the caller
    goes on; the first :meth:`score` waits for it.

    Raises:
        RuntimeError: (from :meth:`score`) the model failed to load or to score; the message
            holds the worker's traceback.
    """

    def __init__(self, path: str, *, startup_timeout_s: float = 600.0, **kwargs: Any) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self.path = path
        self.startup_timeout_s = float(startup_timeout_s)
        self._proc = ctx.Process(
            target=_serve,
            args=(child, {"path": path, **kwargs}),
            daemon=True,
            name="polyrl-reward-model",
        )
        self._proc.start()
        child.close()
        self._ready = False
        #: Where the model runs (``"cpu"``, ``"cuda"``...), once it has loaded.
        self.device = ""

    def _receive(self, timeout: float | None) -> tuple[str, Any]:
        if not self._conn.poll(timeout):
            raise RuntimeError(
                f"the reward model worker ({self.path}) did not answer within {timeout} s"
            )
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.exitcode
            raise RuntimeError(
                f"the reward model worker ({self.path}) died (exit code {code})"
            ) from None

    def wait_ready(self) -> None:
        """Block until the model has loaded (raise if it could not)."""
        if self._ready:
            return
        kind, payload = self._receive(self.startup_timeout_s)
        if kind != "ready":
            raise RuntimeError(f"the reward model {self.path!r} failed to load:\n{payload}")
        self._ready, self.device = True, payload

    def score(self, prompts: Sequence[Any], responses: Sequence[str]) -> list[float]:
        """Score each (prompt, response) pair in the worker (as SequenceRewardModel.score)."""
        self.wait_ready()
        self._conn.send(("score", list(prompts), list(responses)))
        kind, payload = self._receive(None)
        if kind != "ok":
            raise RuntimeError(f"the reward model {self.path!r} failed to score:\n{payload}")
        return list(payload)

    def close(self) -> None:
        """Stop the worker process."""
        if self._proc.is_alive():
            try:
                self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
            # It holds nothing that needs an orderly exit: do not wait on torch's teardown.
            self._proc.join(timeout=1)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        self._conn.close()
