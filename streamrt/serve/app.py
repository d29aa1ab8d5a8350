"""The FastAPI application: routes, the API-key check, per-request metrics.

    GET  /v1/models             the one served model
    GET  /v1/models/{model}     its card (404 for any other id)
    POST /v1/chat/completions   chat in XTML frames (JSON or SSE)      -> routes.chat_completions
    POST /v1/completions        raw text continuation (JSON or SSE)     -> routes.completions
    POST /v1/messages           Anthropic Messages (JSON or SSE)        -> anthropic.messages
    POST /v1/messages/count_tokens  a Messages request's input tokens   -> anthropic.count_tokens
    POST /v1/responses          OpenAI Responses, stateless (JSON or SSE) -> responses.responses
    GET  /health                liveness, batch size and queue depth
    GET  /metrics               Prometheus text                         -> metrics.ServeMetrics
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import Response

from streamrt import __version__
from streamrt.serve import anthropic, errors, responses
from streamrt.serve import schemas as S
from streamrt.serve.metrics import CONTENT_TYPE
from streamrt.serve.routes import ServerState, chat_completions, completions

ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/responses", "/health", "/metrics")
MODEL_ROUTE = "/v1/models/{model}"  # its metrics label: one series, not one per id asked for


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="streamrt", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    app.add_middleware(_Gate, state=state)

    @app.get("/v1/models")
    async def models():
        return S.dump(S.ModelList(data=[S.ModelCard(id=state.model_id, created=state.created)]))

    @app.get("/v1/models/{model:path}")  # ids may hold slashes: org/name, as Hugging Face's
    async def model(model: str):
        if model != state.model_id:
            raise errors.ApiError(404, f"model {model!r} is not served here (this server serves {state.model_id!r})",
                                  param="model", code="model_not_found", type="not_found_error")
        return S.dump(S.ModelCard(id=state.model_id, created=state.created))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await chat_completions(state, request)

    @app.post("/v1/completions")
    async def complete(request: Request):
        return await completions(state, request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await anthropic.messages(state, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await anthropic.count_tokens(state, request)

    @app.post("/v1/responses")
    async def respond(request: Request):
        return await responses.responses(state, request)

    @app.get("/health")
    async def health():
        e = state.engine
        return {"status": "ok", "model": state.model_id, "batch_size": e.batch_size, "queue_depth": e.queue_depth}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return app


class _Gate:
    """Pure ASGI middleware (streaming-safe): the API key on /v1/*, and a count per endpoint and status."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else MODEL_ROUTE if path.startswith("/v1/models/") else "other"
        status = [500]

        async def counted(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self.state.api_key and path.startswith("/v1/") and not self._authorized(scope):
                e = errors.ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY, or x-api-key)",
                                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                return await errors.error_response(e, path)(scope, receive, counted)
            await self.app(scope, receive, counted)
        finally:
            self.state.metrics.requests.labels(endpoint, str(status[0])).inc()

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        want = self.state.api_key.encode()
        if b"x-api-key" in headers:  # Anthropic's header; the key compared in constant time
            return hmac.compare_digest(headers[b"x-api-key"].strip(), want)
        scheme, _, key = headers.get(b"authorization", b"").strip().partition(b" ")
        # the scheme is case-insensitive (RFC 9110)
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), want)
