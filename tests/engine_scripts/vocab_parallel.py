"""One rank of the vocabulary-parallel log-prob check (launched by tests/test_parallel_mesh.py).

Usage: ``vocab_parallel.py OUT_JSON`` on 2 ranks.  Each rank holds an uneven slice of a
7-word vocabulary (4 and 3 columns); log-probs, entropy and the gradient of a weighted sum of
both (temperature 0.7, 3-row chunks) are compared with ``log_softmax`` on the whole fp64 logits.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from engine_common import exit_rank

from polyrl.model_engine.parallel.tensor import VocabShard, vocab_parallel_log_probs


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5))
    g_logp, g_ent = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    temperature = 0.7
    ref_x = logits.clone().requires_grad_()
    lsm = torch.log_softmax(ref_x / temperature, -1)
    ref_logp = lsm.gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = -(lsm.exp() * lsm).sum(-1)
    ((ref_logp * g_logp).sum() + (ref_ent * g_ent).sum()).backward()
    cols = [slice(0, 4), slice(4, 7)][rank]
    x = logits[..., cols].clone().requires_grad_()
    shard = VocabShard(dist.group.WORLD, x.shape[-1])
    logp, ent = vocab_parallel_log_probs(x, labels, shard, temperature, True, chunk_size=3)
    ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
    result = {
        "offset": shard.offset,
        "logp": (logp - ref_logp).abs().max().item(),
        "entropy": (ent - ref_ent).abs().max().item(),
        "grad": (x.grad - ref_x.grad[..., cols]).abs().max().item(),
    }
    with open(f"{sys.argv[1]}.{rank}", "w") as f:
        json.dump(result, f)
    dist.barrier()
    exit_rank(0)


if __name__ == "__main__":
    main()
