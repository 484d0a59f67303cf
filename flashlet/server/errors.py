"""Errors in OpenAI's body shape `{"error": {"message", "type", "param", "code"}}` on every
endpoint: `ApiError`, pydantic validation errors turned into 400s that name the field, the
app's exception handlers, and the error responses the OpenAPI schema documents."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashlet.server.protocol import ErrorResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               408: "invalid_request_error",
               413: "invalid_request_error", 415: "invalid_request_error",
               499: "client_closed_request", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)



# ---- validation errors -> OpenAI error bodies -------------------------------------------------
def _field_path_in(loc, body, missing: bool = False) -> str:
    """pydantic's error location -> `messages[0].content`, read along the request body itself:
    a name is a field where the body has that key (or, last, the required one a `missing` error
    names), and otherwise a union branch's label (a message's role tag, `json_schema`, `str`,
    ...), which is dropped."""
    loc = list(loc)
    if loc[:1] == ["body"]:
        loc = loc[1:]
    parts: list[str] = []
    node = body
    for i, p in enumerate(loc):
        if isinstance(p, int) and isinstance(node, list) and 0 <= p < len(node):
            parts.append(f"[{p}]")
            node = node[p]
        elif isinstance(node, dict) and p in node:
            parts.append(("." if parts else "") + str(p))
            node = node[p]
        elif missing and isinstance(node, dict) and i == len(loc) - 1 and not isinstance(p, int):
            parts.append(("." if parts else "") + str(p))  # a required field, missing
        # else: a union branch's label, not in the body
    return "".join(parts)


def validation_error_response(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    messages, param = [], None
    body = getattr(exc, "body", None)
    for err in errors:
        kind = err.get("type", "")
        path = _field_path_in(err.get("loc", ()), body, missing=kind == "missing")
        if kind == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "invalid JSON")
            messages.append(f"request body is not valid JSON: {detail}")
            continue
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if kind in ("union_tag_invalid", "union_tag_not_found"):  # e.g. a message's role
            tag = str((err.get("ctx") or {}).get("discriminator", "")).strip("'\"")
            path = f"{path}.{tag}" if tag else path
        named = re.match(r"([A-Za-z_]\w*): ", msg)
        if kind == "value_error" and named:  # our validators name the field they check
            path = f"{path}.{named.group(1)}" if path else named.group(1)
            msg = msg[named.end():]
        if param is None and path:
            param = path
        if kind == "missing":
            msg = "field required" if path else "a JSON object body is required"
        elif kind == "extra_forbidden":
            msg = "unknown field (not allowed)"
        elif kind == "none_required":  # an OpenAI field accepted at its neutral value only
            msg = "not supported by this server (only null is accepted)"
        line = f"{path or 'request body'}: {msg}"
        if line not in messages:
            messages.append(line)
    message = "; ".join(messages[:5]) or "invalid request"
    if len(messages) > 5:
        message += f" (and {len(messages) - 5} more)"
    return ApiError(400, message, param).response()


def error_responses(*codes: int) -> dict:
    desc = {400: "Invalid request (the message names the field)", 401: "Missing or wrong API key",
            404: "Unknown model", 503: "Overloaded, loading or shutting down (see Retry-After)",
            500: "Internal error"}
    return {c: {"model": ErrorResponse, "description": desc[c]} for c in codes}


SSE_EVENT_SCHEMA = {  # one event, as OpenAPI 3.2's itemSchema for text/event-stream has it
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a JSON object, or [DONE]"},
                   "event": {"type": "string"}, "id": {"type": "string"},
                   "retry": {"type": "integer"}}}


def sse_response(description: str) -> dict:
    return {200: {"description": description,
                  "content": {"text/event-stream": {"itemSchema": SSE_EVENT_SCHEMA}}}}


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app raises, and FastAPI's and Starlette's own, as an OpenAI error body."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return validation_error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected_error(request: Request, exc: Exception):
        # Starlette's last resort answers a plain-text "Internal Server Error"; clients parse
        # the OpenAI shape (the exception is still logged, with its traceback, by Starlette).
        return ApiError(500, f"internal error: {type(exc).__name__}").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
            message = f"request body is not valid UTF-8: {exc.__cause__.reason} at byte " \
                      f"{exc.__cause__.start}"
        elif exc.status_code == 400 and exc.__cause__ is not None:
            message = f"request body could not be parsed: {exc.__cause__}"
        return ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)).response()
