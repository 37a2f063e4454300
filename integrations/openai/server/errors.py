"""Every failure as an OpenAI-style JSON error body: the mapping from ragkv's exceptions
and the app's exception handlers; never a traceback."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ragkv.errors import (
    CacheCapacityError,
    EngineClosedError,
    InvalidInputError,
    PromptTooLongError,
    RagkvError,
    RequestAbortedError,
)
from ragkv.integrations.openai.limits import APIError

if TYPE_CHECKING:
    from ragkv.integrations.openai.server.state import Served

logger = logging.getLogger(__name__)


class ClientGone(Exception):
    """The client closed the connection; nobody is left to answer."""


# -- errors -----------------------------------------------------------------------------------


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


def timeout_error(served: Served) -> APIError:
    return APIError(
        504,
        f"the request did not finish within {served.request_timeout_s:g} s and was aborted",
        type="timeout_error",
        code="timeout",
    )


def internal_error() -> APIError:
    return APIError(500, "internal server error; see the server log", type="server_error")


def api_error(exc: RagkvError) -> APIError:
    if isinstance(exc, PromptTooLongError | CacheCapacityError):
        return APIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, InvalidInputError):
        return APIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineClosedError | RequestAbortedError):
        return APIError(503, str(exc), type="server_error", code="unavailable")
    return APIError(500, str(exc), type="server_error")


def add_error_handlers(app: FastAPI) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def api_error_body(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RagkvError)
    async def ragkv_error(request: Request, exc: RagkvError) -> JSONResponse:
        error = api_error(exc)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        error = APIError(exc.status_code, str(exc.detail), code=None)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(APIError(400, str(exc)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return JSONResponse(internal_error().body(), status_code=500)
