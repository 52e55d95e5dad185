"""The FastAPI app: one ServingEngine per app (started and stopped with it), the OpenAI
endpoints, health and metrics, and OpenAI error JSON for every error.

    app = create_app(engine_dir, api_key="secret")
    uvicorn.run(app, host="127.0.0.1", port=8000)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from pathlib import Path
from typing import Callable

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.errors import ConfigError
from kiln.runtime.executor import ExecutorConfig
from kiln.serve import chat, completions, tokenize
from kiln.serve.engine import ServingEngine
from kiln.serve.protocol import (ApiError, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                 CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                 LoadLoraAdapterRequest, ModelCard, ModelList, TokenizeRequest, TokenizeResponse)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20  # a request body past 32 MiB is refused (413) before it is read whole


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_message(err: dict) -> str:
    where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
    if err.get("type") == "extra_forbidden":
        return f"{where}: kiln does not support this field"
    return f"{where}: {err.get('msg')}"


# Documented in the OpenAPI schema, so clients (and schema fuzzers) know every answer.
ERRORS = {code: {"model": ErrorResponse, "description": text} for code, text in (
    (400, "invalid request (the error names the field)"), (401, "invalid or missing API key"),
    (404, "unknown model"), (500, "kiln failed while serving this request (the engine goes on)"),
    (503, "the request queue is full (Retry-After), the server is shutting down, or its engine failed"))}
_HEALTH = {"content": {"application/json": {"schema": {"type": "object"}}}}
# Each server-sent event: a JSON chunk (or an error) in ``data``, the last one "[DONE]".
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
              "required": ["data"]}
EVENT_STREAM = {"content": {"text/event-stream": {"schema": _SSE_EVENT}},
                "description": "the response, or with stream=true server-sent events ending in [DONE]"}


def create_app(engine_dir: str | Path, tokenizer_dir: str | Path | None = None, api_key: str | None = None,
               executor_config: ExecutorConfig | None = None, served_model_name: str | None = None,
               lora_adapters: dict[str, str | Path] | None = None,
               on_world_error: Callable[[BaseException], None] | None = None,
               request_timeout: float | None = None, tool_call_parser: str = "hermes") -> FastAPI:
    """An OpenAI-compatible app serving the engine in ``engine_dir`` (the executor starts with the
    app), and each LoRA adapter of ``lora_adapters`` (name -> directory) as a model of that name.
    ``on_world_error``: called once if another rank of the engine's world dies;
    ``request_timeout``: seconds a request may run (queueing included) before it is ended;
    ``tool_call_parser``: how the model writes tool calls (a name in ``TOOL_CALL_PARSERS``)."""
    name = served_model_name or Path(engine_dir).name

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = await asyncio.to_thread(ServingEngine, engine_dir, tokenizer_dir, executor_config, name,
                                         on_world_error, request_timeout, tool_call_parser)
        try:  # the engine's built-in adapters, then those given here
            built_in = engine.executor.engine.lora_adapter_dirs
            for lora_name, path in {**built_in, **(lora_adapters or {})}.items():
                engine.load_lora(lora_name, path)
        except ApiError as e:
            await asyncio.to_thread(engine.shutdown)
            raise ConfigError(f"--lora {lora_name}={path}: {e.message}") from None
        engine.start(asyncio.get_running_loop())
        app.state.engine = engine
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="kiln", lifespan=lifespan, max_body_size=MAX_BODY_BYTES)  # larger bodies: 413
    _install_error_handlers(app)
    _add_health_routes(app)
    _add_api_routes(app, _key_check(api_key))
    return app


def _engine(request: HttpRequest) -> ServingEngine:
    return request.app.state.engine


def _key_check(api_key: str | None) -> Callable:
    """The dependency that checks ``Authorization: Bearer KEY`` (nothing without a key)."""
    async def check_key(request: HttpRequest) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key", None, "authentication_error", "invalid_api_key")

    return check_key


async def _accepting(request: HttpRequest) -> None:
    """Requests are refused while the server drains or after its engine failed."""
    e = _engine(request)
    if e.failure is not None:
        raise ApiError(503, f"the engine stopped after an internal error: {e.failure!r}", None, "server_error")
    if e.draining:
        raise ApiError(503, "the server is shutting down", None, "server_error", headers={"Connection": "close"})


def _check_model(engine: ServingEngine, model: str) -> None:
    if model != engine.model_name and model not in engine.lora_task_ids:
        served = [engine.model_name, *engine.lora_task_ids]
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", "model",
                       code="model_not_found")


def _install_error_handlers(app: FastAPI) -> None:
    """Every error answers OpenAI error JSON."""
    @app.exception_handler(ApiError)
    async def on_api_error(_, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        message = "; ".join(_validation_message(err) for err in errors) or "invalid request"
        return _error(ApiError(400, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_, e: StarletteHTTPException):  # unknown routes, wrong methods
        return _error(ApiError(e.status_code, str(e.detail), None, headers=e.headers))

    @app.exception_handler(Exception)
    async def on_unexpected_error(_, e: Exception):  # a bug while serving one request: a 500 for it alone
        logger.error("request failed", exc_info=e)
        return _error(ApiError.internal(e))


def _add_health_routes(app: FastAPI) -> None:
    @app.get("/health", responses={200: {**_HEALTH, "description": "alive (status ok, or draining)"},
                                   503: {**_HEALTH, "description": "the engine failed: restart the server"}})
    async def liveness(request: HttpRequest):
        """Liveness: 503 once the engine failed (it cannot serve again), else 200."""
        e = _engine(request)
        if e.failure is not None:
            return JSONResponse({"status": "failed", "error": repr(e.failure)}, status_code=503)
        return {"status": "draining" if e.draining else "ok"}

    @app.get("/health/ready", responses={200: {**_HEALTH, "description": "taking requests"},
                                         503: {**_HEALTH, "description": "draining, or the engine failed"}})
    async def readiness(request: HttpRequest):
        """Readiness: 200 while new requests are taken, 503 while draining or once the engine failed."""
        e = _engine(request)
        if e.failure is not None or e.draining:
            return JSONResponse({"status": "failed" if e.failure is not None else "draining"}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}})
    async def metrics(request: HttpRequest):
        e = _engine(request)
        return PlainTextResponse(e.metrics.render(e.gauges()), media_type="text/plain; version=0.0.4")


def _engine_of(request: HttpRequest, model: str | None) -> ServingEngine:
    """The app's engine, once ``model`` (where a request names one) is a model it serves."""
    engine = _engine(request)
    if model is not None:
        _check_model(engine, model)
    return engine


