"""``bench --concurrency`` on an engine launched here as a server (llama-server, vLLM): one server per config
(plain first), launched with as many slots as the most clients, and at each concurrency C clients in a closed loop
over the bench's prompts: each sends its next request the moment its last one is answered.

Answers come whole (no streaming), so a row has no time to first token; its per-token figure is a request's time
from sending to its answer over its tokens. Drafting rounds come from the engine's own counter
(``RunningServer.spec_rounds``). Servers run config-major (each holds its own copy of the target), levels inside.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from tqdm.auto import tqdm

from eaglewire.concurrency.closed_loop import LoadRow, compare_with_plain
from eaglewire.engines.interface import RunningServer, RunSettings, ServedFiles, Shape


def closed_loop_server(server: RunningServer, prompts: list[list[int]], clients: int, *, max_new_tokens: int,
                       temperature: float = 0.0, seed: int = 0, name: str = "", progress: bool = False) -> LoadRow:
    """Every prompt once, ``clients`` of them in flight at a time, against ``server`` (one thread a client)."""
    waiting = deque(range(len(prompts)))
    outputs: dict[int, list[int]] = {}
    per_token: dict[int, float] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()
    bar = tqdm(total=len(prompts), desc=f"{name} x{clients}", unit="request", disable=not progress)

    def client() -> None:
        while not failures:
            with lock:
                if not waiting:
                    return
                i = waiting.popleft()
            sent = time.perf_counter()
            try:
                tokens = server.complete(prompts[i], max_new_tokens=max_new_tokens, temperature=temperature,
                                         seed=seed + i)
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                failures.append(e)
                return
            with lock:
                outputs[i] = tokens
                per_token[i] = (time.perf_counter() - sent) / max(len(tokens), 1)
                bar.update()

    before = server.spec_rounds()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(clients, len(prompts)))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    bar.close()
    if failures:
        raise failures[0]
    rounds = None if before is None else (server.spec_rounds() or 0) - before
    return LoadRow(name, clients, seconds, [outputs[i] for i in range(len(prompts))], ttft=[],
                   per_token=[per_token[i] for i in range(len(prompts))], speculative_steps=rounds or 0,
                   steps=rounds or 0, streamed=False)


def bench_server_concurrency(runtime, files: ServedFiles, settings: RunSettings, launches: dict[str, Shape],
                             prompts: list[list[int]], levels: list[int], *, max_new_tokens: int, temperature: float,
                             seed: int, warmup: int, log_dir: Path, progress: bool) -> list[LoadRow]:
    """Each named launch of ``runtime`` (a ``Runtime``; the first plain) loaded at each concurrency: LoadRows
    level-major, each compared with the plain launch's at the same level."""
    launched = replace(settings, slots=max(levels))
    by_launch: list[list[LoadRow]] = []
    for name, shape in launches.items():
        log = Path(log_dir) / f"{name.replace(' ', '-').replace(',', '_')}-load.log"
        with runtime.serve(files, shape, launched, log_path=log) as server:
            for ids in prompts[:warmup]:
                server.complete(ids, max_new_tokens=min(16, max_new_tokens), temperature=temperature, seed=seed)
            by_launch.append([closed_loop_server(server, prompts, clients, max_new_tokens=max_new_tokens,
                                                 temperature=temperature, seed=seed, name=name, progress=progress)
                              for clients in levels])
    return [row for level in zip(*by_launch) for row in compare_with_plain(list(level))]
