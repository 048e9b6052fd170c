"""HTTP frontend process: the FastAPI app (routes in srt/entrypoints/routes/) and
``launch_server``, which starts the schedulers and serves until interrupted (SIGTERM: a
graceful drain, srt/entrypoints/drain.py)."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal
import socket
import sys
import threading
from concurrent.futures import Future

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from srt.entrypoints.drain import RANK_GONE, Drain, DrainGate
from srt.entrypoints.http_common import error_response
from srt.entrypoints.openai_serving import OpenAIServing
from srt.entrypoints.routes import admin_router, metrics_router, native_router, openai_router
from srt.frontend.tokenizer_manager import TokenizerManager
from srt.process_utils import freeze_startup_heap
from srt.security.http_guard import HttpGuard, HttpGuardConfig, RequestTooLarge

logger = logging.getLogger(__name__)


def uvicorn_impl() -> dict:
    """uvloop's event loop (a dependency, as in SGLang): less of the frontend's CPU per
    streamed chunk, which on a small CPU is taken from the model step (docs/speed.md "One
    stream"); asyncio where it does not install. The HTTP parser stays h11: httptools answers
    a request it cannot parse (a custom method, a DEL byte in a header) with a plain-text 400
    before the app sees it, where every API error is a JSON body (tests/test_fuzz_requests.py)."""
    return {"loop": "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio", "http": "h11"}


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.tokenizer_manager.start_handle_loop()  # needs the server's running event loop
    app.state.drain.attach(asyncio.get_running_loop())
    yield


async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
    return error_response(str(exc))  # safety net: user errors are 400s


async def _too_large(request: Request, exc: RequestTooLarge) -> JSONResponse:
    return error_response(str(exc), 413)


def create_app(tokenizer_manager: TokenizerManager, server_args) -> FastAPI:
    tm = tokenizer_manager
    served_name = server_args.served_model_name or server_args.model_path or "default"
    drain = Drain(tm, getattr(server_args, "graceful_shutdown_timeout", 0.0))

    app = FastAPI(title="gramsync", lifespan=_lifespan)
    # State lives on the app (no module globals): handlers reach it through request.app.
    app.state.tokenizer_manager = tm
    app.state.server_args = server_args
    app.state.served_model_name = served_name
    app.state.openai_serving = OpenAIServing(tm, served_name)
    app.state.metrics = getattr(tm, "metrics", None)
    guard = HttpGuardConfig.from_server_args(server_args)
    app.state.http_guard = guard
    app.add_middleware(HttpGuard, config=guard)  # API keys and body size, before the body is read
    app.state.drain = drain
    app.add_middleware(DrainGate, drain=drain)  # outermost: counts every request, 503 once draining

    app.add_exception_handler(ValueError, _value_error)
    app.add_exception_handler(RequestTooLarge, _too_large)

    if app.state.metrics is not None:  # --enable-metrics; without it no route (404), as in SGLang
        app.include_router(metrics_router())
    app.include_router(native_router())
    app.include_router(openai_router())
    app.include_router(admin_router())
    return app


def launch_server(server_args) -> None:
    """Node 0 without torchrun: start the scheduler ranks, then serve HTTP until stopped."""
    from srt.entrypoints.http_socket import bind_http_socket
    from srt.entrypoints.launcher import launch_schedulers, new_port_args, prepare_server_args

    _init_frontend_process(server_args)
    http_socket = bind_http_socket(server_args.host, server_args.port)  # first: see http_socket.py
    if server_args.nnodes > 1:
        from srt.security.cluster_secret import secret_for_node0

        secret_for_node0(server_args.cluster_secret_file)  # generated and printed if absent
    server_args = prepare_server_args(server_args)
    host = (server_args.dist_init_addr or "").rpartition(":")[0] or None
    port_args = new_port_args(server_args, host)
    tokenizer = prefetch_tokenizer(server_args)
    try:
        serve(server_args, port_args, launch_schedulers(server_args, port_args, defer_stop_signals=True),
              tokenizer, http_socket)
    finally:
        http_socket.close()
        port_args.remove_local_dir()


def prefetch_tokenizer(server_args) -> Future:
    """Load the frontend's tokenizer on a daemon thread while the ranks start: done after
    them, it added ~3 s to every server start. ``serve`` takes the result (or the error)."""
    from srt.tokenizer_utils import get_tokenizer

    future: Future = Future()

    def load() -> None:
        try:
            future.set_result(get_tokenizer(server_args.tokenizer_path or server_args.model_path,
                                            server_args.chat_template))
        except BaseException as e:  # raised again by serve, in the main thread
            future.set_exception(e)
    threading.Thread(target=load, daemon=True, name="tokenizer-load").start()
    return future


class _DrainingServer(uvicorn.Server):
    """uvicorn whose SIGTERM / SIGINT start the frontend's drain. (uvicorn's own handling
    stops accepting at once, waits 5 s for open connections, then re-raises the signal: a
    running stream was cut and the process died before its clean-up.)"""

    def __init__(self, config, drain: Drain):
        super().__init__(config)
        self.drain = drain

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29 installs its handlers here
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, lambda signum, frame: self.drain.on_signal(signum))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _init_frontend_process(server_args) -> None:
    import setproctitle

    setproctitle.setproctitle("gramsync::frontend")
    # Large requests are parsed and prepared on worker threads, which hold the GIL in long
    # C calls (json, pydantic): a 1 ms switch interval (Python's default is 5 ms) lets the
    # event loop serve other requests' small steps between them (bench_large_request.py).
    sys.setswitchinterval(0.001)
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s frontend] %(levelname)s %(name)s: %(message)s")


def serve(server_args, port_args, handles, tokenizer: Future, http_socket: socket.socket) -> None:
    """Serve HTTP on top of ready scheduler ranks until stopped. A rank that dies takes the
    server down: this raises SystemExit naming the rank (exit code 1). SIGTERM drains
    (srt/entrypoints/drain.py), then this returns. ``tokenizer``: ``prefetch_tokenizer``'s;
    ``http_socket``: ``bind_http_socket``'s, bound at the start."""
    tm = None
    failure: list[str] = []
    if server_args.enable_custom_logit_processor:  # torch: loaded now, not on the first request
        import sampling.custom_logit_processor  # noqa: F401
    try:
        tokenizer = tokenizer.result()
        tm = TokenizerManager(server_args, port_args, handles.info, tokenizer, handles.input_addrs)
        tm.scheduler_alive = handles.alive
        app = create_app(tm, server_args)
        drain: Drain = app.state.drain
        server = _DrainingServer(uvicorn.Config(
            app, host=server_args.host, port=server_args.port, **uvicorn_impl(),
            log_level=server_args.log_level, timeout_keep_alive=5, timeout_graceful_shutdown=5), drain)

        def stop_http() -> None:
            server.should_exit = True

        drain.on_done = stop_http

        def on_rank_death(message: str) -> None:
            # A dead rank means no request can finish: end them all with an error (a
            # stream: its error event), then stop serving (SGLang stops too).
            logger.error("%s; shutting the server down.", message)
            failure.append(message)
            drain.request(RANK_GONE, 0.0)

        handles.watch(on_rank_death)
        freeze_startup_heap()  # long-lived objects out of the collector's full passes
        server.run(sockets=[http_socket])
    finally:
        handles.shutdown()
        if tm is not None:
            tm.close()
    if failure:
        raise SystemExit(f"gramsync: {failure[0]}; the server stopped.")
