"""The HTTP layer: OpenAI's API over an engine, knowing nothing of batching.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming by server-sent events
with `"stream": true`), `GET /v1/models`, `GET /healthz`, `GET /metrics` (Prometheus), `GET /v1/drift`.

A request is validated (serve/protocol.py), its prompts tokenized and fitted to the context (refused,
or truncated when it sets `truncate_prompt_tokens`), checked against the queue bound (429 with
`Retry-After`), then each of its choices is submitted to the engine as one sequence. Tokens come back
through an asyncio queue; a client that goes away (a closed stream, or a dropped connection while
waiting for a whole response) cancels its sequences, which leave the batch at the engine's next step.
Every refusal is a 4xx in OpenAI's error shape naming the field; the server itself never stops for one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runyard.data.chat import ChatTemplate
from runyard.serve.chat import chat_prompt, request_messages
from runyard.serve.errors import EngineUnavailable, InvalidRequest, ModelNotFound, QueueFull
from runyard.serve.inflight import Choice, Engine, InFlight, by_choice
from runyard.serve.metrics import ServerMetrics
from runyard.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_content_type,
    parse_body,
    validate,
)
from runyard.serve.responses import (
    ChatLogprobs,
    ChunkWriter,
    CompletionLogprobs,
    TokenText,
    error_response,
    sse,
)
from runyard.serve.sampling import SamplingParams, choice_seed
from runyard.serve.sequence import SeqEvent

log = logging.getLogger("runyard.serve")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still there


class TrafficObserver(Protocol):
    """Drift monitoring and request logging (serve/watch.py): told about every admitted prompt."""

    def observe(self, text: str, prompt_ids: list[int]) -> None: ...
    def status(self) -> dict[str, Any]: ...


def create_app(
    engine: Engine,
    model_name: str,
    *,
    chat_template: ChatTemplate | None = None,
    traffic: TrafficObserver | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_shutdown: Sequence[Callable[[], None]] = (),
) -> FastAPI:
    """The FastAPI app serving `engine` under `model_name`. `on_shutdown` runs when the server stops
    (uvicorn re-raises SIGTERM once it has shut down, so code after `uvicorn.run` would never run)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:
            for close in on_shutdown:
                close()

    app = FastAPI(title="runyard", description="OpenAI-compatible completions and chat over a runyard export",
                  lifespan=lifespan)
    metrics = ServerMetrics()
    metrics.watch(engine.queue_depth, engine.running_count, lambda: engine.n_slots)
    if traffic is not None:
        _watch_drift(metrics, traffic)
    app.state.metrics = metrics
    token_text = TokenText(engine.tokenizer)
    chat_stop_ids: frozenset[int] = frozenset()
    if chat_template is not None and chat_template.eos_token:
        eos = engine.tokenizer.token_to_id(chat_template.eos_token)
        chat_stop_ids = frozenset({eos}) if eos is not None else frozenset()

    def refuse(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
        metrics.errors.labels(str(status)).inc()
        return error_response(status, message, kind, param, code, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return refuse(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving a request")
        return refuse(500, f"internal error: {type(exc).__name__}", "server_error")

    async def read_json(request: Request) -> Any:
        check_content_type(request.headers.get("content-type"))
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > max_body_bytes):
            raise _TooLarge(max_body_bytes)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise _TooLarge(max_body_bytes)
        return parse_body(bytes(body))

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ModelNotFound(f"model {name!r} is not served here; this server has {model_name!r}")

    def fit(prompt_ids: list[int], req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
            explicit: bool, prompt_param: str) -> tuple[list[int], int]:
        """The prompt cut to the request's truncate_prompt_tokens, and the tokens it may generate;
        refuses (never silently shortens) what does not fit the context."""
        ctx = engine.context_length
        if req.truncate_prompt_tokens is not None:
            if req.truncate_prompt_tokens >= ctx:
                raise InvalidRequest(
                    f"truncate_prompt_tokens must be below the model's context ({ctx}), got {req.truncate_prompt_tokens}",
                    "truncate_prompt_tokens",
                )
            prompt_ids = prompt_ids[-req.truncate_prompt_tokens :]
        if len(prompt_ids) >= ctx:
            raise InvalidRequest(
                f"{prompt_param}: the prompt is {len(prompt_ids)} tokens and the model's context is {ctx} tokens "
                f"(prompt and completion together); shorten it, or set truncate_prompt_tokens to keep its last N tokens",
                prompt_param,
                "context_length_exceeded",
            )
        room = ctx - len(prompt_ids)
        if max_tokens is None:
            return prompt_ids, room
        if explicit and max_tokens > room:
            raise InvalidRequest(
                f"max_tokens: the prompt is {len(prompt_ids)} tokens, so at most {room} more fit the model's "
                f"context of {ctx}; got max_tokens {max_tokens}",
                "max_tokens",
                "context_length_exceeded",
            )
        return prompt_ids, min(max_tokens, room)

    def token_prompt(ids: list[int]) -> list[int]:
        vocab = engine.tokenizer.get_vocab_size()
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
        return ids

    def make_choices(prompts: list[list[int]], req, max_tokens, explicit, prompt_param, logprobs, stop_ids):
        choices = []
        for ids in prompts:
            ids, budget = fit(ids, req, max_tokens, explicit, prompt_param)
            for j in range(req.n):
                params = SamplingParams(
                    max_tokens=budget,
                    temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p,
                    top_k=req.top_k_or_none(),
                    seed=None if req.seed is None else choice_seed(req.seed % (1 << 63), j),
                    stop=req.stop_list(),
                    logprobs=logprobs,
                    stop_token_ids=stop_ids,
                )
                choices.append(Choice(ids, params))
        return choices

    async def admit(request: Request, model_cls, prefix: str):
        """Parse, validate and plan a request; returns (request body, in-flight request) or a refusal."""
        arrival = time.perf_counter()
        req = validate(model_cls, await read_json(request))
        check_model(req.model)
        if isinstance(req, CompletionRequest):
            texts, prompts = [], []
            for p in req.prompts():
                if isinstance(p, str):
                    texts.append(p)
                    prompts.append(engine.encode(p))
                else:
                    texts.append(None)
                    prompts.append(token_prompt(list(p)))
            explicit = "max_tokens" in req.model_fields_set
            choices = make_choices(prompts, req, req.max_tokens, explicit, "prompt", req.logprobs, frozenset())
        else:
            if chat_template is None:
                raise InvalidRequest(
                    f"model {model_name!r} has no chat template (its export has no tokenizer_config.json with a "
                    "chat_template), so it cannot take chat messages; use /v1/completions with a prompt",
                    "messages",
                    "no_chat_template",
                )
            text = chat_prompt(chat_template, request_messages(req.messages))
            texts, prompts = [text], [engine.encode(text)]
            max_new = req.max_new_tokens()
            choices = make_choices(prompts, req, max_new, max_new is not None, "messages", req.logprobs_k(), chat_stop_ids)
        engine.check_admission(len(choices))
        if traffic is not None:
            for text, ids in zip(texts, prompts, strict=True):
                traffic.observe(text if text is not None else engine.tokenizer.decode(ids), ids)
        flight = InFlight(engine, metrics, choices, req.n, arrival, prefix)
        return req, flight

    async def guarded(handler, request: Request, model_cls, prefix: str) -> Response:
        try:
            req, flight = await admit(request, model_cls, prefix)
            return await handler(request, req, flight)
        except _TooLarge as exc:
            return refuse(413, f"the request body exceeds {exc.limit} bytes")
        except InvalidRequest as exc:
            return refuse(exc.status, exc.message, exc.kind, exc.param, exc.code)
        except QueueFull as exc:
            return refuse(429, str(exc), "rate_limit_error", None, "queue_full", {"Retry-After": str(exc.retry_after_s)})
        except EngineUnavailable as exc:
            return refuse(503, str(exc), "server_error")

    async def collect(request: Request, flight: InFlight, on_event) -> bool:
        """Run every choice to its end, calling on_event for each event; False if the client left."""
        events = flight.events()

        async def consume() -> None:
            async for batch in events:
                for index, event in batch:
                    on_event(index, event)

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    task.result()
                    return True
                if await request.is_disconnected():
                    return False
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await events.aclose()

    def failed(flight: InFlight) -> JSONResponse | None:
        if any(c.finish_reason == "error" for c in flight.choices):
            return refuse(500, "the engine failed while generating; see the server log", "server_error")
        return None

    # -- completions ----------------------------------------------------------------------------

    async def completion(request: Request, req: CompletionRequest, flight: InFlight) -> Response:
        want_logprobs = req.logprobs is not None
        for c in flight.choices:
            c.logprobs = CompletionLogprobs(token_text) if want_logprobs else None

        writer = ChunkWriter(flight.id, "text_completion", flight.created, model_name)

        def chunk(index: int, text: str, logprobs: Any, reason: str | None) -> str:
            return writer(index, {"text": text, "logprobs": logprobs, "finish_reason": reason})

        if req.stream:
            def choice_chunks(index: int, events: list[SeqEvent]) -> list[str]:
                choice = flight.choices[index]
                text = "".join(e.text for e in events)
                lp = None
                if want_logprobs:
                    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
                    offset = len(choice.text) - len(text)
                    for e in events:
                        if e.logprobs is not None:
                            for key, values in choice.logprobs.add(e.logprobs, offset).items():
                                lp[key] += values
                        offset += len(e.text)
                    lp = lp if lp["tokens"] else None
                reason = events[-1].finish_reason
                if text or lp is not None or reason is not None:
                    return [sse(chunk(index, text, lp, reason))]
                return []

            return StreamingResponse(_sse_stream(flight, req, "text_completion", model_name, choice_chunks),
                                     media_type="text/event-stream")

        def on_event(index: int, event: SeqEvent) -> None:
            choice = flight.choices[index]
            if want_logprobs and event.logprobs is not None:
                choice.logprobs.add(event.logprobs, len(choice.text) - len(event.text))

        if not await collect(request, flight, on_event):
            return Response(status_code=499)  # nobody is listening; nginx's code for a closed client
        if (bad := failed(flight)) is not None:
            return bad
        return JSONResponse({
            "id": flight.id, "object": "text_completion", "created": flight.created, "model": model_name,
            "choices": [
                {"index": i, "text": c.text, "logprobs": c.logprobs.body() if want_logprobs else None,
                 "finish_reason": c.finish_reason}
                for i, c in enumerate(flight.choices)
            ],
            "usage": flight.usage(),
        })

    # -- chat -----------------------------------------------------------------------------------

    async def chat_completion(request: Request, req: ChatCompletionRequest, flight: InFlight) -> Response:
        want_logprobs = req.logprobs
        for c in flight.choices:
            c.logprobs = ChatLogprobs(token_text) if want_logprobs else None

        writer = ChunkWriter(flight.id, "chat.completion.chunk", flight.created, model_name)

        def chunk(index: int, delta: dict[str, Any], logprobs: Any, reason: str | None) -> str:
            return writer(index, {"delta": delta, "logprobs": logprobs, "finish_reason": reason})

        if req.stream:
            def choice_chunks(index: int, events: list[SeqEvent]) -> list[str]:
                choice = flight.choices[index]
                text = "".join(e.text for e in events)
                out = []
                lp = None
                if want_logprobs:
                    content = [choice.logprobs.add(e.logprobs)["content"][0] for e in events if e.logprobs is not None]
                    lp = {"content": content} if content else None
                if text or lp is not None:
                    out.append(sse(chunk(index, {"content": text}, lp, None)))
                if events[-1].finish_reason is not None:
                    out.append(sse(chunk(index, {}, None, events[-1].finish_reason)))
                return out

            roles = [sse(chunk(i, {"role": "assistant", "content": ""}, None, None)) for i in range(len(flight.choices))]
            return StreamingResponse(_sse_stream(flight, req, "chat.completion.chunk", model_name, choice_chunks, roles),
                                     media_type="text/event-stream")

        def on_event(index: int, event: SeqEvent) -> None:
            choice = flight.choices[index]
            if want_logprobs and event.logprobs is not None:
                choice.logprobs.add(event.logprobs)

        if not await collect(request, flight, on_event):
            return Response(status_code=499)
        if (bad := failed(flight)) is not None:
            return bad
        return JSONResponse({
            "id": flight.id, "object": "chat.completion", "created": flight.created, "model": model_name,
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": c.text},
                 "logprobs": c.logprobs.body() if want_logprobs else None,
                 "finish_reason": c.finish_reason}
                for i, c in enumerate(flight.choices)
            ],
            "usage": flight.usage(),
        })

    # -- routes ---------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await guarded(completion, request, CompletionRequest, "cmpl")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await guarded(chat_completion, request, ChatCompletionRequest, "chatcmpl")

    created = int(time.time())

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "runyard",
            "max_model_len": engine.context_length,
        }]}

    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        failure = getattr(engine, "failure", None)  # a load balancer takes a failed replica out
        return JSONResponse(
            {"status": "failed" if failure else "ok", "model": model_name, "queue_depth": engine.queue_depth(),
             "running": engine.running_count(), "kv_slots": engine.n_slots, "error": failure},
            status_code=503 if failure else 200,
        )

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/drift")
    async def drift() -> dict[str, Any]:
        if traffic is None:
            return {"enabled": False}
        return {"enabled": True, **traffic.status()}

    return app


