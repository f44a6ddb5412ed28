"""Rollout replicas as Ray actors: one worker group whose leader ranks each run a replica server.

On Ray the RL trainer does not start replica servers as children of the driver: it starts a
:class:`~polyrl.controller.WorkerGroup` of :class:`RolloutReplicaWorker` ranks placed by a
:class:`~polyrl.controller.ResourcePool`, so replicas run on whichever node of the cluster the
pool's bundles land on. Each rank reports the node and GPUs Ray gave it
(:meth:`RolloutReplicaWorker.placement`); :func:`replica_plans` turns that into one plan per
replica (which rank leads it, the ``CUDA_VISIBLE_DEVICES`` of its server); the leader of each
replica then runs :class:`~polyrl.rollout.launcher.ServerProcess` on its node, bound to the
node's address.

* **separate** placement: a pool of its own, one bundle (``gpus_per_replica`` GPUs) per
  replica; every rank leads one replica.
* **hybrid** placement: :meth:`~polyrl.controller.ResourcePool.share` of the training pool, one
  rank beside each training rank; rank ``i * g`` leads a replica over the GPUs of ranks
  ``i * g .. i * g + g - 1`` (``g`` = GPUs per replica), which must be on one node.

A server bound to an address other than loopback requires the run's API key.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polyrl.controller import Dispatch, Worker, register
from polyrl.core.http_guard import is_loopback
from polyrl.rollout.launcher import ServerProcess

__all__ = ["ReplicaPlan", "RolloutReplicaWorker", "replica_plans"]


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica of a Ray rollout group: the rank that runs it and its server's devices.

    Attributes:
        leader: rank of the rollout group that runs the server.
        node_id: Ray node of the server.
        host: address the server binds (the node's).
        gpus: ``CUDA_VISIBLE_DEVICES`` of the server (physical ids; empty on CPU).
    """

    leader: int
    node_id: str
    host: str
    gpus: tuple[str, ...]


def replica_plans(
    placements: Sequence[Mapping[str, Any]], ranks_per_replica: int
) -> list[ReplicaPlan]:
    """Group the ranks of a rollout group into replicas of ``ranks_per_replica`` ranks each.

    ``placements`` are the ranks' :meth:`RolloutReplicaWorker.placement` results, in rank
    order. Replica ``i`` is led by rank ``i * ranks_per_replica`` and serves on the GPUs of its
    ranks.

    Raises:
        ValueError: the ranks do not split evenly, or one replica's ranks span nodes.
    """
    if ranks_per_replica < 1 or len(placements) % ranks_per_replica:
        raise ValueError(
            f"{len(placements)} rollout ranks do not split into replicas of {ranks_per_replica}"
        )
    plans = []
    for leader in range(0, len(placements), ranks_per_replica):
        members = placements[leader : leader + ranks_per_replica]
        nodes = {m["node_id"] for m in members}
        if len(nodes) > 1:
            raise ValueError(
                f"the replica led by rank {leader} would span {len(nodes)} nodes: give each node "
                "a multiple of rollout.gpus_per_replica GPUs"
            )
        gpus = tuple(g for m in members for g in m["gpus"])
        plans.append(ReplicaPlan(leader, members[0]["node_id"], members[0]["node_ip"], gpus))
    return plans


def _visible_gpus() -> list[str]:
    # Ray narrows CUDA_VISIBLE_DEVICES to the GPUs of this actor's share of its bundle.
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [g for g in value.split(",") if g.strip()]


class RolloutReplicaWorker(Worker):
    """A rank of the Ray rollout group; leader ranks run a replica server on their node.

    Args:
        model_dir: the model directory (on a filesystem every node sees).
        backend: rollout backend name.
        options: backend options (see :func:`polyrl.trainer.rl.build.replica_options`).
        api_key: the key servers bound beyond loopback require.
        env: environment variables of the servers (their ``CUDA_VISIBLE_DEVICES`` is added
            from the replica plan).
        start_timeout: seconds a server may take to get ready.
    """

    def __init__(
        self,
        model_dir: str,
        backend: str,
        options: Mapping[str, Any],
        api_key: str | None = None,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 600.0,
    ) -> None:
        self.model_dir = model_dir
        self.backend = backend
        self.options = dict(options)
        self.api_key = api_key
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.server: ServerProcess | None = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def placement(self) -> dict[str, Any]:
        """Where this rank runs: ``node_id``, ``node_ip`` and the physical ``gpus`` it holds."""
        return {"node_id": self.node_id, "node_ip": self.node_ip, "gpus": _visible_gpus()}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def start_server(self, plans: Sequence[ReplicaPlan]) -> str | None:
        """Run the server of the replica this rank leads; return its URL (``None``: no lead).

        Raises:
            ValueError: the server would bind beyond loopback without an API key.
        """
        plan = next((p for p in plans if p.leader == self.rank), None)
        if plan is None:
            return None
        if not is_loopback(plan.host) and not self.api_key:
            raise ValueError(
                f"a replica bound to {plan.host} must require an API key; none was given"
            )
        env = dict(self.env)
        if plan.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(plan.gpus)
        self.server = ServerProcess(
            self.model_dir,
            backend=self.backend,
            host=plan.host,
            api_key=self.api_key,
            options=self.options,
            env=env,
        )
        return self._announce(self.server.start(self.start_timeout).url)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def server_command(self) -> dict[str, Any] | None:
        """Return this rank's server command line and environment overrides (``None``: none)."""
        if self.server is None:
            return None
        return {"command": self.server.command, "env": dict(self.server.env)}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def server_state(self, tail_chars: int = 2000) -> dict[str, Any] | None:
        """Describe the server of this rank: ``url``, ``alive`` and, once dead, ``log_tail``.

        ``None`` on ranks that lead no replica.
        """
        if self.server is None:
            return None
        alive = self.server.alive
        tail = "" if alive else self.server.log_tail(tail_chars)
        return {"url": self.server.url, "alive": alive, "log_tail": tail}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def restart_server(self, ranks: Sequence[int], timeout: float | None = None) -> str | None:
        """Restart the server of this rank if it is one of ``ranks``; return its new URL.

        Same command, node and devices as before (see
        :meth:`~polyrl.rollout.launcher.ServerProcess.restart`); ``None`` on other ranks.
        """
        if self.server is None or self.rank not in ranks:
            return None
        return self._announce(self.server.restart(timeout or self.start_timeout))

    def _announce(self, url: str) -> str:
        """Write ``url`` and the server's pid to this rank's log; return ``url``.

        The line tells of the server in the actor's own log (which Ray keeps on its node), the
        end of which the message about the actor's death quotes.
        """
        process = getattr(self.server, "process", None)
        pid = process.pid if process is not None else None
        print(f"rollout server of rank {self.rank} serves {url} (pid {pid})", file=sys.stderr)
        sys.stderr.flush()
        return url

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def stop_server(self) -> int | None:
        """Stop this rank's server; return its exit code."""
        if self.server is None:
            return None
        code = self.server.stop()
        self.server = None
        return code
