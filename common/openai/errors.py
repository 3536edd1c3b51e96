"""Failures as OpenAI reports them: ``{"error": {"message", "type", "param", "code"}}``
with the HTTP status its clients expect.

    400 invalid_request_error   a bad parameter (param names it) or undecodable JSON
    401 invalid_request_error   missing or unknown bearer token (code invalid_api_key)
    404 invalid_request_error   a model this front does not serve (code model_not_found)
    429 rate_limit_error        the verify said RESOURCE_EXHAUSTED (its queue is full)
    503 server_error            the verify said UNAVAILABLE (down, stopping, out of pages)
    504 server_error            the verify's deadline passed
    500 server_error            anything else

Handlers raise ``APIError``; the app's exception handlers turn it (and FastAPI's own
validation and routing errors) into the JSON above. A failure after a stream's
first event goes out as one ``data: {"error": ...}`` event (see ``app.py``).
"""

from __future__ import annotations

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from treespec.common.client import TreespecError

_STATUS_TYPE = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                429: "rate_limit_error"}
# the verify's status -> (HTTP status, code)
_FROM_GRPC = {grpc.StatusCode.INVALID_ARGUMENT: (400, None),
              grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_exceeded"),
              grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
              grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout")}


class APIError(Exception):
    """A failure with its HTTP status; param names the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def body(self) -> dict:
        return {"error": {"message": self.message,
                          "type": _STATUS_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


def from_rpc(err: TreespecError) -> APIError:
    """The verify's failure as the front reports it."""
    status, code = _FROM_GRPC.get(err.code, (500, None))
    return APIError(status, f"verify service: {err.code.name}: {err.details}", code=code)


def _json(e: APIError) -> JSONResponse:
    return JSONResponse(e.body, status_code=e.status)


async def api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _json(exc)


async def validation_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's request validation (types, ranges, JSON) as one 400 naming the field."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return _json(bad_request(None, f"the body is not valid JSON: {first.get('msg')}"))
    param = ".".join(loc) or None
    return _json(bad_request(param, f"{param}: {first.get('msg')}" if param
                             else str(first.get("msg"))))


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown route 404, wrong method 405) in the same shape."""
    assert isinstance(exc, HTTPException)
    return _json(APIError(exc.status_code, str(exc.detail)))


async def internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: 500 in the same shape (Starlette logs the traceback)."""
    return _json(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


HANDLERS = {APIError: api_error, RequestValidationError: validation_error,
            HTTPException: http_error, Exception: internal_error}
