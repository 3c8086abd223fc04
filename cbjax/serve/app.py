"""The HTTP routes (Starlette): OpenAI completions and chat completions (streamed as SSE or not), models, health
and Prometheus metrics, over one EngineLoop.

A streamed response sends one SSE chunk per engine step and sample (n > 1: the samples' chunks interleaved, each
with its choice index) that got a token, as soon as the step ends, the finish_reason on the chunk of a sample's last
token, then (with stream_options.include_usage) a usage chunk, then `data: [DONE]`. A client that disconnects is
aborted; the next step frees its pages. Stop strings are the engine's (SamplingParams.stop): the text of a request
that has them comes from the engine; the others' text is decoded here, with the same TextStream.
"""

import asyncio
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cbjax.model.text_stream import TextStream
from cbjax.model.tokenizer import Tokenizer
from cbjax.serve.chat_template import ChatTemplate, plain_template
from cbjax.serve.engine_loop import ChoiceDelta, EngineLoop, QueueFull, RequestHandle, ShuttingDown
from cbjax.serve.logprobs_format import TokenText, chat_logprobs, completion_logprobs
from cbjax.serve.protocol import GenerationRequest, ProtocolError, error_body, parse_chat, parse_completion

RETRY_AFTER_S = 1  # the Retry-After of a 429: about how long a few requests take to finish on a busy CPU server


