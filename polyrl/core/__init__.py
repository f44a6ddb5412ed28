"""The core: what every service may import (and the only polyrl code they may import).

``batch`` (the container passed between services), ``numerics`` (masked means, loss
aggregation, token log-probs), ``dtypes``, ``registry``, ``shm``, ``cpu``, ``http`` (serving
an ASGI app) and ``process`` (free ports, child process groups). Nothing here imports a
service, the controller or the trainer; ``make lint`` checks that.
"""
