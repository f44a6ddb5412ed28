"""What every polyrl HTTP service does to untrusted requests before reading them.

* :func:`parse_json` parses a request body with a nesting-depth cap checked *before* parsing
  (a body nested 100,000 deep would otherwise exhaust the parser's recursion) and turns every
  parse failure -- malformed text, an integer over Python's 4,300-digit conversion limit,
  ``NaN``/``Infinity`` -- into an :class:`~polyrl.core.rollout_api.InvalidRequestError` (400);
* :class:`BodyLimit` answers 413 to a body over a byte limit, whether announced by
  ``Content-Length`` or streamed in chunks;
* :func:`json_request_body` describes a pydantic model as an endpoint's request body in the
  OpenAPI schema (for endpoints that read and check their bodies themselves);
* :func:`is_loopback` and :func:`exposure_problem` decide whether a listen address needs a key;
* :func:`bearer_token` reads an ``Authorization: Bearer`` header and :func:`key_matches`
  compares it in constant time.

Services sit above the core and each wires these into its own app.
"""

from __future__ import annotations

import hmac
import ipaddress
import itertools
import json
import math
import re
from collections.abc import Iterable
from typing import Any

from polyrl.core.rollout_api import InvalidRequestError

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_JSON_DEPTH",
    "BodyLimit",
    "bearer_token",
    "exposure_problem",
    "insecure_warning",
    "is_loopback",
    "json_depth",
    "json_request_body",
    "key_matches",
    "parse_json",
]

DEFAULT_MAX_BODY_BYTES = 8 << 20
"""Largest request body accepted by default (8 MiB)."""

DEFAULT_MAX_JSON_DEPTH = 64
"""Deepest nesting of JSON arrays/objects accepted by default."""

# A JSON string, unrolled so that a long string is one linear scan (no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(raw: bytes) -> int:
    """Return the deepest nesting of arrays/objects in ``raw`` (brackets in strings aside).

    Linear in ``len(raw)`` and done at C speed (regex, ``bytes.translate``, ``accumulate``); on
    malformed text (an unterminated string) it may count too high, never too low.
    """
    if raw.count(b"[") + raw.count(b"{") <= 1 and b'"' not in raw:
        # No string to hide a bracket in: one bracket at most is one level at most.
        return int(b"[" in raw or b"{" in raw)
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(0, max(itertools.accumulate(map(_STEP.__getitem__, brackets))))


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def parse_json(raw: bytes | str, max_depth: int = DEFAULT_MAX_JSON_DEPTH) -> Any:
    """Parse an untrusted JSON document.

    Raises:
        InvalidRequestError: nested deeper than ``max_depth`` (``code: json_too_deep``), or
            not valid JSON (``code: malformed_json``): bad syntax or encoding, ``NaN`` or
            ``Infinity``, an integer too long for Python to convert.
    """
    data = raw.encode() if isinstance(raw, str) else raw
    # Cheap upper bound first: a document with fewer brackets than the cap cannot exceed it.
    if data.count(b"[") + data.count(b"{") > max_depth and json_depth(data) > max_depth:
        raise InvalidRequestError(
            f"the JSON body nests deeper than {max_depth} levels", code="json_too_deep"
        )
    try:
        return json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError as exc:  # unreachable under the depth cap; kept as a backstop
        raise InvalidRequestError("the JSON body nests too deep", code="json_too_deep") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, the int-digits limit
        message = str(exc)
        if "integer string conversion" in message:
            message = "a number has more digits than this server converts (4300)"
        raise InvalidRequestError(f"malformed JSON body: {message}", code="malformed_json") from exc


def json_request_body(model: Any, required: bool = True) -> dict[str, Any]:
    """``openapi_extra`` declaring ``model`` (a pydantic model) as the JSON request body.

    For endpoints that read the raw body themselves (to cap its depth before parsing) and so
    have no body parameter FastAPI could describe. Nested models are inlined: the schema
    carries no ``$defs`` references that would point nowhere inside the OpenAPI document.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": inline(schema)}},
        }
    }


def _error_json(message: str, error_type: str, code: str | None) -> bytes:
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return json.dumps(body).encode()


class BodyLimit:
    """ASGI middleware: answer 413 to a request body larger than ``max_bytes``.

    A ``Content-Length`` over the limit is refused before anything is read; a body streamed
    without one is counted as it arrives and cut off once over the limit (the app then sees
    the client disconnect and whatever it answers is dropped).
    """

    def __init__(self, app: Any, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.max_bytes = int(max_bytes)

    async def _reject(self, send: Any) -> None:
        body = _error_json(
            f"the request body is larger than this server accepts ({self.max_bytes} bytes)",
            "invalid_request_error",
            "body_too_large",
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Pass the request on, watching the size of its body."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False  # the HTTP server has refused a malformed one already
                if too_large:
                    await self._reject(send)
                    return
                break
        received = 0
        rejected = False
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received, rejected
            if rejected:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    rejected = True
                    if not started:
                        await self._reject(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            nonlocal started
            if rejected:
                return
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not rejected:
                raise
            # The app's reaction to the cut-off body (a ClientDisconnect) is not an error.


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens on this machine (127.0.0.0/8, ::1 or ``localhost``)."""
    name = host.strip().strip("[]").lower()
    if name in ("localhost", "localhost.localdomain") or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # a host name may resolve anywhere: treat it as exposed


def exposure_problem(host: str, has_key: bool, insecure: bool, key_hint: str) -> str | None:
    """Return why ``host`` may not be bound (``None`` when it may).

    Binding beyond loopback needs a key, or ``insecure`` (which the caller warns about).

    Args:
        host: the address to bind.
        has_key: whether clients must present a key.
        insecure: the operator asked for an open server anyway (``--insecure``).
        key_hint: how to set a key, for the message (e.g. ``"set POLYRL_API_KEY"``).
    """
    if is_loopback(host) or has_key or insecure:
        return None
    return (
        f"refusing to listen on {host} without an API key: anyone who can reach this address "
        f"could use the server; {key_hint}, bind 127.0.0.1, or pass --insecure to serve it "
        "open anyway"
    )


def insecure_warning(host: str, what: str) -> str:
    """Return the warning printed when ``what`` serves ``host`` open on purpose (``--insecure``)."""
    return (
        f"WARNING: {what} listens on {host} with NO API key (--insecure): anyone who can "
        "reach this address can use it"
    )


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """Return the token of an ``Authorization: Bearer <token>`` header in ASGI headers."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
            return None
    return None


def key_matches(token: bytes | None, keys: Iterable[bytes]) -> bytes | None:
    """Return the key of ``keys`` that ``token`` equals (constant-time compare), else ``None``."""
    if token is None:
        return None
    found = None
    for key in keys:
        if hmac.compare_digest(token, key):
            found = key
    return found
