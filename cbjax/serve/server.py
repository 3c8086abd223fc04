"""Putting it together: an engine, its loop, the routes and uvicorn, with a graceful shutdown.

Shutdown (SIGINT/SIGTERM, or `should_exit` in-process): the listening socket closes, new requests on open
connections get 503, the requests in flight run on for up to `shutdown_timeout_s` (drain), then the rest are
aborted and their clients told so (a 503 error, or an error event then `[DONE]` in a stream). The log names
which requests were drained and which aborted; `ServeHandle.loop.drained` / `.aborted_at_shutdown` hold them.
"""

import asyncio
import contextlib
import logging
import socket
import threading

import uvicorn

from cbjax.engine import LLMEngine
from cbjax.model.registry import resolve_checkpoint
from cbjax.serve.app import Server, build_app
from cbjax.serve.chat_template import load_chat_template
from cbjax.serve.engine_loop import EngineLoop
from cbjax.serve.metrics import ServerMetrics

log = logging.getLogger("cbjax.serve")


class _Uvicorn(uvicorn.Server):
    """uvicorn's server with a drain step before its own shutdown (which would wait on open streams, then cut
    them without a word)."""

    def __init__(self, config: uvicorn.Config, loop: EngineLoop, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine_loop = loop
        self.shutdown_timeout_s = shutdown_timeout_s

    async def shutdown(self, sockets=None) -> None:
        loop = self.engine_loop
        for server in self.servers:  # stop accepting connections first
            server.close()
        loop.begin_shutdown()
        n = loop.num_unfinished()
        if n:
            log.info("shutdown: draining %d request(s) for up to %.1f s", n, self.shutdown_timeout_s)
        deadline = asyncio.get_running_loop().time() + self.shutdown_timeout_s
        while loop.num_unfinished() and asyncio.get_running_loop().time() < deadline and not self.force_exit:
            await asyncio.sleep(0.02)
        if loop.num_unfinished():
            loop.abort_all("the server is shutting down")
            while loop.num_unfinished() and loop.alive:
                await asyncio.sleep(0.02)
        log.info(
            "shutdown: %d request(s) drained %s, %d aborted %s",
            len(loop.drained),
            loop.drained,
            len(loop.aborted_at_shutdown),
            loop.aborted_at_shutdown,
        )
        await super().shutdown(sockets)


class ServeHandle:
    """A running server: `.url`, `.loop` (the EngineLoop), `.engine`; `shutdown()` stops it gracefully."""

    def __init__(self, uv: _Uvicorn, thread: threading.Thread | None, loop: EngineLoop, url: str):
        self.uvicorn, self.thread, self.loop, self.url = uv, thread, loop, url
        self.engine = loop.engine

    def shutdown(self, timeout: float = 30.0) -> None:
        self.uvicorn.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.loop.stop()


def make_server(
    engine: LLMEngine,
    *,
    model_name: str,
    checkpoint_dir: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_waiting: int = 1024,
    request_timeout_s: float | None = 600.0,
    shutdown_timeout_s: float = 30.0,
    log_level: str = "info",
) -> tuple[_Uvicorn, EngineLoop]:
    """The uvicorn server and engine loop for `engine` (the loop starts with the server's lifespan)."""
    metrics = ServerMetrics(model_name)
    loop = EngineLoop(engine, metrics, max_waiting=max_waiting, request_timeout_s=request_timeout_s)
    template, described = load_chat_template(checkpoint_dir)
    log.info("chat template: %s", described)
    routes = Server(loop, model_name=model_name, tokenizer=engine.tokenizer, chat_template=template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = build_app(routes, lifespan=lifespan)
    # No uvicorn access log by default: one line per request costs the event loop a CPU core's share under load.
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=log_level == "debug", timeout_keep_alive=30
    )
    return _Uvicorn(config, loop, shutdown_timeout_s), loop


def checkpoint_of(model) -> str | None:
    found = resolve_checkpoint(model)
    return None if found is None else found[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_in_thread(engine: LLMEngine, *, model_name: str, checkpoint_dir: str | None = None, **options) -> ServeHandle:
    """Serve `engine` from a background thread on a free local port (tests, notebooks); returns once it listens."""
    port = free_port()
    uv, loop = make_server(
        engine, model_name=model_name, checkpoint_dir=checkpoint_dir, port=port, log_level="warning", **options
    )
    thread = threading.Thread(target=uv.run, name="cbjax-serve", daemon=True)
    thread.start()
    while not uv.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread ended before it started listening")
        thread.join(0.02)
    return ServeHandle(uv, thread, loop, f"http://127.0.0.1:{port}")
