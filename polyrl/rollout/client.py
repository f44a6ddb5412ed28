"""`RolloutClient`: many rollout replicas behind one async object.

The rest of polyrl (agent loop, trainer) talks to rollout only through this client:

* **balancing**: each request goes to the healthy replica with the fewest outstanding requests
  (ties go to the one that served fewer);
* **sticky sessions**: requests with the same ``session_id`` go to the same replica while it is
  healthy, so multi-turn conversations hit that replica's prefix cache;
* **health checks**: a background task polls ``/health``; a replica that fails a request or a
  check is taken out of rotation until a check succeeds again;
* **retries**: a request that fails on the transport (connection refused, reset, replica
  killed mid-answer) or that a dying or overloaded replica answers with a 5xx status is re-sent
  whole (same body: token-in/token-out, same sampling parameters and seed) to another replica,
  up to ``max_retries`` times; :attr:`RolloutClient.retries` counts the re-sends, and an error
  that exhausts them names every replica tried;
* **waiting for a replica**: with ``replica_wait`` seconds, a request that finds no healthy
  replica waits that long for one to come back (a restarted replica, see
  :meth:`RolloutClient.replace_replica`) before failing;
* **backpressure**: at most ``max_concurrency`` requests are in flight; further calls wait.

Control calls (``pause``, ``abort``, ``update_weights``, ...) are broadcast to every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from polyrl.core.rollout_api import RolloutError, SampleOutput, SamplingParams

if TYPE_CHECKING:  # the client imports no torch
    from polyrl.core.multimodal import MultiModalInputs

__all__ = [
    "GenerateResult",
    "NoReplicaAvailableError",
    "Replica",
    "RolloutClient",
    "RolloutHTTPError",
    "StreamedResponse",
]

_MAX_SESSIONS = 100_000

#: Statuses that send a request to another replica: a replica shutting down, crashed inside
#: (500), asleep or overloaded (503), or a router in front of one failing (502, 504). With no
#: other replica left the last answer is returned as it is.
RETRY_STATUSES = frozenset({500, 502, 503, 504})


#: Connection pools a client spreads its requests over (see ``RolloutClient.__init__``).
_POOL_SHARDS = 8


class RolloutHTTPError(RolloutError):
    """A replica answered with an error status; ``status`` and the server's message are kept."""

    def __init__(self, status: int, message: str, body: Any = None, replica: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = body
        self.replica = replica
        if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
            self.error_type = str(body["error"].get("type") or "server_error")
            self.param = body["error"].get("param")
            self.code = body["error"].get("code")


class NoReplicaAvailableError(RolloutError):
    """No healthy replica is left to take the request (HTTP 503 at the router)."""

    status = 503
    error_type = "service_unavailable"


@dataclasses.dataclass
class Replica:
    """One replica's address and the client's view of it.

    ``healthy`` follows requests and health checks; ``enabled`` is the owner's say (a replica
    restarted but not yet given the current weights is held out of rotation).
    """

    url: str
    healthy: bool = True
    enabled: bool = True
    outstanding: int = 0
    served: int = 0
    failures: int = 0
    last_error: str | None = None


@dataclasses.dataclass
class GenerateResult:
    """The answer of ``/generate`` for one prompt, plus the replica that produced it."""

    request_id: str
    outputs: list[SampleOutput]
    weight_version: int
    usage: dict[str, int]
    replica: str
    #: The prompt as the server ran it (placeholders expanded); set for image prompts only.
    prompt_ids: list[int] | None = None
    #: With ``prompt_logprobs`` asked: each prompt token's log-prob (``None`` at position 0)
    #: and, for ``k > 0``, the ``k`` most likely tokens per position (see ``RequestOutput``).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    @classmethod
    def from_json(cls, body: Mapping[str, Any], replica: str) -> GenerateResult:
        """Parse a ``/generate`` response body."""
        outputs = []
        for o in body["outputs"]:
            top = o.get("top_logprobs")
            outputs.append(
                SampleOutput(
                    index=o["index"],
                    output_ids=list(o["output_ids"]),
                    logprobs=o.get("logprobs"),
                    top_logprobs=None
                    if top is None
                    else [[(int(a), float(b)) for a, b in pos] for pos in top],
                    finish_reason=o.get("finish_reason"),
                    stop_reason=o.get("stop_reason"),
                    weight_version=o.get("weight_version", 0),
                    first_weight_version=o.get("first_weight_version"),
                    cached_prompt_tokens=o.get("cached_prompt_tokens", 0),
                    routed_experts=o.get("routed_experts"),
                )
            )
        return cls(
            request_id=body["request_id"],
            outputs=outputs,
            weight_version=body.get("weight_version", 0),
            usage=dict(body.get("usage", {})),
            replica=replica,
            prompt_ids=list(body["prompt_ids"]) if body.get("prompt_ids") is not None else None,
            prompt_logprobs=body.get("prompt_logprobs"),
            prompt_top_logprobs=None
            if body.get("prompt_top_logprobs") is None
            else [[(int(a), float(b)) for a, b in pos] for pos in body["prompt_top_logprobs"]],
        )


def _error_message(response: httpx.Response | StreamedResponse) -> tuple[str, Any]:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return response.text[:500] or f"HTTP {response.status_code}", None
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        return str(body["error"].get("message")), body
    return str(body)[:500], body


class RolloutClient:
    """Async client of one or more rollout replicas (see the module docstring).

    Args:
        urls: base URLs of the replicas (``http://127.0.0.1:8000``) or of a router.
        api_key: bearer token sent with every request.
        max_concurrency: most requests in flight at once across all replicas.
        max_retries: extra attempts, each on another replica, after a transport failure.
        timeout: seconds to wait for a response (generation included).
        connect_timeout: seconds to wait for a connection.
        health_interval: seconds between background health checks (0 disables them).
        replica_wait: seconds a request waits for a healthy replica when none is left (0: it
            fails at once).

    Use as ``async with RolloutClient(urls) as client: ...`` (or ``await start()`` and
    ``await close()``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        max_concurrency: int = 256,
        max_retries: int = 3,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        health_interval: float = 2.0,
        replica_wait: float = 0.0,
    ):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("RolloutClient needs at least one replica URL")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"replica URL {url!r} must start with http:// or https://")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self.api_key = api_key
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.health_interval = health_interval
        self.replica_wait = replica_wait
        #: Requests re-sent to another replica after a failure (transport error or 5xx).
        self.retries = 0
        self._sessions: OrderedDict[str, Replica] = OrderedDict()
        self._slots = asyncio.Semaphore(max_concurrency)
        # Several connection pools, requests spread over them in turn: httpcore scans every
        # connection of a pool each time it hands out one, so one pool of N connections costs
        # O(N) CPU per request (a tool-calling run with ~100 episodes in flight spent most of
        # its producer's CPU there); _POOL_SHARDS pools of N / _POOL_SHARDS each cost that less.
        self._http: list[httpx.AsyncClient] = []
        self._next_pool = 0
        self._health_task: asyncio.Task[None] | None = None
        #: Request and (non-streamed) response body bytes this client sent and received, so
        #: a benchmark can count what passes through the process that holds the client.
        self.bytes_sent = 0
        self.bytes_received = 0

    # ------------------------------------------------------------------------- lifecycle

    async def start(self) -> RolloutClient:
        """Open the HTTP connection pool and start health checks."""
        if not self._http:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            # Each pool may hold every connection (the semaphore bounds the total): a pool that
            # happens to get long requests never makes a request wait for a connection.
            self._http = [
                httpx.AsyncClient(
                    headers=headers,
                    timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout),
                    limits=httpx.Limits(
                        max_connections=self.max_concurrency + 4 * len(self.replicas),
                        max_keepalive_connections=self.max_concurrency,
                    ),
                )
                for _ in range(min(_POOL_SHARDS, self.max_concurrency))
            ]
            if self.health_interval > 0:
                self._health_task = asyncio.ensure_future(self._health_loop())
        return self

    async def close(self) -> None:
        """Stop health checks and close connections."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        pools, self._http = self._http, []
        for pool in pools:
            await pool.aclose()

    async def __aenter__(self) -> RolloutClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _client(self) -> httpx.AsyncClient:
        if not self._http:
            raise RuntimeError("RolloutClient is not started; use 'async with' or await start()")
        self._next_pool = (self._next_pool + 1) % len(self._http)
        return self._http[self._next_pool]

    # -------------------------------------------------------------------------- health

    async def health(self, url: str, timeout: float | None = None) -> dict[str, Any]:
        """Return the ``/health`` answer of the server at ``url`` (with this client's key).

        ``url`` may be a replica's or any other server's; the replicas' states are left as
        they are. ``timeout`` defaults to ``connect_timeout``.

        Raises:
            httpx.HTTPError: the server did not answer, or answered an error status.
            ValueError: the answer is not JSON.
        """
        r = await self._client().get(
            f"{url.rstrip('/')}/health",
            timeout=self.connect_timeout if timeout is None else timeout,
        )
        r.raise_for_status()
        return r.json()

    async def check_health(self) -> list[dict[str, Any]]:
        """Probe every replica's ``/health`` now; update and return their states."""

        async def probe(replica: Replica) -> dict[str, Any]:
            try:
                state = await self.health(replica.url)
                replica.healthy = True
                replica.last_error = None
                return {"url": replica.url, "healthy": True, **state}
            except (httpx.HTTPError, ValueError) as exc:
                self._mark_down(replica, exc)
                return {"url": replica.url, "healthy": False, "error": replica.last_error}

        return list(await asyncio.gather(*(probe(r) for r in self.replicas)))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            with contextlib.suppress(Exception):
                await self.check_health()

    def _mark_down(self, replica: Replica, exc: BaseException) -> None:
        replica.healthy = False
        replica.failures += 1
        replica.last_error = f"{type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------------ replicas

    def replace_replica(self, old_url: str, new_url: str, *, enabled: bool = True) -> Replica:
        """Put ``new_url`` in the place of ``old_url`` (a replica restarted elsewhere).

        The new replica takes the old one's position (``/metrics`` labels stay) and starts
        healthy; sessions pinned to the old one are re-balanced; requests still waiting for a
        replica pick it up (with ``enabled=False`` only once :meth:`enable_replica` lets it in).
        ``old_url`` may also be ``new_url`` (restarted on the same port).

        Raises:
            KeyError: ``old_url`` is not one of this client's replicas.
        """
        old_url, new_url = old_url.rstrip("/"), new_url.rstrip("/")
        for i, replica in enumerate(self.replicas):
            if replica.url == old_url:
                fresh = Replica(new_url, enabled=enabled)
                self.replicas[i] = fresh
                return fresh
        raise KeyError(f"{old_url} is not a replica of this client ({self.urls})")

    def enable_replica(self, url: str, enabled: bool = True) -> None:
        """Let a replica take requests (``enabled=False``: hold it out of rotation).

        Raises:
            KeyError: ``url`` is not one of this client's replicas.
        """
        url = url.rstrip("/")
        for replica in self.replicas:
            if replica.url == url:
                replica.enabled = enabled
                return
        raise KeyError(f"{url} is not a replica of this client ({self.urls})")

    def add_replica(self, url: str) -> Replica:
        """Put one more replica in rotation (no-op if it is there already)."""
        url = url.rstrip("/")
        for replica in self.replicas:
            if replica.url == url:
                return replica
        replica = Replica(url)
        self.replicas.append(replica)
        return replica

    def remove_replica(self, url: str) -> None:
        """Take a replica out of rotation for good (its in-flight requests still finish)."""
        url = url.rstrip("/")
        self.replicas = [r for r in self.replicas if r.url != url]

    @property
    def urls(self) -> list[str]:
        """The replicas' URLs, in order."""
        return [r.url for r in self.replicas]

    # ------------------------------------------------------------------------- routing

    def pick(self, session_id: str | None = None, exclude: Sequence[Replica] = ()) -> Replica:
        """Choose the replica for a request (sticky for ``session_id``).

        Raises:
            NoReplicaAvailableError: every replica is down or excluded.
        """
        candidates = [r for r in self.replicas if r.healthy and r.enabled and r not in exclude]
        if not candidates:
            down = "; ".join(
                f"{r.url}: {r.last_error if r.enabled else 'held out of rotation'}"
                for r in self.replicas
                if not (r.healthy and r.enabled)
            )
            raise NoReplicaAvailableError(
                f"no healthy rollout replica left ({len(self.replicas)} known; {down or 'none'})"
            )
        if session_id is not None:
            chosen = self._sessions.get(session_id)
            if chosen is not None and chosen in candidates:
                self._sessions.move_to_end(session_id)
                return chosen
        chosen = min(candidates, key=lambda r: (r.outstanding, r.served))
        if session_id is not None:
            self._sessions[session_id] = chosen
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > _MAX_SESSIONS:
                self._sessions.popitem(last=False)
        return chosen

    def session_replica(self, session_id: str) -> str | None:
        """URL of the replica a session is pinned to, if any."""
        replica = self._sessions.get(session_id)
        return None if replica is None else replica.url

    async def send(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        content: bytes | None = None,
        session_id: str | None = None,
        stream: bool = False,
    ) -> tuple[httpx.Response | StreamedResponse, Replica]:
        """Send one request to a chosen replica, re-sending it elsewhere when that one fails.

        A transport failure (the replica is gone: connection refused or reset, killed
        mid-answer) takes the replica out of rotation and re-sends the whole request to
        another; so does an answer with a status in :data:`RETRY_STATUSES`, which is returned
        as it is when no other replica is left. With no healthy replica at all the request
        waits up to ``replica_wait`` seconds for one. Returns the response (any status) and the
        replica that answered. With ``stream`` the body is not read: iterate it and
        ``aclose()`` it. The concurrency slot and the replica's outstanding count are held
        until the body is read (or closed).

        Raises:
            NoReplicaAvailableError: no replica could be reached; the message names each
                replica tried and its error.
        """
        http = self._client()
        await self._slots.acquire()
        tried: list[Replica] = []
        errors: list[str] = []
        kept: tuple[httpx.Response, Replica] | None = None  # a retryable answer, if no other
        deadline: float | None = None
        attempts = 0
        try:
            while attempts <= self.max_retries:
                try:
                    replica = self.pick(session_id, exclude=tried)
                except NoReplicaAvailableError:
                    if kept is not None:
                        break
                    if deadline is None:
                        deadline = time.monotonic() + self.replica_wait
                    if time.monotonic() >= deadline:
                        if not errors:
                            raise
                        break
                    await asyncio.sleep(min(0.1, max(deadline - time.monotonic(), 0.0)))
                    if any(r.healthy and r.enabled and r not in tried for r in self.replicas):
                        continue
                    # A replica tried before that is healthy again (restarted in place).
                    tried = [r for r in tried if not (r.healthy and r.enabled)]
                    continue
                if attempts:
                    self.retries += 1
                attempts += 1
                tried.append(replica)
                replica.outstanding += 1
                try:
                    req = http.build_request(
                        method, f"{replica.url}{path}", json=json_body, content=content
                    )
                    response = await http.send(req, stream=stream)
                except httpx.TransportError as exc:
                    replica.outstanding -= 1
                    self._mark_down(replica, exc)
                    errors.append(f"{replica.url}: {type(exc).__name__}: {exc}")
                    continue
                except BaseException:
                    replica.outstanding -= 1
                    raise
                replica.served += 1
                self.bytes_sent += len(req.content)
                if response.status_code in RETRY_STATUSES:
                    try:
                        if stream:
                            await response.aread()
                    except httpx.TransportError as exc:
                        self._mark_down(replica, exc)
                        errors.append(f"{replica.url}: {type(exc).__name__}: {exc}")
                        continue
                    finally:
                        replica.outstanding -= 1
                        if stream:
                            await response.aclose()
                    errors.append(f"{replica.url}: HTTP {response.status_code}")
                    kept = (response, replica)
                    continue
                return self._answer(response, replica, stream)
            if kept is not None:
                response, replica = kept
                replica.outstanding += 1
                return self._answer(response, replica, stream)
            raise NoReplicaAvailableError(
                f"{method} {path} failed on {len(tried)} replica(s) after {attempts} attempt(s): "
                + "; ".join(errors)
            )
        except BaseException:
            self._slots.release()
            raise

    def _answer(
        self, response: httpx.Response, replica: Replica, stream: bool
    ) -> tuple[httpx.Response | StreamedResponse, Replica]:
        """Hand back ``response`` (its slot and outstanding count are released with its body)."""
        if stream:
            return StreamedResponse(response, replica, self._slots), replica
        self.bytes_received += len(response.content)
        replica.outstanding -= 1
        self._slots.release()
        return response, replica

    async def post_json(
        self, path: str, body: Mapping[str, Any], session_id: str | None = None
    ) -> tuple[dict[str, Any], str]:
        """POST a JSON body; return the JSON answer and the replica URL.

        Raises:
            RolloutHTTPError: the replica answered with an error status.
        """
        response, replica = await self.send("POST", path, json_body=body, session_id=session_id)
        if response.status_code >= 400:
            message, err = _error_message(response)
            raise RolloutHTTPError(response.status_code, message, err, replica.url)
        return response.json(), replica.url

    # ---------------------------------------------------------------------- generation

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        session_id: str | None = None,
        request_id: str | None = None,
        multi_modal: MultiModalInputs | None = None,
    ) -> GenerateResult:
        """Generate from one prompt of token ids (``/generate``).

        Args:
            input_ids: the prompt.
            sampling_params: :class:`SamplingParams` or the same fields as a mapping.
            session_id: keeps the turns of one conversation on one replica.
            request_id: id for ``abort`` (default: random).
            multi_modal: the prompt's images and videos (a vision model's server); their
                sources are sent (:meth:`~polyrl.core.multimodal.MultiModalInputs.media_payload`)
                and the server processes them again. ``input_ids`` may hold one placeholder
                per item or the expanded runs; the result's ``prompt_ids`` are expanded.
        """
        if isinstance(sampling_params, SamplingParams):
            params: Mapping[str, Any] = sampling_params.to_dict()
        else:
            params = dict(sampling_params or {})
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": params,
            "request_id": request_id or f"gen-{uuid.uuid4().hex}",
        }
        if session_id is not None:
            body["session_id"] = session_id
        if multi_modal is not None and len(multi_modal):
            body.update({k: v for k, v in multi_modal.media_payload().items() if v})
        answer, url = await self.post_json("/generate", body, session_id)
        return GenerateResult.from_json(answer, url)

    async def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        session_ids: Sequence[str | None] | None = None,
    ) -> list[GenerateResult]:
        """Generate for many prompts concurrently (each balanced on its own), in order."""
        if session_ids is not None and len(session_ids) != len(prompts):
            raise ValueError(
                f"{len(session_ids)} session ids for {len(prompts)} prompts; give one per prompt"
            )
        sids = session_ids or [None] * len(prompts)
        return list(
            await asyncio.gather(
                *(
                    self.generate(p, sampling_params, session_id=s)
                    for p, s in zip(prompts, sids, strict=True)
                )
            )
        )

    async def completions(
        self, body: Mapping[str, Any], session_id: str | None = None
    ) -> dict[str, Any]:
        """POST ``/v1/completions`` (non-streaming) and return the JSON answer."""
        return (await self.post_json("/v1/completions", body, session_id))[0]

    async def chat_completions(
        self, body: Mapping[str, Any], session_id: str | None = None
    ) -> dict[str, Any]:
        """POST ``/v1/chat/completions`` (non-streaming) and return the JSON answer."""
        return (await self.post_json("/v1/chat/completions", body, session_id))[0]

    async def stream_events(
        self, path: str, body: Mapping[str, Any], session_id: str | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """POST a streaming request and yield each server-sent event's JSON data."""
        response, replica = await self.send(
            "POST", path, json_body=dict(body), session_id=session_id, stream=True
        )
        try:
            if response.status_code >= 400:
                await response.aread()
                message, err = _error_message(response)
                raise RolloutHTTPError(response.status_code, message, err, replica.url)
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    return
                yield json.loads(data)
        finally:
            await response.aclose()

    # ------------------------------------------------------------------------- control

    async def broadcast(self, path: str, body: Mapping[str, Any] | None = None) -> list[Any]:
        """POST to every healthy replica; return their JSON answers in replica order.

        Every replica's call runs to its end before an error is raised (the first, in replica
        order), so one lost replica does not leave the others' calls unfinished.

        Raises:
            RolloutHTTPError: a replica answered with an error status.
            NoReplicaAvailableError: no replica is healthy, or one could not be reached (the
                message names it).
        """
        http = self._client()
        targets = [r for r in self.replicas if r.healthy and r.enabled]
        if not targets:
            raise NoReplicaAvailableError("no healthy rollout replica to send the command to")

        async def one(replica: Replica) -> Any:
            try:
                r = await http.post(f"{replica.url}{path}", json=dict(body or {}))
            except httpx.TransportError as exc:
                self._mark_down(replica, exc)
                raise NoReplicaAvailableError(
                    f"{path} failed on {replica.url}: {type(exc).__name__}: {exc}"
                ) from exc
            if r.status_code >= 400:
                message, err = _error_message(r)
                raise RolloutHTTPError(r.status_code, message, err, replica.url)
            return r.json()

        answers = await asyncio.gather(*(one(r) for r in targets), return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return list(answers)

    async def pause(self) -> None:
        """Pause every replica."""
        await self.broadcast("/pause")

    async def resume(self) -> None:
        """Resume every replica."""
        await self.broadcast("/resume")

    async def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """Abort requests (all when ``None``) on every replica; return how many ended."""
        body = {} if request_ids is None else {"request_ids": list(request_ids)}
        return sum(a["aborted"] for a in await self.broadcast("/abort", body))

    async def sleep(self, level: int = 1) -> list[dict[str, Any]]:
        """Put every replica to sleep (release KV cache; level 2 also drops weights)."""
        return await self.broadcast("/sleep", {"level": level})

    async def wake_up(self, tags: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Wake every replica up."""
        return await self.broadcast("/wake_up", {} if tags is None else {"tags": list(tags)})

    async def update_weights(self, path: str, version: int | None = None) -> int:
        """Load new weights on every replica; return the new version.

        Raises:
            RolloutError: replicas disagree on the resulting version.
        """
        body: dict[str, Any] = {"path": path}
        if version is not None:
            body["version"] = version
        versions = {a["weight_version"] for a in await self.broadcast("/update_weights", body)}
        if len(versions) != 1:
            raise RolloutError(f"replicas report different weight versions {sorted(versions)}")
        return versions.pop()

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until every replica answers ``/health``.

        Raises:
            TimeoutError: some replica did not come up in time.
        """
        deadline = time.monotonic() + timeout
        while True:
            states = await self.check_health()
            if all(s["healthy"] for s in states):
                return
            if time.monotonic() > deadline:
                bad = [s["url"] for s in states if not s["healthy"]]
                raise TimeoutError(f"rollout replicas {bad} not healthy after {timeout} s")
            await asyncio.sleep(0.2)


class StreamedResponse:
    """A streamed replica response; closing it gives back its concurrency slot.

    Attributes:
        status_code: HTTP status.
        headers: response headers.
        replica: URL of the replica answering.
    """

    def __init__(self, response: httpx.Response, replica: Replica, slots: asyncio.Semaphore):
        self._response = response
        self._replica = replica
        self._slots = slots
        self._released = False
        self.status_code = response.status_code
        self.headers = response.headers
        self.replica = replica.url

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        """Iterate over the raw body."""
        return self._response.aiter_bytes()

    def aiter_lines(self) -> AsyncIterator[str]:
        """Iterate over the body line by line."""
        return self._response.aiter_lines()

    async def aread(self) -> bytes:
        """Read the whole body."""
        return await self._response.aread()

    def json(self) -> Any:
        """Parse a body already read with :meth:`aread`."""
        return self._response.json()

    @property
    def text(self) -> str:
        """A body already read with :meth:`aread`, as text."""
        return self._response.text

    async def aclose(self) -> None:
        """Close the stream and release the slot (idempotent)."""
        try:
            await self._response.aclose()
        finally:
            if not self._released:
                self._released = True
                self._replica.outstanding -= 1
                self._slots.release()
