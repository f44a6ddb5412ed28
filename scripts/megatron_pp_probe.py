"""Probe: megatron-core 0.16.1's pipeline schedule (1F1B, PP 2) on CPU over gloo.

Not used by polyrl (its Megatron engine refuses pipeline_model_parallel_size > 1): a record of
what stops Megatron's pipeline schedules on CPU and that they run once it is stood in.  Beyond
polyrl's :mod:`~polyrl.model_engine.megatron.cpu_patches`, three CUDA uses of 0.16.1 stop it:

* ``pipeline_parallel/schedules.py`` line 2138 (and 596, 983 in the other schedules):
  ``torch.zeros([], dtype=torch.int, device="cuda")``, a literal device;
* ``pipeline_parallel/p2p_communication.py`` lines 313 / 321: receive buffers on
  ``torch.cuda.current_device()``;
* the same file, line 398 (242 on the variable-shape path): ``torch.cuda.synchronize()``.

``--pp 2`` (two ranks) builds a random-init 2-layer GPT split in two stages, saves each stage's
weights to ``--dir`` and runs one forward/backward of 2 micro-batches; ``--pp 1`` (one rank)
loads both stages into one model and runs the same.  Compare the printed losses and grad norms.

    torchrun --nproc-per-node 2 scripts/megatron_pp_probe.py --pp 2 --dir /tmp/pp
    torchrun --nproc-per-node 1 scripts/megatron_pp_probe.py --pp 1 --dir /tmp/pp
"""

from __future__ import annotations

import argparse
import os
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from polyrl.model_engine.megatron import cpu_patches
from polyrl.model_engine.megatron.engine import PLAIN_KERNELS

SEQ, MICRO_BATCH, MICRO_BATCHES, VOCAB = 16, 2, 2, 128


class _CudaForPipelines(cpu_patches._CpuCuda):
    def synchronize(self, device: Any = None) -> None:
        """No-op: gloo's send/recv have completed when their requests are waited on."""


class _TorchForSchedules(cpu_patches._TorchOnCpu):
    def __init__(self) -> None:
        super().__init__()
        self.cuda = _CudaForPipelines()

    def zeros(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``torch.zeros`` with the schedules' literal ``device="cuda"`` on the CPU."""
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _build(pp: int) -> Any:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **PLAIN_KERNELS,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=64,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        position_embedding_type="rope",
    )
    model.model_type = ModelType.encoder_or_decoder
    return model


def _loss(mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
    loss = (output.float() * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


def _forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
    ids = next(data)
    positions = torch.arange(SEQ).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    out = model(ids, positions, attention_mask=None, labels=labels)
    return out, partial(_loss, torch.ones_like(ids, dtype=torch.float32))


def main() -> None:
    """Run the probe on this rank (``torchrun`` sets the rank and world size)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, choices=(1, 2), required=True)
    parser.add_argument("--dir", required=True, help="where the PP 2 run leaves its weights")
    args = parser.parse_args()
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cpu_patches.apply()
    import megatron.core.pipeline_parallel.p2p_communication as p2p
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.pipeline_parallel import get_forward_backward_func

    stand_in = _TorchForSchedules()
    p2p.torch = stand_in
    schedules.torch = stand_in

    model = _build(args.pp)
    if args.pp == 2:
        os.makedirs(args.dir, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.dir, f"stage_{rank}.pt"))
    else:
        full = dict(torch.load(os.path.join(args.dir, "stage_0.pt")))
        for name, value in torch.load(os.path.join(args.dir, "stage_1.pt")).items():
            # Layer numbering is per stage: stage 1's layer 0 is the whole model's layer 1.
            full[name.replace("decoder.layers.0.", "decoder.layers.1.")] = value
        model.load_state_dict(full, strict=True)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen) for _ in range(2)]
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=MICRO_BATCHES,
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
        forward_only=False,
    )
    square = torch.tensor(sum(float(p.grad.norm()) ** 2 for p in model.parameters()))
    dist.all_reduce(square)
    print(
        f"rank {rank} pp={args.pp} losses={[float(x['loss']) for x in losses]} "
        f"grad_norm={float(square) ** 0.5:.8f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
