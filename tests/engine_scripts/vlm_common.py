"""Batches and reference log-probs for the model engine's vision-language tests.

Shared by tests/test_engine_vlm.py and the world-size-2 rank script vlm_rank.py, so both build
the very same batch.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from polyrl.core.batch import Batch
from polyrl.core.columns import MULTI_MODAL
from polyrl.core.rollout_batch import build_rollout_batch


def vlm_batch(proc) -> Batch:
    """Four RL rows: two image prompts (different sizes), a text prompt, a second sample of row 0.

    Prompts left-padded, responses right-padded (build_rollout_batch); the ``multi_modal`` column
    holds each row's inputs, the two samples of prompt 0 the same object.
    """
    img = proc.token_ids["image"]
    a_ids, a_mm = proc.encode([5, img, 7, 8], images=[Image.new("RGB", (56, 56), (200, 30, 30))])
    b_ids, b_mm = proc.encode(
        [img, 9, 10, 11, 12, 13], images=[Image.new("RGB", (112, 56), (10, 90, 240))]
    )
    c_ids = [14, 15, 16]
    prompts = [a_ids, b_ids, c_ids, a_ids]
    responses = [[20, 21, 22], [23, 24], [25, 26, 27, 28, 29], [30, 31, 32, 33]]
    batch = build_rollout_batch(prompts, responses, pad_token_id=0)
    column = np.empty(4, dtype=object)
    column[:] = [a_mm, b_mm, None, a_mm]
    keep = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "loss_mask")}
    return Batch(tensors=keep, non_tensors={MULTI_MODAL: column})


def reference_log_probs(model, proc, batch: Batch) -> torch.Tensor:
    """Per-token log-probs ``(B, T)`` from the HF model's own forward, one row at a time.

    Each row's real tokens alone and its media in the stock processor's layout
    (:func:`hf_media`); 0 on padding and on each row's first token, like the engine.
    """
    ids, am = batch["input_ids"], batch["attention_mask"].bool()
    out = torch.zeros(ids.shape, dtype=torch.float32)
    column = batch[MULTI_MODAL]
    with torch.no_grad():
        for row in range(ids.shape[0]):
            cols = am[row].nonzero().view(-1)
            x = ids[row, cols].view(1, -1)
            mm = column[row]
            kwargs = {} if mm is None else hf_media(proc, x, mm)
            logits = model(input_ids=x, **kwargs).logits.float()[0]
            logp = torch.log_softmax(logits[:-1], -1).gather(1, x[0, 1:, None]).squeeze(1)
            out[row, cols[1:]] = logp
    return out


def hf_media(proc, ids: torch.Tensor, mm) -> dict:
    """A prompt's media as transformers' own processor gives them to the model's forward.

    Qwen2-VL: the tensors plus ``mm_token_type_ids`` (the model computes its own M-RoPE
    positions). SmolVLM: ``pixel_values`` of shape ``(1, tiles, 3, S, S)``, one batch row.
    """
    if proc.model_type == "smolvlm":
        return {"pixel_values": mm.tensors["pixel_values"].unsqueeze(0)}
    types = torch.zeros_like(ids)
    types[ids == proc.token_ids["image"]] = 1
    types[ids == proc.token_ids.get("video", -1)] = 2
    return {"mm_token_type_ids": types, **mm.tensors}
