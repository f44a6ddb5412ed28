"""The rollout server's routers, one module per concern.

:func:`~polyrl.rollout.server.create_app` assembles them:

* :mod:`~polyrl.rollout.routes.generation` -- ``/generate`` (batched or streamed), ``/abort``;
* :mod:`~polyrl.rollout.routes.openai` -- ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions``;
* :mod:`~polyrl.rollout.routes.admin` -- ``/health``, ``/metrics``, ``/pause``, ``/resume``,
  ``/sleep``, ``/wake_up``, ``/update_weights``;
* :mod:`~polyrl.rollout.routes.common` -- what they share: error bodies, JSON bodies, SSE,
  :class:`~polyrl.rollout.routes.common.BearerAuth` and the in-flight request table.
"""
