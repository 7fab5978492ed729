"""Cross-origin requests to the API (/v1): which web pages of other origins may read its answers.

A page the dashboard did not serve (a chat front end on another port, a notebook's widget) calls
/v1 from its own origin, and the browser reads the answer only if the response names that origin
(``Access-Control-Allow-Origin``); for a POST of JSON or with an API key it first sends a
preflight OPTIONS, which must be answered without the key. Pages served from this machine's
loopback names (``localhost``, ``127.0.0.1``, ``[::1]``, any port) always may, as Ollama allows;
``--cors-origins`` (``fabric.flags.origins``) adds others, or ``*`` for any. Pages of other
origins get no such header, so the browser keeps the answer from them. The dashboard's own
requests are same-origin and need none of this.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from quart import Response, request

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
METHODS = "GET, POST, OPTIONS"
HEADERS = "Authorization, Content-Type"
MAX_AGE_S = 600  # how long a browser may keep a preflight's answer


def allowed(origin: str, origins: frozenset[str]) -> bool:
    """Whether a page of ``origin`` may read the API's answers: a page of this machine's loopback
    names, or of one of ``origins`` (any, with ``*`` among them)."""
    if "*" in origins or origin.rstrip("/").lower() in origins:
        return True
    try:
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.hostname in LOOPBACK and parts.port != 0
    except ValueError:  # a port out of range, a malformed address
        return False


def is_preflight() -> bool:
    """A browser asking whether it may send the request it names (answered before any key check)."""
    return request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers


def add_headers(response: Response, origins: frozenset[str]) -> Response:
    """The CORS headers of an API response, where the request's origin may read it."""
    origin = request.headers.get("Origin")
    if not request.path.startswith("/v1") or not origin or not allowed(origin, origins):
        return response
    response.headers["Access-Control-Allow-Origin"] = origin
    response.vary.add("Origin")
    if is_preflight():
        response.headers["Access-Control-Allow-Methods"] = METHODS
        response.headers["Access-Control-Allow-Headers"] = request.headers.get("Access-Control-Request-Headers",
                                                                               HEADERS)[:1000]
        response.headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
    return response
