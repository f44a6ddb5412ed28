"""Model parallelism of the training engine beyond FSDP (expert parallelism: :mod:`.expert`)."""
