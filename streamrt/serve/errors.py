"""Error JSON, never a traceback: OpenAI's `{"error": {"message", "type", "param", "code"}}`,
and on /v1/messages Anthropic's `{"type": "error", "error": {"type", "message"}}` (the message
names the field there, as Anthropic has no `param`).

`ApiError` is what a route raises; `install` maps it, pydantic validation errors (the
field named as `messages[0].role`), unknown routes and anything unexpected to that body.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from streamrt.serve.schemas import first_error

log = logging.getLogger("streamrt.serve")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_PREFIX = "/v1/messages"
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_body(status: int, message: str, param: str | None = None) -> dict:
    if param and param not in message:
        message = f"{param}: {message}"
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(e: ApiError, path: str = "") -> JSONResponse:
    if path.startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_body(e.status, e.message, e.param), e.status, headers=e.headers)
    return JSONResponse(error_body(e.message, type=e.type, param=e.param, code=e.code), e.status, headers=e.headers)


def from_validation(exc: ValidationError) -> ApiError:
    """A body validation error as a 400 naming its field: of a union's branch errors, the one
    that got furthest into the value (a list of parts beats 'not a string')."""
    errors = exc.errors(include_url=False)
    bad = [e for e in errors if e["type"] == "json_invalid"]
    if bad:
        why = bad[0].get("ctx", {}).get("error", "")
        return ApiError(400, f"request body is not valid JSON ({why})" if why else "request body is not valid JSON",
                        code="invalid_json")
    unknown = [str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
    if unknown:  # OpenAI's own words for it
        return ApiError(400, f"Unrecognized request argument{'s' if len(unknown) > 1 else ''} supplied: "
                        f"{', '.join(unknown)}", param=unknown[0], code="unknown_parameter")
    param, msg, kind = first_error(exc)
    if kind == "missing":
        return ApiError(400, f"missing required field {param!r}", param=param, code="missing_required_parameter")
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param or None, code="invalid_value")


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        return error_response(exc, request.url.path)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        return error_response(from_validation(exc), request.url.path)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        e = ApiError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None))
        return error_response(e, request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("streamrt serve: internal error on %s", request.url.path)
        e = ApiError(500, f"internal error ({type(exc).__name__})", type="server_error")
        return error_response(e, request.url.path)
