"""Stand-ins for llama-server (a Python script named llama-server), for the tests that find,
install and smoke-run it without a real build."""

from __future__ import annotations

import sys
from pathlib import Path

# A llama-server stand-in that serves /health and /completion (n_predict tokens), as the smoke run asks.
SERVING = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--version" in sys.argv:
    print("version: 0.6.0 (build 11434, commit x)")
    sys.exit(0)
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self): self._send({"status": "ok"})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send({"tokens": list(range(body["n_predict"])), "content": ""})
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
# What ggml's AMX kernels did in a worker thread: load the model, then die of SIGILL.
TRAPS = "import os, signal\nprint('load_tensors: CPU_REPACK model buffer size')\nos.kill(os.getpid(), signal.SIGILL)"


def fake_server(path: Path, script: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{script}\n")
    path.chmod(0o755)
    return path
