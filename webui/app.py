"""The meshnet web UI: a Quart app over the fabric client, and ``serve`` to run it.

``create_app(config, client)`` wires the OpenAI-compatible API, the dashboard's /api
endpoints and its live feed (the tracker's PUB, read while the app serves) and the static
dashboard to any object with ``fabric.client.AsyncClient``'s interface; ``serve(config)``
builds the real client and runs the app under hypercorn until Ctrl-C (or SIGTERM).
"""
from __future__ import annotations

import asyncio
import gc
import logging
import signal
from pathlib import Path
from typing import Any, Awaitable, Callable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config as HypercornConfig
from quart import Quart, Response, jsonify, request
from werkzeug.exceptions import HTTPException, InternalServerError

from fabric import metrics

from . import cors
from .accounting import Accounting
from .config import WebUIConfig
from .dashboard import LIVE_EXTENSION
from .dashboard import blueprint as dashboard_blueprint
from .errors import ApiError
from .guard import JsonErrors
from .live import LiveFeed
from .openai_api import (
    EXTENSION,
    INTERNAL_ERROR,
    ApiContext,
    api_error_response,
    blueprint,
    render_api_error,
)

__all__ = ["WebUIConfig", "create_app", "serve", "serve_async"]

logger = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
ClientFactory = Callable[[WebUIConfig], Any]


def _metrics(app: Quart) -> list:
    """This web UI's request and token totals, per model, for /metrics."""
    rows = []
    usage = app.extensions[EXTENSION].accounting.snapshot()["models"]
    for model, totals in usage.items():
        for outcome in ("completed", "failed", "cancelled"):
            rows.append(metrics.Sample("webui_requests_total", "chat/completion requests by outcome",
                                       totals[outcome], "counter", {"model": model, "outcome": outcome}))
        for kind in ("prompt_tokens", "completion_tokens"):
            rows.append(metrics.Sample("webui_tokens_total", "tokens in and out", totals[kind], "counter",
                                       {"model": model, "kind": kind.split("_")[0]}))
    return rows


def create_app(config: WebUIConfig, client: Any) -> Quart:
    """The web UI app. ``client`` is not closed by the app: its creator owns it.

    Usage accounting is at ``app.extensions["meshnet"].accounting``; the live feed at
    ``app.extensions["meshnet.live"]`` connects when the app starts serving (never failing
    for want of a tracker PUB) and closes when it stops.
    """
    app = Quart(__name__, static_folder=str(STATIC), static_url_path="/static")
    app.config["MAX_CONTENT_LENGTH"] = config.max_body_bytes
    app.extensions[EXTENSION] = ApiContext(config, client, Accounting())
    # the feed's plans also go to the client, which routes on them while the tracker is away
    feed = app.extensions[LIVE_EXTENSION] = LiveFeed(config.pub, idle_timeout=config.call_idle_timeout,
                                                        security=config.security,
                                                        on_plans=getattr(client, "learn_plans", None))
    app.before_serving(feed.start)
    app.after_serving(feed.stop)
    app.register_blueprint(blueprint)
    app.register_blueprint(dashboard_blueprint)
    app.register_error_handler(ApiError, render_api_error)
    app.register_error_handler(HTTPException, _http_error)
    app.register_error_handler(Exception, _unexpected_error)

    @app.after_request
    async def cross_origin(response: Response) -> Response:
        return cors.add_headers(response, config.cors_origins)

    app.asgi_app = JsonErrors(app.asgi_app)  # what escapes Quart's handlers is a JSON error too

    registry = metrics.registry_for(lambda: _metrics(app))

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(registry), content_type=metrics.CONTENT_TYPE)

    @app.get("/health")
    async def health() -> tuple[Response, int]:
        return await _health(client)

    @app.get("/")
    async def index() -> Response:
        return await app.send_static_file("index.html")

    return app


