"""eaglewire's server (or any ASGI app) on a free loopback port in a background thread, for tests."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from eaglewire.serve.app import Server


def loopback_server(app, graceful: float = 5.0) -> tuple[Server, socket.socket, str]:
    """A uvicorn server for ``app``, a socket bound to a free loopback port for it, and its base url."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful))
    return server, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def wait_started(server: uvicorn.Server, running=lambda: True) -> None:
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and running(), "the server did not start"
        time.sleep(0.02)


@contextmanager
def live_server(app, graceful: float = 5.0):
    """Run ``app`` on a free loopback port in a background thread; yield (base url, uvicorn server)."""
    server, sock, url = loopback_server(app, graceful)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_started(server, thread.is_alive)
    try:
        yield url, server
    finally:
        server.should_exit = True
        thread.join(20)
        assert not thread.is_alive(), "the server did not stop"


def vllm_metrics(drafts: int, tokens: int, accepted: int, per_pos: list[int]) -> str:
    """vLLM's speculative counters as its /metrics writes them (Prometheus text), for stub servers."""
    lines = []
    for name, value in (("drafts", drafts), ("draft_tokens", tokens), ("accepted_tokens", accepted)):
        lines += [f"# TYPE vllm:spec_decode_num_{name}_total counter",
                  f'vllm:spec_decode_num_{name}_total{{engine="0",model_name="m"}} {value}']
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
    lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{i}"}} {v}'
              for i, v in enumerate(per_pos)]
    return "\n".join(lines) + "\n"

