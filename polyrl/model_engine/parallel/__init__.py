"""Parallelism of the FSDP2 engine beyond data parallelism (one device mesh for all axes)."""
