"""The Megatron-Core model-engine backend (``engine.backend=megatron``) and its HF converter.

:mod:`.convert` is pure torch and always importable; :mod:`.engine` and :mod:`.cpu_patches` need
the optional ``megatron`` extra (``pip install polyrl[megatron]``, megatron-core 0.16.1).
"""