def _add_api_routes(app: FastAPI, check_key: Callable) -> None:
    @app.get("/v1/models", dependencies=[Depends(check_key)], response_model=ModelList,
             responses={401: ERRORS[401]})
    async def models(request: HttpRequest):
        e = _engine(request)
        adapters = [ModelCard(id=lora, parent=e.model_name) for lora in e.lora_task_ids]
        return ModelList(data=[ModelCard(id=e.model_name), *adapters])

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(check_key)], response_model=ModelCard,
              responses={400: ERRORS[400], 401: ERRORS[401]})
    async def load_lora_adapter(body: LoadLoraAdapterRequest, request: HttpRequest):
        """Serve a LoRA adapter found on the server under a new model name; answers its model card."""
        e = _engine(request)
        await asyncio.to_thread(e.load_lora, body.lora_name, body.lora_path)
        return ModelCard(id=body.lora_name, parent=e.model_name)

    @app.post("/tokenize", dependencies=[Depends(check_key)], response_model=TokenizeResponse,
              responses={400: ERRORS[400], 401: ERRORS[401], 404: ERRORS[404]})
    async def tokenize_text(body: TokenizeRequest, request: HttpRequest):
        """A prompt's (or chat messages') token ids, as the completion endpoints take them."""
        return tokenize.tokenize(_engine_of(request, body.model), body)

    @app.post("/detokenize", dependencies=[Depends(check_key)], response_model=DetokenizeResponse,
              responses={400: ERRORS[400], 401: ERRORS[401], 404: ERRORS[404]})
    async def detokenize_ids(body: DetokenizeRequest, request: HttpRequest):
        """The text of token ids."""
        return tokenize.detokenize(_engine_of(request, body.model), body)

    @app.post("/v1/completions", dependencies=[Depends(check_key), Depends(_accepting)],
              response_model=CompletionResponse, responses={200: EVENT_STREAM, **ERRORS})
    async def create_completion(body: CompletionRequest, request: HttpRequest):
        _check_model(_engine(request), body.model)
        return await completions.serve(_engine(request), body, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key), Depends(_accepting)],
              response_model=ChatCompletionResponse, responses={200: EVENT_STREAM, **ERRORS})
    async def create_chat_completion(body: ChatCompletionRequest, request: HttpRequest):
        _check_model(_engine(request), body.model)
        return await chat.serve(_engine(request), body, request)