async def _health(client: Any) -> tuple[Response, int]:
    """Whether this web UI can serve a request now, for a load balancer, a container's health
    check or a script waiting for start-up: 200 and the routable models while some model has
    a node for every layer, else 503 and why. No API key needed, as for /metrics."""
    try:
        models = await client.models()
    except Exception as exc:  # the tracker does not answer: nothing can be routed
        return jsonify({"status": "unavailable", "reason": f"the tracker did not list models: {exc}"[:500]}), 503
    routable = sorted(m["id"] for m in models if m.get("routable"))
    if not routable:
        reason = "no model has a node for every layer yet" if models else "no node serves a model yet"
        return jsonify({"status": "unavailable", "reason": reason, "models": []}), 503
    return jsonify({"status": "ok", "models": routable}), 200


async def _http_error(error: HTTPException) -> Any:
    """404/405/413 and friends: OpenAI error objects under /v1, Quart's pages elsewhere."""
    if not _is_api_path(request.path):
        return error
    code = (error.name or "error").lower().replace(" ", "_")
    return api_error_response(ApiError(error.code or 500, error.description or error.name,
                                       "invalid_request_error", None, code))


async def _unexpected_error(error: Exception) -> Any:
    logger.error("unhandled error on %s %s", request.method, request.path, exc_info=error)
    if not _is_api_path(request.path):
        return InternalServerError()
    return api_error_response(INTERNAL_ERROR)


def _is_api_path(path: str) -> bool:
    return any(path == root or path.startswith(root + "/") for root in ("/v1", "/api"))


# --------------------------------------------------------------------------- serving


def serve(config: WebUIConfig, *, client_factory: ClientFactory | None = None) -> None:
    """Serve until Ctrl-C or SIGTERM, then shut down cleanly (closing the fabric client).

    ``client_factory(config)`` builds the client; by default ``fabric.client.AsyncClient``.
    What is loaded by now lives as long as the process: frozen out of the garbage collector's
    walks, a full collection (~230k objects, over 100 ms) no longer stalls every open stream.
    """
    gc.collect()
    gc.freeze()
    asyncio.run(serve_async(config, client_factory=client_factory))


async def serve_async(config: WebUIConfig, *, client_factory: ClientFactory | None = None,
                      shutdown_trigger: Callable[[], Awaitable[None]] | None = None) -> None:
    """``serve`` as a coroutine; without ``shutdown_trigger`` SIGINT/SIGTERM end it."""
    client = (client_factory or _fabric_client)(config)
    stop = asyncio.Event()
    installed = _install_signal_handlers(stop) if shutdown_trigger is None else []
    try:
        app = create_app(config, client)
        logger.info("meshnet web UI on http://%s", _bind_address(config))
        trigger = _ending_live_streams(app, shutdown_trigger or stop.wait)
        await hypercorn_serve(app, _hypercorn_config(config), shutdown_trigger=trigger)
    finally:
        for sig in installed:
            asyncio.get_running_loop().remove_signal_handler(sig)
        await client.close()
        logger.info("meshnet web UI stopped")


def _ending_live_streams(app: Quart, trigger: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """``trigger``, then stop the live feed: its /api/events streams end at once instead of
    holding hypercorn's graceful shutdown for its whole timeout."""
    async def wrapped() -> None:
        await trigger()
        await app.extensions[LIVE_EXTENSION].stop()

    return wrapped


def _fabric_client(config: WebUIConfig) -> Any:
    from fabric.client import AsyncClient

    return AsyncClient(config.tracker, timeout=config.client_timeout, security=config.security)


def _install_signal_handlers(stop: asyncio.Event) -> list[signal.Signals]:
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            continue
        installed.append(sig)
    return installed


def _bind_address(config: WebUIConfig) -> str:
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{host}:{config.port}"


def _hypercorn_config(config: WebUIConfig) -> HypercornConfig:
    hc = HypercornConfig()
    hc.bind = [_bind_address(config)]
    hc.accesslog = None
    hc.graceful_timeout = 5.0  # seconds in-flight requests get at shutdown before cancellation
    return hc
