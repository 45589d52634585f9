"""``eaglewire serve``: an OpenAI-compatible HTTP server in front of one ``SpecDecoder``; the command.

``serve`` loads the target (and draft) and runs the app of routes.py: the decoding (decode_worker.py)
on the thread that loaded the models, HTTP on a thread beside it (``serve_app`` says why). On
shutdown (``Server``) requests get ``graceful_timeout`` seconds; the app then ends those still
running (a stream with an error event and [DONE]) rather than leave uvicorn to cut them off.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import signal
import socket
import threading

import uvicorn

from eaglewire.decode.load import load_decoder
from eaglewire.concurrency.schedule import Schedule
from eaglewire.serve.decode_worker import DecodeWorker
from eaglewire.serve.serve_config import ServeConfig
from eaglewire.serve.routes import create_app

log = logging.getLogger(__name__)

CUT_MARGIN_SECONDS = 1.0  # uvicorn cancels what is still running this long after the app ended it


class Server(uvicorn.Server):
    """uvicorn's server for a ``create_app`` app. When shutdown begins, requests get the config's
    ``timeout_graceful_shutdown`` seconds; then the app ends those still running (a stream with an
    error event and [DONE], a whole answer with 503). uvicorn's own deadline comes a margin later,
    as a last resort: it cancels responses mid-way (the client loses the connection, the log a traceback)."""

    def __init__(self, config: uvicorn.Config) -> None:
        self.interrupted = False  # set by serve_app on SIGINT (Ctrl-C): the command then exits 130
        self.graceful_timeout = config.timeout_graceful_shutdown
        if self.graceful_timeout is not None:
            config.timeout_graceful_shutdown = self.graceful_timeout + CUT_MARGIN_SECONDS
        super().__init__(config)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.graceful_timeout is not None:
            worker: DecodeWorker = self.config.app.state.worker
            message = (f"the server shut down before this request finished (--graceful-timeout "
                       f"{self.graceful_timeout:g} s)")
            asyncio.get_running_loop().call_later(self.graceful_timeout, worker.end_all, message)
        await super().shutdown(sockets)


# -- the command ---------------------------------------------------------------

def serve_app(server: Server, sockets: list[socket.socket] | None = None) -> bool:
    """Serve the server's app (made with ``engine_thread=False``) until SIGINT/SIGTERM: HTTP on a
    thread of its own, the engine on the calling thread, which should be the one that loaded the models.
    Returns whether the server started (False: e.g. the port was taken; uvicorn logged why).

    Why the engine must not move to a thread of its own: PyTorch's OpenMP runtime (libgomp) keeps
    a pool of worker threads per thread that runs parallel work, and the loading thread already has
    one. A second pool puts more threads than cores under libgomp, which then stops spinning
    between parallel regions, so every small GEMM of a decode step waits for its workers to wake:
    on 2 cores a one-row 576x1536 GEMM takes 2-3x as long on a second thread as on the first
    (benchmarks/experiments/engine/engine_thread.py), and speculative serving was 54.8 ms/token instead of 40.3.
    """
    worker: DecodeWorker = server.config.app.state.worker
    on_main = threading.current_thread() is threading.main_thread()

    def on_signal(sig: int, frame) -> None:
        if server.force_exit:  # a third Ctrl-C: stop now, even in the middle of a long prefill
            raise KeyboardInterrupt
        server.interrupted = server.interrupted or sig == signal.SIGINT
        server.handle_exit(sig, frame)  # graceful shutdown; a second SIGINT cuts the grace period

    # uvicorn listens for signals only on the main thread: catch them here and let it shut down
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}

    def http() -> None:
        try:
            server.run(sockets=sockets)
        finally:  # however HTTP ended (shutdown, a port in use), the engine loop ends with it
            worker.close()

    thread = threading.Thread(target=http, name="eaglewire-http", daemon=True)
    thread.start()
    try:
        worker.run()
        thread.join()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.started


def serve(config: ServeConfig) -> int:
    """Load the target (and draft) and serve until SIGINT/SIGTERM; in-flight requests get
    ``graceful_timeout`` seconds to finish, the rest are told the server shut down. Returns the
    exit status: 0 after SIGTERM, 130 after Ctrl-C (SIGINT, as every command), 1 if the server
    could not start."""
    decoder = load_decoder(config.target, config.draft, config.spec, device=config.device, dtype=config.dtype)
    schedule = None
    if config.schedule is not None:
        if config.draft is None:
            raise ValueError("--schedule chooses between speculation and plain decoding: serve it with the --draft it "
                             "was tuned for")
        schedule = Schedule.load_for(config.schedule, decoder.target, config.draft)
        log.info("schedule %s: %s", config.schedule, schedule.describe())
    app = create_app(decoder, model_name=config.target, max_queue=config.max_queue, api_key=config.api_key,
                     max_context=config.max_context, max_request_bytes=config.max_request_bytes,
                     request_timeout=config.request_timeout, metrics_public=config.metrics_public,
                     engine_thread=False, per_request_metrics=config.per_request_spec_decode_metrics,
                     max_batch=config.max_batch, schedule=schedule)
    if config.api_key is None and config.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", config.host)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # stdout is not for diagnostics
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="info",
                                   log_config=log_config, timeout_graceful_shutdown=config.graceful_timeout))
    return exit_status(server, serve_app(server))


def exit_status(server: Server, started: bool) -> int:
    """What ``eaglewire serve`` exits with once ``serve_app`` returned."""
    if not started:
        return 1
    return 130 if server.interrupted else 0
