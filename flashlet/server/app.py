"""The FastAPI app: the routes (routes_simple.py, routes_openai.py, routes_extra.py) around
one `Server` (frontend.py), OpenAI-shaped errors (errors.py), API-key auth, metrics and request-limit
middleware (limits.py: body size and time caps; the CLI adds the connection caps to uvicorn).

Handlers validate everything they can before queueing (pydantic for the body; tokenization,
context length and KV-pool fit with request_check.py, the rules LLM and the engine use too), so
a bad request is a 400 that names the field and never reaches the engine. Errors use OpenAI's
body shape `{"error": {"message", "type", "param", "code"}}` on every endpoint.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from flashlet.server.errors import ApiError, install_error_handlers
from flashlet.server.frontend import DIRECT_SEND, ReleaseGenerations, Server, ServerConfig
from flashlet.server.limits import LimitsCollector, LimitsMiddleware, LimitStats
from flashlet.server.metrics import MetricsMiddleware
from flashlet.server.routes_extra import add_extra_routes
from flashlet.server.routes_openai import add_openai_routes
from flashlet.server.routes_simple import add_simple_routes

__all__ = ["ApiError", "ServerConfig", "create_app"]

STATIC_DIR = Path(__file__).parent / "static"


def create_app(loop, config: ServerConfig | None = None) -> FastAPI:
    """Build the app around a started engine client: a CoreClient (engine-core processes) or an
    EngineLoop (the engine on a thread). Several apps may share one."""
    config = config or ServerConfig()
    server = Server(loop, config)
    # FastAPI's own OpenTelemetry spans and metrics off: the server keeps its metrics in
    # Prometheus (metrics.py), and FastAPI would ask three global providers (environment
    # lookups) on every request whether they are set up (~3 us of each request).
    app = FlashletApp(title="flashlet", version="0.1.0", docs_url=None, redoc_url=None,
                      description="flashlet inference server: /generate and an "
                      "OpenAI-compatible API",
                      telemetry={"tracing": False, "metrics": False, "logs": False})
    app.state.server = server
    install_error_handlers(app)
    add_simple_routes(app, server)
    add_openai_routes(app, server)
    add_extra_routes(app, server)  # after the chat route, which /v1/responses runs on
    _add_pages(app)
    _customize_openapi(app)
    app.add_middleware(ReleaseGenerations)  # innermost: what a request started, it releases
    app.state.limit_stats = LimitStats(config.limits)  # uvicorn_options() takes it too
    server.metrics.registry.register(LimitsCollector(app.state.limit_stats))
    # Each middleware acts on a response's start and end only (an SSE response's other chunks
    # pass none of them: EventStream); one that rewrites bodies would need EventStream changed.
    app.add_middleware(LimitsMiddleware, stats=app.state.limit_stats)
    app.add_middleware(AuthMiddleware, api_key=config.api_key)
    app.add_middleware(MetricsMiddleware, metrics=server.metrics, server=server)
    if config.allowed_origins:  # outermost: a preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    return app


class FlashletApp(FastAPI):
    """FastAPI keeping the HTTP server's own `send` in the scope, for EventStream's events."""

    async def __call__(self, scope, receive, send):
        scope[DIRECT_SEND] = send
        await super().__call__(scope, receive, send)


def _add_pages(app: FastAPI) -> None:
    """The chat page at / and Swagger UI at /docs, both from files served here (no CDN)."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url, title="flashlet API",
                                   swagger_js_url="/static/swagger/swagger-ui-bundle.js",
                                   swagger_css_url="/static/swagger/swagger-ui.css",
                                   swagger_favicon_url="data:,")


def _customize_openapi(app: FastAPI) -> None:
    """FastAPI documents validation errors as 422 with its own body; ours are 400 with the
    OpenAI error body (already documented on each route)."""
    original = app.openapi

    def openapi():
        if app.openapi_schema is None:
            schema = original()
            for ops in schema.get("paths", {}).values():
                for op in ops.values():
                    op.get("responses", {}).pop("422", None)
            comps = schema.get("components", {}).get("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class AuthMiddleware:
    """With an API key set, every endpoint but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if (self.api_key is None or scope["type"] != "http" or scope.get("path") == "/health"
                or self._authorized(scope)):
            return await self.app(scope, receive, send)
        error = ApiError(401, "missing or invalid API key: send `Authorization: Bearer <key>`",
                         code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    token.strip().encode(), self.api_key.encode())
        return False
