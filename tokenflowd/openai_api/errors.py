"""Errors as the OpenAI API shapes them: {"error": {"message", "type", "param", "code"}}, `code` a
string or null.

Every 4xx says what to change. A handler raises APIError; the middleware also turns aiohttp's own
HTTP errors (unknown route, wrong method, body too large) and any unexpected exception into the
same shape, so a client never sees an HTML page or a bare 500. Each error response carries its
reason (REFUSAL) for whoever counts refusals (daemon/api/refusals.py).
"""
from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from tokenflowd.openai_api.schema import ErrorDetail, ErrorResponse

log = logging.getLogger("tokenflowd.api")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable"}


MAX_BODY_SIZE = web.AppKey("max_body_size", int)
REFUSAL = web.ResponseKey("refusal", str)  # an error response's reason: its code, else what its status means
_REASONS = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
            408: "timeout", 409: "conflict", 413: "body_too_large", 429: "rate_limited", 503: "unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    body = ErrorResponse(ErrorDetail(message, _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
                                     param, code))
    response = web.Response(status=status, body=msgspec.json.encode(body), content_type="application/json",
                            headers=headers)
    response[REFUSAL] = code or _REASONS.get(status, "server_error" if status >= 500 else "invalid_request")
    return response


def error_event(message: str, status: int = 500, code: str | None = None) -> bytes:
    """An error inside an open SSE stream (the openai client raises APIError on it)."""
    detail = ErrorDetail(message, "server_error" if status >= 500 else "invalid_request_error", None, code)
    return b"data: " + msgspec.json.encode(ErrorResponse(detail)) + b"\n\n"


def not_utf8(e: UnicodeDecodeError) -> APIError:
    """A body whose bytes are not UTF-8 (JSON's encoding): 400, naming the bad byte."""
    bad = e.object[e.start : e.start + 1].hex() if isinstance(e.object, bytes) else "?"
    return APIError(400, f"the body is not valid UTF-8 (byte 0x{bad} in a string: {e.reason}): send JSON encoded "
                         "as UTF-8", code="invalid_utf8")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e.status, e.message, e.param, e.code, e.headers)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_SIZE]
        return error_response(413, f"the request body is larger than this server's limit of {limit} bytes: "
                                   "send a shorter prompt", code="body_too_large")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = {404: f"no such endpoint: {request.method} {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(e.status, e.reason)
        return error_response(e.status, message, headers={k: v for k, v in e.headers.items() if k == "Allow"})
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "internal server error (logged on the server)")
