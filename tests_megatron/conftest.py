"""tests_megatron: the Megatron-Core backend, on CPU over gloo; skipped without megatron-core."""
