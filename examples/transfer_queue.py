"""The transfer queue on its own: producers put samples, consumers get the ones they need.

What it shows: ``polyrl.transfer.make_transfer_queue`` (``"local"``: one process, no Ray;
``"ray"``: a controller actor and storage-unit actors, the same API). A rollout-like producer
puts prompts and responses for one step (a *partition*); a "reference" consumer waits for those
fields, computes a new column and puts it back onto the same samples; an "actor" consumer then
asks for samples where both are ready, whole groups at a time (``sampler="group"``). Each
consumer gets a sample at most once. Rows travel as :class:`polyrl.core.batch.Batch` objects;
between steps only :class:`~polyrl.transfer.BatchMeta` references need to be passed around.

Run it::

    python examples/transfer_queue.py                 # local backend
    python examples/transfer_queue.py --backend ray   # starts a local Ray, actors on it

Inside the RL trainer the same queue carries a whole step with ``transfer.enable=true``.
"""

from __future__ import annotations

import argparse

import torch

from polyrl.core.batch import Batch
from polyrl.transfer import make_transfer_queue

GROUP = 4  # responses per prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("local", "ray"), default="local")
    parser.add_argument("--smoke", action="store_true", help="accepted for the tests; no effect")
    args = parser.parse_args()
    if args.backend == "ray":
        import ray

        # address="local" starts a Ray of this process's own (ray.init() alone joins one
        # already running on the machine); pass a cluster address to use a cluster.
        ray.init(address="local", num_cpus=2, include_dashboard=False)
        queue = make_transfer_queue("ray", num_storage_units=2)
    else:
        queue = make_transfer_queue("local")

    # Producer: 3 prompts x GROUP responses; "uid" is the group key the group sampler reads.
    rows = 3 * GROUP
    batch = Batch(
        tensors={
            "input_ids": torch.randint(0, 100, (rows, 6)),
            "attention_mask": torch.ones(rows, 6, dtype=torch.long),
        },
        non_tensors={"uid": [f"p{i // GROUP}" for i in range(rows)]},
    )
    meta = queue.put(batch, partition="step-1")
    print("put", len(meta), "samples, ids", meta.sample_ids[:5], "...")

    # A consumer that adds a column: take samples with input_ids, write ref_log_probs back.
    ref = queue.get_meta(["input_ids"], batch_size=rows, partition="step-1", consumer="ref")
    data = queue.get_data(ref)
    logp = -torch.rand(len(ref), 6)  # stands in for a model's forward pass
    queue.put(Batch(tensors={"ref_log_probs": logp}), "step-1", sample_ids=ref.sample_ids)
    print("ref consumer read", list(data.tensor_keys), "and added ref_log_probs")

    # The trainer-side consumer: two whole groups at a time, once both fields are produced.
    for _ in range(rows // (2 * GROUP)):
        part = queue.get_meta(
            ["input_ids", "ref_log_probs", "uid"],
            batch_size=2 * GROUP,
            partition="step-1",
            consumer="actor",
            sampler="group",
            group_size=GROUP,
            timeout=30,
        )
        rows_in = queue.get_data(part)
        groups = sorted(set(rows_in.non_tensors["uid"]))
        print("actor got groups", groups, "shape", tuple(rows_in["ref_log_probs"].shape))
    left = queue.get_meta(["input_ids"], None, "step-1", "actor")  # all it can have now
    print("actor takes the last", len(left), "samples;", queue.status("step-1")["partitions"])
    queue.clear("step-1")
    queue.close()


if __name__ == "__main__":
    main()
