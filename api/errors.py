"""Errors users see: a stable code and a sentence, in one shape: {"error": {code, message, param}}."""

from __future__ import annotations

import json
import logging
from typing import Any, get_args

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.constants import REF_PREFIX
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from pydantic_core.core_schema import ErrorType
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers


class DatabaseUnavailable(Exception):
    """The database did not answer a read made outside SQLAlchemy (api.reader): a 503, as for SQLAlchemy's
    OperationalError."""


def not_found(job_id: str) -> ApiError:
    return ApiError(404, "job_not_found", f"No job with id '{job_id}'. List your jobs with GET /jobs.")


def error_body(
    code: str, message: str, param: str | None = None, details: list[dict[str, Any]] | None = None
) -> dict:
    """Every error's JSON: `{"error": {"code", "message", "param"[, "details"]}}`."""
    error: dict[str, Any] = {"code": code, "message": message, "param": param}
    if details is not None:
        error["details"] = details
    return {"error": error}


def error_json(code: str, message: str, param: str | None = None) -> bytes:
    """`error_body` as the bytes of a response written without the framework (api.main.RequestLimits, the
    server's 431)."""
    return json.dumps(error_body(code, message, param), separators=(",", ":")).encode()


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


# pydantic's built-in error types are not our codes; our validators raise PydanticCustomError with ours.
_BUILTIN_ERROR_TYPES = frozenset(get_args(ErrorType))


MESSAGE_PROBLEMS = 5  # the most problems a 422's message names; its details list every one


def validation_response(errors: list[Any]) -> JSONResponse:
    details = []
    for err in errors:
        error_type = str(err.get("type", ""))
        details.append(
            {
                "param": _loc(tuple(err.get("loc", ()))),
                "code": "invalid_value" if error_type in _BUILTIN_ERROR_TYPES else error_type,
                "message": str(err.get("msg", "invalid value")).removeprefix("Value error, "),
            }
        )
    codes = {d["code"] for d in details}
    code = "invalid_request" if codes == {"invalid_value"} or len(codes) > 1 else codes.pop()
    message = "; ".join(f"{d['param']}: {d['message']}" for d in details[:MESSAGE_PROBLEMS])
    if len(details) > MESSAGE_PROBLEMS:  # (a batch of 1000 bad reports made a 150 KB sentence)
        message += f"; and {len(details) - MESSAGE_PROBLEMS:,} more, each in error.details"
    param = details[0]["param"] if len(details) == 1 else None
    return JSONResponse(status_code=422, content=error_body(code, message, param, details))


_JSON_TYPES = ("/json", "+json")


async def read_json_body[Model: BaseModel](request: Request, model: type[Model]) -> Model:
    """The body as `model`, parsed and validated in one pass by pydantic, with the errors FastAPI gives
    for a body parameter (422; `param` names the field). For a hot route: FastAPI's own parsing (json.loads,
    then validating the dict) and parameter solving cost more than the validation itself. Declare the body
    in the route's `openapi_extra` with `json_body(model)`."""
    return parse_json_body(request, await read_body(request), model)


def parse_json_body[Model: BaseModel](request: Request, body: bytes, model: type[Model]) -> Model:
    """`body` (`read_body`'s) as `model`, with the errors FastAPI gives for a body parameter; 422 also
    when the request does not say that it is JSON."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if not content_type.startswith("application/") or not content_type.endswith(_JSON_TYPES):
        raise ApiError(
            422, "invalid_request", "Send the body as JSON, with Content-Type: application/json.", "body"
        )
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        ) from None


async def read_body(request: Request) -> bytes:
    """What `request.body()` returns, read from the ASGI messages here: Starlette's streams it through an
    async generator, a sixth of read_json_body's CPU time for the one message a small body comes in."""
    chunks = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    request._body = body  # what request.body() then returns, as after Starlette's own read
    return body


def json_body(model: type[BaseModel], examples: dict[str, Any] | None = None) -> dict[str, Any]:
    """`openapi_extra` declaring a required JSON body of `model` (`add_schemas` puts the model's schema in
    the document's components)."""
    media: dict[str, Any] = {"schema": {"$ref": f"{REF_PREFIX}{model.__name__}"}}
    if examples:
        media["examples"] = examples
    return {"requestBody": {"required": True, "content": {"application/json": media}}}


def add_schemas(document: dict[str, Any], models: list[type[BaseModel]]) -> None:
    """Put the schemas of `models` (read by routes themselves, so FastAPI did not) and of the models they
    use into the OpenAPI document's components, as FastAPI would have."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        schema = model.model_json_schema(ref_template=REF_PREFIX + "{model}")
        for name, definition in schema.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components.setdefault(model.__name__, schema)


CLIENT_CLOSED_REQUEST = 499


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status, content=error_body(exc.code, exc.message, exc.param), headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(list(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> Response:
        codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        code = codes.get(exc.status_code, "http_error")
        message = str(exc.detail) if exc.detail else code
        if exc.status_code == 404:
            message = "No such route. The API reference is at /docs."
        if exc.status_code == 400:
            if isinstance(exc.__cause__, ClientDisconnect):
                return Response(status_code=CLIENT_CLOSED_REQUEST)  # (as `_gone`: FastAPI read the body)
            # The framework could not read the body (e.g. not UTF-8): the same answer as invalid JSON.
            message = "The request body is not valid UTF-8 JSON; send a JSON object."
            return JSONResponse(status_code=422, content=error_body("invalid_request", message))
        content = error_body(code, message)
        return JSONResponse(status_code=exc.status_code, content=content, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_request: Request, _exc: ClientDisconnect) -> Response:
        # The client went away before it sent all of its body (a killed CLI, a timeout): not our error, and
        # nobody to answer. 499, as nginx logs a request its client closed.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(OperationalError)
    @app.exception_handler(PoolTimeout)
    @app.exception_handler(DatabaseUnavailable)
    async def _database_away(_request: Request, exc: Exception) -> JSONResponse:
        log.warning("database unavailable: %s", type(exc).__name__)
        return JSONResponse(
            status_code=503,
            content=error_body(
                "database_unavailable", "The database is unreachable; retry in a few seconds."
            ),
            headers={"Retry-After": "2"},
        )

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(
            status_code=500,
            content=error_body("internal_error", "Something went wrong on our side; it was logged."),
        )
