"""The core: what every service may import (and the only polyrl code they may import).

``batch`` (the container passed between services), ``numerics`` (masked means, loss
aggregation, token log-probs), ``dtypes``, ``registry``, ``shm``, ``cpu`` and ``http`` (serving
an ASGI app). Nothing here imports a service, the controller or the trainer; ``make lint``
checks that.
"""
