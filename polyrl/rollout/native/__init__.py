"""polyrl's own rollout engine: continuous batching over a paged KV cache for HF causal LMs.

Importing this package loads torch and transformers; the HTTP layer reaches it through the
``native`` entry of :func:`polyrl.rollout.base.create_backend`.
"""

from polyrl.rollout.native.engine import NativeEngine, NativeEngineConfig

__all__ = ["NativeEngine", "NativeEngineConfig"]