def _error(e: ProtocolError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Server:
    """Routes over one engine loop. `model_name` is the name clients send as `model` (and /v1/models lists)."""

    def __init__(
        self,
        loop: EngineLoop,
        *,
        model_name: str,
        tokenizer: Tokenizer | None,
        chat_template: ChatTemplate = plain_template,
    ):
        self.loop = loop
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_model_len = loop.engine.config.scheduler.max_model_len
        self.created = int(time.time())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    # ---- small routes -----------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "cbjax",
            "max_model_len": self.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if not self.loop.alive or not self.loop.accepting:
            state = "shutting down" if self.loop.shutting_down else "engine loop not running"
            return JSONResponse({"status": state}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return Response(self.loop.metrics.render(), media_type=self.loop.metrics.CONTENT_TYPE)

    # ---- generation -------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        try:
            req = parse_completion(await self._json(request), request.headers)
            self._check_model(req)
            if isinstance(req.prompt, str):
                prompt_ids = self._encode(req.prompt, add_special_tokens=True)
            else:
                prompt_ids = req.prompt
            return await self._generate(request, req, prompt_ids)
        except ProtocolError as e:
            return self._refused(e)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req, messages = parse_chat(await self._json(request), request.headers)
            self._check_model(req)
            try:
                req.prompt = self.chat_template(messages)
            except Exception as e:  # a checkpoint's template may refuse a conversation (raise_exception)
                raise ProtocolError(f"chat template: {e}", param="messages") from None
            # A checkpoint's own template writes its special tokens itself.
            prompt_ids = self._encode(req.prompt, add_special_tokens=self.chat_template is plain_template)
            return await self._generate(request, req, prompt_ids)
        except ProtocolError as e:
            return self._refused(e)

    def _refused(self, e: ProtocolError) -> JSONResponse:
        reason = {429: "queue_full", 503: "shutting_down", 404: "unknown_model"}.get(e.status, "invalid")
        self.loop.metrics.rejected(reason)
        return _error(e)

    async def _json(self, request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProtocolError(f"the request body is not valid JSON: {e}") from None

    def _check_model(self, req: GenerationRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ProtocolError(
                f"The model `{req.model}` does not exist (this server serves `{self.model_name}`).",
                404,
                param="model",
                code="model_not_found",
            )

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def _generate(self, request: Request, req: GenerationRequest, prompt_ids: list[int]) -> Response:
        max_tokens = req.max_tokens
        if max_tokens is None:  # chat's default: the rest of the context
            max_tokens = max(1, self.max_model_len - len(prompt_ids))
        try:
            params = req.sampling_params(max_tokens)
        except (ValueError, TypeError) as e:
            raise ProtocolError(str(e)) from None
        try:
            handle = self.loop.submit(
                prompt_ids,
                params,
                priority=req.priority,
                tenant=req.tenant,
                deadline_s=None if req.deadline_ms is None else req.deadline_ms / 1000,
            )
        except QueueFull as e:
            raise ProtocolError(
                str(e),
                429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None
        except ShuttingDown as e:
            raise ProtocolError(str(e), 503, type="server_error", code="service_unavailable") from None
        try:
            first = await handle.events.get()
        except asyncio.CancelledError:
            self.loop.abort(handle)
            raise
        if first[0] == "rejected":
            raise ProtocolError(first[1])
        if first[0] == "error":  # aborted before it was accepted (shutdown)
            raise ProtocolError(first[2], first[1], type="server_error")
        gen = _Generation(self, req, handle, prompt_ids)
        if req.stream:
            return StreamingResponse(gen.sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await gen.full(request)


class _Choice:
    """One sample of a streamed response: its text so far (decoded here with a TextStream, or the engine's for
    requests with stop strings) and the offset of its next token's text (completions' logprobs)."""

    def __init__(self, index: int, server: Server, req: GenerationRequest, prompt_ids: list[int]):
        self.index = index
        self.stream = TextStream(
            server.tokenizer, prompt_ids, include_stop_str_in_output=req.include_stop_str_in_output
        )
        self.text = ""
        self.num_tokens = 0
        self.offset = 0
        self.started = False  # a chat stream's first chunk of this sample carries the role

    def add(self, d: ChoiceDelta) -> str:
        """The text delta of this step's tokens."""
        self.num_tokens += len(d.new_ids)
        if d.text is not None:  # the engine's visible text (stop strings): only ever extended
            delta = d.text[len(self.text) :]
            self.text = d.text
            return delta
        finished = d.finish_reason is not None
        self.stream.add(d.new_ids, ends_with_stop_token=d.finish_reason == "stop")
        if finished:
            self.stream.finish()
        delta = self.stream.delta(finished)
        self.text += delta
        return delta


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason  # aborted by a stop of the server's own: OpenAI has no "abort"


class _Generation:
    """One accepted request's responses: SSE chunks or one JSON body."""

    def __init__(self, server: Server, req: GenerationRequest, handle: RequestHandle, prompt_ids: list[int]):
        self.server, self.req, self.handle = server, req, handle
        self.prompt_ids = prompt_ids
        chat = req.kind == "chat"
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        tok = server.tokenizer
        self.token_text = TokenText(None if tok is None else lambda ids: tok.decode(ids, skip_special_tokens=False))
        self.choices: dict[int, _Choice] = {}
        self.final = None  # the request's last outputs (CompletionOutputs), once it has finished
        self.done = False

    async def _events(self):
        """Each engine step's ChoiceDeltas, until the request ends (then `final` holds its outputs). Raises
        ProtocolError when the server aborted it (timeout, shutdown). Aborts the engine request if left early
        (client gone)."""
        loop, h = self.server.loop, self.handle
        try:
            while True:
                event = await h.events.get()
                if event[0] == "error":
                    self.done = True
                    raise ProtocolError(event[2], event[1], type="server_error", code="aborted")
                _, deltas, final = event
                if final is not None:
                    self.done, self.final = True, final
                yield deltas
                if final is not None:
                    return
        finally:
            if not self.done:  # a no-op in the loop if the engine finished it meanwhile
                loop.abort(h)

    def _usage(self, num_tokens: int) -> dict:
        n = len(self.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": num_tokens, "total_tokens": n + num_tokens}

    def _logprobs(self, entries: list | None, token_ids: list[int], offset: int = 0) -> tuple[dict | None, int]:
        """A choice's logprobs in this endpoint's shape (None when the request did not ask for them)."""
        if self.req.logprobs is None or entries is None:
            return None, offset
        if self.req.kind == "chat":
            return chat_logprobs(entries, token_ids, self.token_text, self.req.logprobs), offset
        return completion_logprobs(entries, token_ids, self.token_text, offset)

    def _chunk_choice(self, c: _Choice, text: str, d: ChoiceDelta) -> dict:
        logprobs, c.offset = self._logprobs(d.logprobs, d.new_ids, c.offset)
        reason = _finish_reason(d.finish_reason)
        if self.req.kind == "chat":
            delta = {"content": text} if c.started else {"role": "assistant", "content": text}
            choice = {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        c.started = True
        if self.req.return_token_ids:
            choice["token_ids"] = list(d.new_ids)
        return choice

    def _chunk(self, choices: list, usage=None) -> bytes:
        body = {"id": self.id, "object": self.object + ("" if self.req.kind != "chat" else ".chunk")}
        body.update(created=self.created, model=self.server.model_name, choices=choices)
        if self.req.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n".encode()

    async def sse(self):
        try:
            async for deltas in self._events():
                for d in deltas:  # n > 1: one chunk per sample, told apart by their index
                    c = self.choices.get(d.index)
                    if c is None:
                        c = self.choices[d.index] = _Choice(d.index, self.server, self.req, self.prompt_ids)
                    yield self._chunk([self._chunk_choice(c, c.add(d), d)])
        except ProtocolError as e:  # aborted by the server: say why, in OpenAI's error shape, and end the stream
            yield f"data: {json.dumps(e.body())}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return
        if self.req.include_usage:
            yield self._chunk([], self._usage(sum(c.num_tokens for c in self.choices.values())))
        yield b"data: [DONE]\n\n"

    async def full(self, request: Request) -> Response:
        async def collect():
            async for _ in self._events():
                pass

        # Nobody reads a non-streamed response's body until the end, so watch the connection for a disconnect.
        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client left: stop the generation (its finally aborts the request)
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        exc = work.exception()
        if isinstance(exc, ProtocolError):
            return _error(exc)
        if exc is not None:
            raise exc
        # The final outputs are the choices (with best_of, the best n samples): their tokens, the engine's text.
        choices, num_tokens = [], 0
        for out in sorted(self.final, key=lambda o: o.index):
            ids = list(out.token_ids)
            num_tokens += len(ids)
            text = out.text or ""
            logprobs, _ = self._logprobs(out.logprobs, ids)
            if self.req.kind == "chat":
                choice = {"index": out.index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": out.index, "text": text}
            choice.update(logprobs=logprobs, finish_reason=_finish_reason(out.finish_reason))
            if self.req.return_token_ids:
                choice["token_ids"] = ids
            choices.append(choice)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.server.model_name}
        body.update(choices=choices, usage=self._usage(num_tokens))
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
        return JSONResponse(body)


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(server: Server, lifespan=None) -> Starlette:
    async def on_error(request: Request, exc: Exception) -> Response:
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    return Starlette(routes=server.routes(), exception_handlers={Exception: on_error}, lifespan=lifespan)
