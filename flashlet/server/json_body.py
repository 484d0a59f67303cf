"""A route whose JSON body is validated into its pydantic model straight from the bytes.

FastAPI reads a JSON body with `Request.json()` (json.loads into dicts and lists) and then
validates that with the body parameter's model; `Model.model_validate_json(body)` does both in
one pass in pydantic-core, with no Python objects in between. `ModelBodyRoute` hands FastAPI's
own handler a request whose `json()` returns that model: FastAPI then checks the content type,
the empty body, the size and time caps (limits.py, as the body is read) exactly as before, and its
validation of the body passes the model instance through as it is (pydantic does not revalidate
an instance of the model). A body that the model rejects is parsed again with json.loads, so
FastAPI's own path answers it, and every error response stays what it was. Strict validation
from JSON accepts what strict validation of the parsed dict accepts for these models' types
(str, int, float, bool, lists, dicts, literals): tests/server/test_server_json_body.py checks that.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.requests import Request


def model_body_post(app: FastAPI, path: str, **kwargs):
    """`@app.post(path, **kwargs)`, the route a ModelBodyRoute."""

    def decorator(endpoint):
        app.router.add_api_route(path, endpoint, methods=["POST"],
                                 route_class_override=ModelBodyRoute, **kwargs)
        return endpoint

    return decorator


class ModelBodyRoute(APIRoute):
    """An APIRoute that parses and validates a pydantic-model body in one pass from the bytes;
    any body the model rejects goes through FastAPI's own parsing and errors."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:  # no body, several body parameters, or not a pydantic model
            return handler

        async def handle(request: Request):
            # (the same scope, receive and send: only json() differs)
            return await handler(_ModelJsonRequest(request.scope, request.receive,
                                                   request._send, model))

        return handle


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model of the route's one body parameter, when FastAPI validates the whole body
    with it (not embedded under the parameter's name)."""
    field = route.body_field
    if field is None or route._embed_body_fields or len(route.dependant.body_params) != 1:
        return None
    model = field.field_info.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


class _ModelJsonRequest(Request):
    """A request whose parsed JSON is the body model itself, when the model accepts the body."""

    def __init__(self, scope, receive, send, model: type[BaseModel]):
        super().__init__(scope, receive, send)
        self._model = model

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = self._model.model_validate_json(body)
            except Exception:  # noqa: BLE001 - whatever it was, FastAPI's own path meets it
                self._json = json.loads(body)  # and answers as it always has
        return self._json
