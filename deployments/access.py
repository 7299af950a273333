"""Who may call the API and how much one request may send: optional Bearer API keys (401 without
a valid one) and a request body limit (413), both checked before a body is parsed.

The keys come from `api_keys=` or, when the deployment names none, from the FASER_API_KEYS
environment variable (comma-separated); none at all leaves the API open. /health stays open for
probes. Keys are compared in constant time, so a wrong key's timing says nothing of a right one.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from deployments.openai_schemas import ErrorInfo, ErrorResponse

API_KEYS_ENV = "FASER_API_KEYS"
MAX_BODY_BYTES = 1 << 20  # a 128k-token prompt as JSON text fits several times over
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True, slots=True)
class Access:
    api_keys: frozenset[str] = frozenset()  # empty: no key needed
    max_body_bytes: int = MAX_BODY_BYTES

    @classmethod
    def from_settings(cls, api_keys: Iterable[str] | None, max_body_bytes: int) -> Access:
        """`api_keys` None: the environment's FASER_API_KEYS."""
        if api_keys is None:
            api_keys = os.environ.get(API_KEYS_ENV, "").split(",")
        return cls(frozenset(k.strip() for k in api_keys if k.strip()), max_body_bytes)

    def authorised(self, header: str | None) -> bool:
        if not self.api_keys:
            return True
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        return any(hmac.compare_digest(token.strip(), key) for key in self.api_keys)


def install(app: FastAPI, access: Access) -> None:
    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]):
        if _route(request) in OPEN_PATHS:
            return await call_next(request)
        if not access.authorised(request.headers.get("authorization")):
            return _error(401, "a valid API key is required: Authorization: Bearer KEY",
                          "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > access.max_body_bytes:
            return _too_large(access.max_body_bytes)
        if request.method == "POST" and len(await request.body()) > access.max_body_bytes:
            return _too_large(access.max_body_bytes)  # chunked bodies declare no length
        return await call_next(request)


def _route(request: Request) -> str:
    """The path below the app's route prefix (Ray Serve mounts the app under it)."""
    path, root = request.scope["path"], request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _too_large(limit: int) -> JSONResponse:
    return _error(413, f"the request body is larger than this server's limit of {limit} bytes",
                  "request_too_large")


def _error(status: int, message: str, code: str, headers: dict | None = None) -> JSONResponse:
    info = ErrorInfo(message=message, type="invalid_request_error", code=code)
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status, headers=headers)