async def _sse_stream(flight: InFlight, req: CompletionRequest | ChatCompletionRequest, chunk_object: str,
                      model_name: str, choice_chunks: Callable[[int, list[SeqEvent]], list[str]],
                      opening: Sequence[str] = ()) -> AsyncIterator[str]:
    """A streaming response's body: the `opening` events, then each batch of the engine's events as the
    chunks `choice_chunks` makes of each choice's share of it (sent together), the usage chunk when the
    request asks for one, and `[DONE]`."""
    for event in opening:
        yield event
    async for batch in flight.events():
        out = [c for index, events in by_choice(batch) for c in choice_chunks(index, events)]
        if out:
            yield "".join(out)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield sse({"id": flight.id, "object": chunk_object, "created": flight.created, "model": model_name,
                   "choices": [], "usage": flight.usage()})
    yield sse("[DONE]")


class _TooLarge(Exception):
    def __init__(self, limit: int):
        self.limit = limit


def _watch_drift(metrics: ServerMetrics, traffic: TrafficObserver) -> None:
    def value(key: str):
        def read() -> float:
            v = traffic.status().get(key)
            return float("nan") if v is None else float(v)
        return read

    metrics.drift_js.set_function(value("token_js"))
    metrics.drift_threshold.set_function(value("token_js_threshold"))
    metrics.drift_alert.set_function(lambda: float(bool(traffic.status().get("drifting"))))
    metrics.drift_events.set_function(lambda: float(len(traffic.status().get("events", []))))
