"""A route whose JSON body is validated into its pydantic model straight from the bytes, and
whose endpoint is then called with that model directly.

FastAPI's handler parses a JSON body with json.loads, validates the dicts and lists with the
body parameter's model, solves the endpoint's parameters and calls it: for one stream, a large
share of the API process's time before the first token. `ModelBodyRoute` serves the usual
request (`Content-Type: application/json`, a body its model accepts) itself: one pass of
`Model.model_validate_json(body)` in pydantic-core, then the endpoint, given the model and the
Request where it asks for one. Everything else (another content type, an empty body, bad JSON,
a validation error) goes to FastAPI's own handler, which reads the body again (Starlette keeps
it once read; a client gone mid-body is gone again), so every error response stays what it was.
A return value that is not a Response is serialized as FastAPI's handler does it.

Strict validation from JSON accepts what strict validation of the parsed dict accepts for the
protocol models' types (str, int, float, bool, lists, dicts, literals) and builds equal models:
tests/server/test_server_json_body.py checks both against plain FastAPI routes.
"""

from __future__ import annotations

import inspect

from fastapi import FastAPI
from fastapi.datastructures import DefaultPlaceholder
from fastapi.routing import APIRoute, serialize_response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response


def model_body_post(app: FastAPI, path: str, **kwargs):
    """`@app.post(path, **kwargs)`, the route a ModelBodyRoute."""

    def decorator(endpoint):
        app.router.add_api_route(path, endpoint, methods=["POST"],
                                 route_class_override=ModelBodyRoute, **kwargs)
        return endpoint

    return decorator


class ModelBodyRoute(APIRoute):
    """An APIRoute that validates a JSON body into the endpoint's model from the bytes and calls
    the endpoint with it; any other request goes through FastAPI's own handler."""

    def get_route_handler(self):
        fastapi_handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:  # a route that needs more of FastAPI than a body and a Request
            return fastapi_handler
        body_name = self.dependant.body_params[0].name
        request_name = self.dependant.request_param_name

        async def handle(request: Request) -> Response:
            if request.headers.get("content-type") != "application/json":
                return await fastapi_handler(request)
            try:
                value = model.model_validate_json(await request.body())
            except StarletteHTTPException:  # limits.py's caps: FastAPI's handler lets them by
                raise
            except Exception:  # noqa: BLE001 - FastAPI's handler answers it as it always has
                return await fastapi_handler(request)  # (it reads the body again: cached)
            kwargs = {body_name: value}
            if request_name is not None:
                kwargs[request_name] = request
            result = await self.dependant.call(**kwargs)
            return result if isinstance(result, Response) else await self._response(result)

        return handle

    async def _response(self, content) -> Response:
        """An endpoint's return value as FastAPI's handler answers it (response_model, if any,
        serialized by pydantic straight to JSON; else jsonable_encoder and the response class)."""
        dump_json = self.response_field is not None and isinstance(self.response_class,
                                                                   DefaultPlaceholder)
        data = await serialize_response(
            field=self.response_field, response_content=content,
            include=self.response_model_include, exclude=self.response_model_exclude,
            by_alias=self.response_model_by_alias,
            exclude_unset=self.response_model_exclude_unset,
            exclude_defaults=self.response_model_exclude_defaults,
            exclude_none=self.response_model_exclude_none, dump_json=dump_json)
        if dump_json:
            return Response(content=data, media_type="application/json")
        response_class = self.response_class
        if isinstance(response_class, DefaultPlaceholder):
            response_class = response_class.value
        return response_class(data)


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model of the route's body, where the endpoint is a coroutine function taking just
    that body (whole, not embedded) and optionally the Request, with the default status code."""
    d = route.dependant
    others = (d.path_params, d.query_params, d.header_params, d.cookie_params, d.dependencies,
              d.response_param_name, d.background_tasks_param_name, d.websocket_param_name,
              d.http_connection_param_name, d.security_scopes_param_name)
    if (len(d.body_params) != 1 or any(others) or route._embed_body_fields
            or route.status_code is not None or not inspect.iscoroutinefunction(d.call)):
        return None
    model = route.body_field.field_info.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None
