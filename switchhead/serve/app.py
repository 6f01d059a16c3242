"""The HTTP side of `switchhead serve`: a FastAPI app speaking OpenAI's completions API over a `Scheduler`.

Request handlers run on the event loop and never touch the model: they validate, submit `Job`s and relay the
scheduler's events, which arrive through `loop.call_soon_threadsafe` into a per-request asyncio queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from switchhead.errors import SwitchheadError, is_finite_number, is_int
from switchhead.runtime.engine import Generator
from switchhead.serve import protocol as P
from switchhead.serve.scheduler import Failed, Finished, Job, Piece, Scheduler, TokenInfo

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ServeConfig:
    model_name: str = "switchhead"
    max_batch: int = 8
    max_queue: int = 64
    timeout_s: float | None = 600.0  # per request, from arrival to the last token; None = no limit
    max_body_bytes: int = 1 << 20
    limits: P.Limits = field(default_factory=P.Limits)

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise SwitchheadError(f"ServeConfig.model_name must be a non-empty string, got {self.model_name!r}")
        if not is_int(self.max_batch) or self.max_batch < 1:
            raise SwitchheadError(f"ServeConfig.max_batch must be an integer >= 1, got {self.max_batch!r}")
        if not is_int(self.max_queue) or self.max_queue < 0:
            raise SwitchheadError(f"ServeConfig.max_queue must be an integer >= 0, got {self.max_queue!r}")
        if self.timeout_s is not None and (not is_finite_number(self.timeout_s) or self.timeout_s <= 0):
            raise SwitchheadError(f"ServeConfig.timeout_s must be a number of seconds > 0, or None for no limit, "
                                  f"got {self.timeout_s!r}")
        if not is_int(self.max_body_bytes) or self.max_body_bytes < 1:
            raise SwitchheadError(f"ServeConfig.max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if not isinstance(self.limits, P.Limits):
            raise SwitchheadError(f"ServeConfig.limits must be a Limits, got {type(self.limits).__name__}")


def _error(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class _Relay:
    """Events of a request's jobs, moved from the scheduler thread onto the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()

    def sink(self, index: int):
        def put(event) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
            except RuntimeError:  # the loop is closed: the server is shutting down, nobody is listening
                pass
        return put

    async def events(self, request: Request):
        """The events as they come; ends early if the client disconnects. Once the body has been read, the
        next ASGI message can only be the client going away, so a task waiting for it is the watch."""
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                get = asyncio.ensure_future(self.queue.get())
                await asyncio.wait([get, gone], return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return
                yield get.result()
        finally:
            gone.cancel()


class _JobStream(StreamingResponse):
    """A stream that frees its jobs however it ends: finished, client gone (a failed send or Starlette's
    disconnect watch cancelling it), or a server shutdown."""

    def __init__(self, release, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class _Choice:
    """Accumulates one choice's text, token logprobs and end."""

    def __init__(self, index: int, prompt: int, prompt_tokens: int):
        self.index, self.prompt, self.prompt_tokens = index, prompt, prompt_tokens
        self.text, self.infos = "", []
        self.finish: Finished | None = None


def create_app(generator: Generator, config: ServeConfig | None = None) -> FastAPI:
    config = ServeConfig() if config is None else config
    if not isinstance(config, ServeConfig):
        raise SwitchheadError(f"create_app's config must be a ServeConfig, got {type(config).__name__}")
    scheduler = Scheduler(generator, config.max_batch, config.max_queue)
    started = P.now()
    sp = generator.sp

    def token_text(i: int) -> str:
        # SentencePiece marks a leading space with U+2581. A byte-fallback piece ('<0xNN>') is its character
        # when it is ASCII; a byte of a multi-byte character has no text alone, so it is written the way
        # OpenAI writes such tokens, 'bytes:\xNN'.
        piece = sp.id_to_piece(int(i))
        if sp.is_byte(int(i)):
            value = int(piece[3:5], 16)
            return chr(value) if value < 0x80 else f"bytes:\\x{value:02x}"
        return piece.replace("\u2581", " ")

    def within_text(infos: list[TokenInfo], end: Finished) -> list[TokenInfo]:
        # A stop string ends the text before it: the tokens that spell it start at or past the text's end, and
        # are not part of the completion (its text_offset would point past its text).
        return [t for t in infos if t.offset < len(end.text)] if end.reason == "stop" else infos

    def logprobs_block(infos: list[TokenInfo]) -> dict:
        return {"tokens": [token_text(t.token) for t in infos],
                "token_logprobs": [t.logprob for t in infos],
                "top_logprobs": [{token_text(i): lp for i, lp in t.top} for t in infos],
                "text_offset": [t.offset for t in infos]}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            # The model step runs on the scheduler thread; joining it here would block the event loop.
            await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    app = FastAPI(title="switchhead", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler = scheduler

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, e: P.APIError):
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return _error(P.APIError(e.status_code, str(e.detail), "invalid_request_error", None, code))

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        log.exception("unhandled error")
        return _error(P.APIError(500, "internal server error", "server_error", None, "internal_error"))

    @app.get("/health")
    async def health():
        body = {"status": "ok", "model": config.model_name, **scheduler.stats()}
        if not scheduler.alive():
            return JSONResponse({**body, "status": "stopped"}, status_code=503)
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [P.model_card(config.model_name, started)]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != config.model_name:
            raise P.APIError(404, f"the model '{name}' does not exist", "invalid_request_error", "model",
                             "model_not_found")
        return P.model_card(config.model_name, started)

    async def read_json(request: Request):
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise P.APIError(413, f"request body larger than {config.max_body_bytes} bytes",
                             "invalid_request_error", None, "request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_body_bytes:
                raise P.APIError(413, f"request body larger than {config.max_body_bytes} bytes",
                                 "invalid_request_error", None, "request_too_large")
            chunks.append(chunk)
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        # Valid JSON that Python's parser refuses: past the interpreter's recursion limit, or an integer over
        # its 4300-digit conversion limit (a plain ValueError whose advice, set_int_max_str_digits, is ours).
        except RecursionError:
            raise P.bad("the request body is nested too deeply", None, "invalid_json") from None
        except ValueError:
            raise P.bad("the request body has a number with too many digits", None, "invalid_json") from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = P.parse_completion(await read_json(request), config.model_name, config.limits, generator.encode,
                                 generator.backend.config.vocab_size)
        if len(req.prompts) * req.n > scheduler.capacity:  # never fits, however idle: a 503 would be retried forever
            raise P.too_many(len(req.prompts), req.n, scheduler.capacity,
                             f"--max-batch {config.max_batch} + --max-queue {config.max_queue}")
        relay = _Relay(asyncio.get_running_loop())
        deadline = time.monotonic() + config.timeout_s if config.timeout_s else None
        seqs = req.sequences()
        jobs = [Job(req.encoded[i], params, relay.sink(k), req.logprobs, deadline) for k, i, params in seqs]
        choices = [_Choice(k, i, len(req.encoded[i])) for k, i, _ in seqs]
        if not scheduler.alive():  # jobs would wait forever
            raise P.APIError(503, "the server's generation loop has stopped; restart the server", "server_error",
                             None, "scheduler_stopped")
        if not scheduler.submit(jobs):
            raise P.APIError(503, "the server is busy: the request queue is full, retry later", "server_error",
                             None, "queue_full", headers={"Retry-After": "1"})
        cid, created = P.completion_id(), P.now()
        def release() -> None:
            for job in jobs:
                if not job.done:
                    scheduler.cancel(job)

        if req.stream:
            return _JobStream(release, stream(request, req, jobs, choices, relay, cid, created),
                              media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            failed = await collect(request, jobs, choices, relay)
        finally:
            release()
        if failed is False:
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
        if failed is not None:
            raise failed
        body = P.envelope(cid, created, config.model_name, [
            {"index": c.index, "text": c.text, "finish_reason": P.FINISH_REASONS[c.finish.reason],
             "logprobs": logprobs_block(c.infos) if req.logprobs is not None else None} for c in choices],
            usage=totals(choices))
        return JSONResponse(body)

    def totals(choices: list[_Choice]) -> dict:
        # OpenAI counts each prompt once however many samples (n) it has.
        prompt_tokens = {c.prompt: c.prompt_tokens for c in choices}
        return P.usage(sum(prompt_tokens.values()),
                       sum(c.finish.completion_tokens for c in choices if c.finish is not None))

    def failure(event: Failed) -> P.APIError:
        if event.kind == "timeout":
            return P.APIError(504, event.message, "timeout_error", None, "timeout")
        if event.kind == "shutdown":
            return P.APIError(503, event.message, "server_error", None, "shutting_down")
        return P.APIError(500, event.message, "server_error", None, "internal_error")

    async def collect(request: Request, jobs, choices, relay) -> P.APIError | None | bool:
        """Gather every job's events; an error to answer, None when done, False when the client left."""
        left = len(jobs)
        async with aclosing(relay.events(request)) as events:
            async for k, event in events:
                c = choices[k]
                if isinstance(event, Piece):
                    c.text += event.text
                    if event.info is not None:
                        c.infos.append(event.info)
                elif isinstance(event, Finished):
                    c.finish, left = event, left - 1
                    c.infos = within_text(c.infos, event)
                    if not left:
                        return None
                elif isinstance(event, Failed):
                    return failure(event)
        return False

    async def stream(request, req, jobs, choices, relay, cid, created) -> AsyncIterator[str]:
        def chunk(index: int, text: str, infos, finish: str | None) -> str:
            block = logprobs_block(infos) if req.logprobs is not None else None
            body = P.envelope(cid, created, config.model_name,
                              [{"index": index, "text": text, "logprobs": block, "finish_reason": finish}])
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        left = len(jobs)
        async with aclosing(relay.events(request)) as events:
            async for k, event in events:
                c = choices[k]
                if isinstance(event, Piece):
                    if event.info is not None:
                        c.infos.append(event.info)
                    if event.text:
                        # Tokens whose text is still held back (partial characters or a possible stop string)
                        # ride along with the first chunk that carries text.
                        yield chunk(c.index, event.text, c.infos, None)
                        c.infos = []
                elif isinstance(event, Finished):
                    c.finish, left = event, left - 1
                    infos = within_text(c.infos, event)
                    yield chunk(c.index, "", infos, P.FINISH_REASONS[event.reason])
                    c.infos = []
                    if not left:
                        break
                elif isinstance(event, Failed):
                    yield f"data: {json.dumps(failure(event).body())}\n\n"
                    return
            else:
                return  # the client left
        if req.include_usage:
            yield f"data: {json.dumps(P.envelope(cid, created, config.model_name, [], totals(choices)))}\n\n"
        yield "data: [DONE]\n\n"

    return app


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def default_model_name(ckpt: str | None, onnx_dir: str | None) -> str:
    """The directory's name; for a training run's final/ or checkpoint/, the run's; "switchhead" for the built-in
    model."""
    from switchhead.train.rundir import CHECKPOINT_DIR, FINAL_DIR, RUN_FILE

    path = Path(ckpt or onnx_dir or "switchhead")  # neither: the built-in default model
    if not path.exists():
        return path.name
    path = path.resolve()
    if path.name in (FINAL_DIR, CHECKPOINT_DIR) and (path.parent / RUN_FILE).is_file():
        return path.parent.name  # every run's model lies in a directory called final
    return path.name
