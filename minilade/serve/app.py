"""The HTTP layer (Starlette on asyncio): routes, the API key, body limits, errors, Server-Sent Events.

Handlers only check and translate; every generation runs in the engine (engine.py), which they reach through its
bounded queue. The model loads in a thread after the server starts, so GET /health can say 503 until it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..drafts.history import DraftHistory
from ..text_stream import Generation
from .engine import Engine, Job
from .errors import APIError, invalid, unavailable
from .metrics import Metrics
from .prefill import PREFILL_CHUNK, PrefixCache
from .protocol import Request as Parsed
from .protocol import Served, parse_request
from .responses import Answer, sse

log = logging.getLogger("minilade.serve")
DISCONNECT_POLL_S = 0.5  # how often a waiting non-streaming request checks that its client is still there


@dataclass
class Limits:
    max_concurrent: int = 8
    queue: int = 32
    max_body: int = 4 << 20  # bytes
    stop_timeout_s: float = 10.0
    prompt_cache_bytes: int = 512 << 20  # finished requests' K/V kept for prompts that begin with them
    prefill_chunk: int = PREFILL_CHUNK  # prompt rows per shared pass


@dataclass
class Planning:
    """together: greedy auto requests size their steps for the whole shared pass (planner.py), not alone.
    history_tokens: greedy auto requests also draft from earlier answers, kept up to this many tokens (0: off).
    Neither changes an answer, only its speed."""

    together: bool = True
    history_tokens: int = 0


class Service:
    """The server's state: loading, then serving through one engine; stopped once at shutdown."""

    def __init__(self, load: Callable[[], Served], model_id: str, *, api_key: str | None = None,
                 limits: Limits = Limits(), planning: Planning = Planning(),
                 on_fatal: Callable[[], None] = lambda: None) -> None:
        self.load, self.model_id, self.api_key, self.limits, self.on_fatal = load, model_id, api_key, limits, on_fatal
        self.planning = planning
        self.metrics = Metrics()
        self.served: Served | None = None
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self.created = int(time.time())

    def start_loading(self) -> None:
        threading.Thread(target=self._load, name="minilade-load", daemon=True).start()

    def _load(self) -> None:
        try:
            served = self.load()
            prefixes = PrefixCache(self.limits.prompt_cache_bytes)
            history = DraftHistory(self.planning.history_tokens) if self.planning.history_tokens else None
            engine = Engine(served.llm, max_concurrent=self.limits.max_concurrent, queue_size=self.limits.queue,
                            metrics=self.metrics, prefixes=prefixes, plan_together=self.planning.together,
                            history=history, prefill_chunk=self.limits.prefill_chunk)
            engine.start()
            self.served, self.engine = served, engine
            log.warning("minilade.serve: ready, serving %s: %s; requests' decoding steps in %s", self.model_id,
                        served.llm.setup, engine.sharing)
        except Exception as error:  # noqa: BLE001 -- a model that does not load ends the server, in one line
            self.load_error = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
            log.error("minilade.serve: cannot load the model: %s", self.load_error)
            self.on_fatal()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop(self.limits.stop_timeout_s)

    def ready(self) -> tuple[Served, Engine]:
        if self.served is None or self.engine is None:
            raise unavailable("the model is still loading")
        return self.served, self.engine

    def authorize(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                           code="invalid_api_key")


class Outbox:
    """A job's events, handed from its worker thread to the request's coroutine."""

    def __init__(self) -> None:
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

    def deliver(self, kind: str, value: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


def failure(kind: str, value: object) -> APIError:
    """The APIError for a job that ended without its answer."""
    if kind == "cancelled":
        return unavailable("the generation was cancelled: the server is shutting down")
    if isinstance(value, ValueError):
        return invalid(str(value))
    return APIError(500, f"the generation failed: {type(value).__name__}", type="server_error", code="internal_error")


class EventStream(StreamingResponse):
    """text/event-stream whose on_close runs however the stream ends (finished, or its client gone)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass
        finally:
            self.on_close()


def create_app(service: Service) -> Starlette:
    async def health(request: Request) -> Response:
        if service.engine is None:
            return JSONResponse({"status": "error" if service.load_error else "loading"}, status_code=503,
                                headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        service.authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": service.model_id, "object": "model",
                                                         "created": service.created, "owned_by": "minilade"}]})

    async def metrics(request: Request) -> Response:
        service.authorize(request)
        return PlainTextResponse(service.metrics.render(), media_type="text/plain; version=0.0.4")

    async def completions(request: Request) -> Response:
        return await generate(service, request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(service, request, chat=True)

    async def on_api_error(request: Request, error: APIError) -> Response:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    async def on_http_error(request: Request, error: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = f"{request.method} {request.url.path}: {error.detail}"
        return await on_api_error(request, APIError(error.status_code, message, code=code))

    async def on_crash(request: Request, error: Exception) -> Response:
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(), status_code=500)

    routes = [Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        service.start_loading()
        yield
        await asyncio.to_thread(service.stop)

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: on_api_error, HTTPException: on_http_error, Exception: on_crash})
    return CountRequests(app, service.metrics, {route.path for route in routes})


async def generate(service: Service, request: Request, chat: bool) -> Response:
    service.authorize(request)
    served, engine = service.ready()
    parsed = parse_request(await read_json(request, service.limits.max_body), chat, served)
    outbox = Outbox()
    job = Job(parsed.prompt_ids, parsed.settings, outbox.deliver)
    engine.submit(job)
    answer = Answer(chat, served.model_id)
    if parsed.stream:
        return EventStream(stream_events(answer, parsed, job, outbox), on_close=lambda: engine.cancel(job))
    try:
        generation = await whole_generation(outbox, request)
    finally:
        engine.cancel(job)  # nothing happens to a finished job; a client gone frees its place
    if generation is None:
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    return JSONResponse(answer.whole(generation))


async def read_json(request: Request, limit: int) -> object:
    """The body decoded as JSON: a 413 past `limit` bytes (read no further), a 400 when it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"the request body is not valid JSON: {error}", code="invalid_json") from None


async def whole_generation(outbox: Outbox, request: Request) -> Generation | None:
    """The finished generation, or None when the client went away first; an APIError when it failed."""
    while True:
        try:
            kind, value = await asyncio.wait_for(outbox.queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
            if await request.is_disconnected():
                return None
            continue
        if kind == "done":
            return value
        if kind != "piece":
            raise failure(kind, value)


async def stream_events(answer: Answer, parsed: Parsed, job: Job, outbox: Outbox) -> AsyncIterator[bytes]:
    """The stream's events. One piece of text is held back, so that the last content chunk carries the
    finish_reason."""
    if answer.chat:
        yield sse(answer.chunk(None, first=True))
    held = None
    while True:
        kind, value = await outbox.queue.get()
        if kind == "piece":
            if held is not None:
                yield sse(answer.chunk(held))
            held = value
        elif kind == "done":
            yield sse(answer.chunk(held, value))
            if parsed.include_usage:
                yield sse(answer.usage_chunk(value))
            yield sse("[DONE]")
            return
        else:
            yield sse(failure(kind, value).body())
            return


class CountRequests:
    """ASGI middleware: counts every HTTP response by route and status (minilade_requests_total)."""

    def __init__(self, app, metrics: Metrics, paths: set[str]) -> None:
        self.app, self.metrics, self.paths = app, metrics, paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.add("minilade_requests_total", endpoint=path, status=str(message["status"]))
            await send(message)

        await self.app(scope, receive, counted)
