"""HTTP frontend process: the FastAPI app (SGLang-native /generate and the OpenAI API)
and ``launch_server``, which starts the schedulers and serves until interrupted (SIGTERM:
a graceful drain, srt/entrypoints/drain.py)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import threading

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from srt.entrypoints.drain import RANK_GONE, Drain, DrainGate
from srt.entrypoints.openai_responses import ModelCard, ModelList
from srt.entrypoints.openai_serving import (
    SSE_DONE, OpenAIServing, abort_error, error_response, errors_as_events, last_output_or_disconnect,
    read_json, sse,
)
from srt.managers.tokenizer_manager import GenerateReqInput, TokenizerManager
from srt.security.http_guard import HttpGuard, HttpGuardConfig, RequestTooLarge
from srt.version import __version__

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 60.0


def create_app(tokenizer_manager: TokenizerManager, server_args) -> FastAPI:
    tm = tokenizer_manager
    served_name = server_args.served_model_name or server_args.model_path or "default"

    drain = Drain(tm, getattr(server_args, "graceful_shutdown_timeout", 0.0))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        tm.start_handle_loop()  # needs the server's running event loop
        drain.attach(asyncio.get_running_loop())
        yield

    app = FastAPI(title="gramsync", lifespan=lifespan)
    # State lives on the app (no module globals): handlers reach it through request.app.
    app.state.tokenizer_manager = tm
    app.state.server_args = server_args
    app.state.openai_serving = OpenAIServing(tm, served_name)
    guard = HttpGuardConfig.from_server_args(server_args)
    app.state.http_guard = guard
    app.add_middleware(HttpGuard, config=guard)  # API keys and body size, before the body is read
    app.state.drain = drain
    app.add_middleware(DrainGate, drain=drain)  # outermost: counts every request, 503 once draining

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):  # safety net: user errors are 400s
        return error_response(str(exc))

    @app.exception_handler(RequestTooLarge)
    async def _too_large(request: Request, exc: RequestTooLarge):
        return error_response(str(exc), 413)

    metrics = getattr(tm, "metrics", None)
    if metrics is not None:  # --enable-metrics; without it no route (404), as in SGLang

        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if not request.app.state.tokenizer_manager.scheduler_alive():
            return error_response("A scheduler process has exited.", 503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """Healthy only if a one-token generation round-trips through the scheduler."""
        obj = GenerateReqInput(text="Hi", sampling_params={"max_new_tokens": 1, "temperature": 0})
        try:
            out = await asyncio.wait_for(
                last_output_or_disconnect(request, tm.generate_request(obj)), HEALTH_GENERATE_TIMEOUT_S
            )
        except asyncio.TimeoutError:
            return error_response("Generation did not complete in time.", 503)
        if out is None or out["meta_info"]["finish_reason"]["type"] == "abort":
            return error_response("Generation failed.", 503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=served_name, root=server_args.model_path, max_model_len=tm.context_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        # SGLang's keys; no --preferred-sampling-params and no weight updates here.
        return JSONResponse({"model_path": server_args.model_path, "is_generation": True,
                             "tokenizer_path": server_args.tokenizer_path or server_args.model_path,
                             "served_model_name": served_name, "preferred_sampling_params": None,
                             "weight_version": "default"})

    @app.get("/get_server_info")
    async def server_info(request: Request) -> JSONResponse:
        t = request.app.state.tokenizer_manager
        args = dataclasses.asdict(request.app.state.server_args)
        for secret in ("api_key", "admin_api_key"):  # never echo a key
            args[secret] = "<set>" if args[secret] else None
        return JSONResponse({
            **args,
            **dataclasses.asdict(t.scheduler_info),
            "num_inflight_requests": len(t.rid_to_state),
            "num_aborted_requests": t.num_aborted,
            "num_dropped_messages": t.recv_drops.count,
            "num_refused_handshakes": t.transport.refused_handshakes,
            # Documents of approximate grammars checked against their schema (README).
            "schema_validation": dataclasses.asdict(t.documents.validators.stats),
            "version": __version__,
        })

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Admin (SGLang's endpoint): empty the radix prefix cache; refused (400) while
        requests are running or waiting."""
        out = await request.app.state.tokenizer_manager.flush_cache()
        if not out.success:
            return error_response(out.message, 400)
        return JSONResponse({"message": out.message})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        """Admin (SGLang's endpoint and body, {"rid": ..., "abort_all": false}): abort one
        request by id -- also as an OpenAI response id, chatcmpl-<rid> / cmpl-<rid> -- or
        all with abort_all. Each ends with the abort message (a stream: its last event)."""
        t: TokenizerManager = request.app.state.tokenizer_manager
        body = await read_json(request)
        if not isinstance(body, dict) or not (isinstance(body.get("rid"), str) or body.get("abort_all") is True):
            return error_response('Send {"rid": "<request id>"} or {"abort_all": true}.')

        def running(rid: str) -> bool:  # n > 1: the request's id names its group of samples
            return rid in t.rid_to_state or rid in getattr(t, "sample_groups", {})

        if body.get("abort_all") is True:
            rids = list(t.rid_to_state)
        else:
            rid = body["rid"]
            rids = [next((r for r in (rid, rid.removeprefix("chatcmpl-"), rid.removeprefix("cmpl-"))
                          if running(r)), rid)]
        found = [rid for rid in rids if running(rid)]
        for rid in found:
            t.abort_request(rid, "Request aborted by an administrator (/abort_request).")
        if not found and body.get("abort_all") is not True:
            return error_response(f"No request with id {body['rid']!r} is running.", 404)
        return JSONResponse({"aborted": found})

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        t: TokenizerManager = request.app.state.tokenizer_manager
        try:
            req = await t.prepare_request_async(GenerateReqInput.from_dict(await read_json(request)))
        except ValueError as e:
            return error_response(str(e))
        if req.stream:
            async def outputs():
                # aclosing: a client disconnect closes this generator -> abort in scheduler.
                async with contextlib.aclosing(t.generate_request(req)) as outs:
                    async for out in outs:
                        yield sse(out)

            async def stream():
                async for event in errors_as_events(outputs()):
                    yield event
                yield SSE_DONE

            return StreamingResponse(stream(), media_type="text/event-stream")
        out = await last_output_or_disconnect(request, t.generate_request(req))
        if out is None:
            return Response(status_code=499)  # client closed the connection
        for one in out if isinstance(out, list) else [out]:  # n > 1: a list of samples
            fr = one["meta_info"]["finish_reason"]
            if fr is not None and fr["type"] == "abort":
                return abort_error(fr)
        return JSONResponse(out)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await request.app.state.openai_serving.chat_completions(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await request.app.state.openai_serving.completions(request)

    return app


def launch_server(server_args) -> None:
    """Node 0 without torchrun: start the scheduler ranks, then serve HTTP until stopped."""
    from srt.entrypoints.launcher import launch_schedulers, new_port_args, prepare_server_args

    _init_frontend_process(server_args)
    if server_args.nnodes > 1:
        from srt.security.cluster_secret import secret_for_node0

        secret_for_node0(server_args.cluster_secret_file)  # generated and printed if absent
    server_args = prepare_server_args(server_args)
    host = (server_args.dist_init_addr or "").rpartition(":")[0] or None
    port_args = new_port_args(server_args, host)
    serve(server_args, port_args, launch_schedulers(server_args, port_args, defer_stop_signals=True))


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


def serve(server_args, port_args, handles) -> None:
    """Serve HTTP on top of ready scheduler ranks until stopped. A rank that dies takes the
    server down: this raises SystemExit naming the rank (exit code 1). SIGTERM drains
    (srt/entrypoints/drain.py), then this returns."""
    from srt.tokenizer_utils import get_tokenizer

    tm = None
    failure: list[str] = []
    try:
        tokenizer = get_tokenizer(server_args.tokenizer_path or server_args.model_path,
                                  server_args.chat_template)
        tm = TokenizerManager(server_args, port_args, handles.info, tokenizer, handles.input_addrs)
        tm.scheduler_alive = handles.alive
        app = create_app(tm, server_args)
        drain: Drain = app.state.drain
        server = _DrainingServer(uvicorn.Config(
            app, host=server_args.host, port=server_args.port,
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
        server.run()
    finally:
        handles.shutdown()
        if tm is not None:
            tm.close()
    if failure:
        raise SystemExit(f"gramsync: {failure[0]}; the server stopped.")
