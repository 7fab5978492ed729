"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions, /v1/responses.

Handlers only translate: parse and validate the body into a ``GenerationRequest``, open
one ``Generation`` (the fabric's event stream), and hand it either to ``stream_events``
(SSE) or to ``collect`` (one JSON object). Errors are ``ApiError``s rendered by one handler.
"""
from __future__ import annotations

import hmac
import logging
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from quart import Blueprint, Response, current_app, g, jsonify, request

from fabric.wire.protocol import function_name

from . import cors, sse
from .accounting import Accounting
from .errors import SERVER_ERROR, ApiError, api_error_from
from .formats import ChatFormat, ResponseFormat, TextFormat
from .generation import Generation, collect
from .responses import chat_body, checked, echo, turn
from .responses_format import ResponsesFormat
from .responses_store import ResponseStore
from .schema import GenerationRequest, parse_chat, parse_completion, parse_json_object
from .tool_replies import ToolReplies

if TYPE_CHECKING:
    from .config import WebUIConfig

logger = logging.getLogger(__name__)

EXTENSION = "meshnet"  # key of the ApiContext in app.extensions

blueprint = Blueprint("openai_api", __name__, url_prefix="/v1")

INTERNAL_ERROR = ApiError(500, "internal server error", SERVER_ERROR, None, "internal")


@dataclass(frozen=True)
class ApiContext:
    """What the API handlers share, stored in ``app.extensions[EXTENSION]``."""

    config: WebUIConfig
    client: Any  # fabric.client.AsyncClient or anything with its interface
    accounting: Accounting
    responses: ResponseStore = field(default_factory=ResponseStore)  # what previous_response_id continues


def api_context() -> ApiContext:
    return current_app.extensions[EXTENSION]


# --------------------------------------------------------------------------- auth


@blueprint.before_request
async def check_api_key() -> None:
    """With keys configured, every /v1 request needs ``Authorization: Bearer <key>`` (but a
    browser's CORS preflight, which asks whether it may send one)."""
    keys = api_context().config.api_keys
    g.api_key = None
    if not keys or cors.is_preflight():  # a browser's preflight never carries the key
        return
    key = bearer_token(request.headers.get("Authorization", ""))
    if key is None or not any(hmac.compare_digest(key.encode(), k.encode()) for k in keys):
        raise ApiError(401, "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.",
                       "invalid_request_error", None, "invalid_api_key")
    g.api_key = key


def bearer_token(header: str) -> str | None:
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


# --------------------------------------------------------------------------- routes


@blueprint.get("/models")
async def list_models() -> Response:
    models = await _fabric_models()
    return jsonify({"object": "list", "data": [_model_object(m) for m in models]})


@blueprint.get("/models/<path:model_id>")
async def retrieve_model(model_id: str) -> Response:
    for model in await _fabric_models():
        if model.get("id") == model_id:
            return jsonify(_model_object(model))
    raise ApiError(404, f"The model '{model_id}' does not exist", param="model", code="model_not_found")


@blueprint.post("/chat/completions")
async def chat_completions() -> Response:
    req = parse_chat(parse_json_object(await request.get_data()), api_context().config)
    return await respond(req, ChatFormat(f"chatcmpl-{uuid.uuid4().hex}", req.model, req.include_usage,
                                         req.logprobs is not None, tools=tool_replies(req)))


@blueprint.post("/completions")
async def completions() -> Response:
    req = parse_completion(parse_json_object(await request.get_data()), api_context().config)
    return await respond(req, TextFormat(f"cmpl-{uuid.uuid4().hex}", req.model, req.include_usage,
                                         req.logprobs is not None))


@blueprint.post("/responses")
async def responses() -> Response:
    ctx, body = api_context(), checked(parse_json_object(await request.get_data()))
    tenant, earlier = g.api_key or "", []
    if (previous := body.get("previous_response_id")) is not None:
        earlier = ctx.responses.get(tenant, previous)
        if earlier is None:
            raise ApiError.invalid(f"previous_response_id: no response {previous!s:.64} is kept here (this web UI "
                                   f"keeps the last {ctx.responses.max_kept} with store not false, in memory)",
                                   "previous_response_id", "previous_response_not_found")
    messages = turn(body, earlier)
    req = parse_chat(chat_body(body, messages), ctx.config)
    chat = ChatFormat(f"resp_{uuid.uuid4().hex}", req.model, tools=tool_replies(req))
    keep = None if body.get("store") is False else (lambda output: ctx.responses.put(tenant, chat.id, messages, output))
    return await respond(req, ResponsesFormat(chat, settings=echo(body), keep=keep))


def tool_replies(req: GenerationRequest) -> ToolReplies | None:
    """The parser of a reply's calls, among the functions ``req`` offers (None: it offers none)."""
    return ToolReplies(frozenset(function_name(t) for t in req.tools.functions)) if req.tools else None


async def respond(req: GenerationRequest, fmt: ResponseFormat) -> Response:
    """Open the one producer, then stream it as SSE or collect it into one object."""
    ctx = api_context()
    generation = await Generation.open(ctx.client, req, request_id=fmt.id, api_key=g.api_key,
                                       accounting=ctx.accounting)
    headers = {"X-Request-Id": fmt.id}
    if req.stream:
        return sse.response(stream_events(generation, fmt), generation.aclose, headers=headers)
    response = jsonify(fmt.whole(await collect(generation)))
    response.headers.update(headers)
    return response


async def render_api_error(error: ApiError) -> tuple[Response, int]:
    """The app's handler for ``ApiError``, wherever it is raised."""
    return api_error_response(error)


def api_error_response(error: ApiError) -> tuple[Response, int]:
    if error.status >= 500:
        logger.warning("%s %s: %s", request.method, request.path, error)
    response = jsonify(error.body())
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response, error.status


# --------------------------------------------------------------------------- consumers


async def stream_events(generation: Generation, fmt: ResponseFormat) -> AsyncIterator[bytes]:
    """SSE chunks for a generation; a fabric failure mid-stream becomes an error event. A long
    prompt's prefill progress goes as SSE comments, which OpenAI's clients ignore.

    Ends with ``data: [DONE]`` unless the HTTP client went away; closes the generation
    (cancelling the request in the fabric if unfinished) on every path.
    """
    try:
        for chunk in fmt.opening():
            yield fmt.encode(chunk)
        async for event in generation:
            if event.event == "token" and (event.text or event.logprobs):
                for chunk in fmt.deltas(event.text, event.logprobs):
                    yield fmt.encode(chunk)
            elif event.event == "start":
                fmt.started(event)
            elif event.event == "progress":  # a comment: OpenAI clients skip it, the dashboard shows it
                yield sse.comment(progress_comment(event))
            elif event.event == "done":
                for chunk in fmt.endings(event.finish_reason or "stop", event.prompt_tokens, event.completion_tokens):
                    yield fmt.encode(chunk)
                if fmt.include_usage:
                    yield fmt.encode(fmt.usage_chunk(event.prompt_tokens, event.completion_tokens))
    except ApiError as error:
        logger.warning("stream %s failed mid-way: %s", fmt.id, error)
        yield fmt.encode(fmt.error(error.body()))
    except Exception:  # headers are sent: report in-band rather than cut the connection
        logger.exception("stream %s broke", fmt.id)
        yield fmt.encode(fmt.error(INTERNAL_ERROR.body()))
    finally:
        await generation.aclose()
    yield fmt.END


def progress_comment(event) -> str:
    """The SSE comment for a prefill's progress: ``progress {"prefilled":…,"prefill_tokens":…}``."""
    return "progress " + sse.encode_json({"prefilled": event.prefilled, "prefill_tokens": event.prefill_tokens})


async def _fabric_models() -> list[dict]:
    try:
        return await api_context().client.models()
    except Exception as exc:
        error = api_error_from(exc)
        if error is None:
            raise
        raise ApiError(503, f"the tracker did not list models: {error.message}",
                       "server_error", None, "tracker_unavailable") from exc


def _model_object(model: dict) -> dict:
    """An OpenAI model object; fabric details ride along under "meshnet"."""
    details = {k: model[k] for k in ("num_layers", "nodes", "routable") if k in model}
    return {"id": model["id"], "object": "model", "created": 0, "owned_by": "meshnet",
            "meshnet": details}
