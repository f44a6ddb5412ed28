"""Parallelism of the FSDP2 engine beyond data parallelism.

One device mesh for the tensor and sequence axes (:mod:`.mesh`, :mod:`.tensor`,
:mod:`.ulysses`) and expert parallelism (:mod:`.expert`).
"""
