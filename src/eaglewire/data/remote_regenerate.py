"""Regenerate assistant replies through OpenAI-compatible servers (llama-server, vLLM, SGLang,
``eaglewire serve``): the replies of the model the user actually serves, quantized or sharded.

Terms as in ``regenerate.py`` (turn, history, truncated, cut, dropped), plus:
  skipped    a conversation a server refused (a 4xx that is the request's fault, e.g. a prompt
             over its context): counted with the server's reason, not written (a rerun tries again)
  probe      the check, before any work, that every server tokenizes like the target here: its
             ``/tokenize`` of the chat-templated probe (the vLLM / SGLang shape with messages, else
             llama-server's with the rendered text) must equal ours token for token, and the
             ``usage.prompt_tokens`` of a one-token chat completion must equal our count
  reasoning  ``<think>...</think>`` text, in the content or in a separate ``reasoning_content``
             (``reasoning``) field as servers with a reasoning parser return it: ``keep`` stores
             it as ``<think>\\n...\\n</think>\\n\\n`` + content, ``strip`` drops it

Conversations go to the servers round robin (conversation i to server i mod n; a retry to the
next server); ``concurrency`` of them are in flight at once, each turn by turn on the history
of its regenerated replies. A finished conversation is one JSONL line, appended in one write
and fsynced, so a crash loses at most the conversations in flight; a rerun skips the ids the
file holds. ``<out>.meta.json`` records the server's model id, the sampling settings and the
reasoning mode (``prepare --data`` carries it into the shards' manifest); a rerun with other
settings is refused. ``<out>.lock`` keeps a second writer out.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from eaglewire.core.fileio import atomic_write_json
from eaglewire.core.locks import file_lock
from eaglewire.data.conversations import Conversation
from eaglewire.data.openai_client import (Client, RequestRefused, RetryPolicy, ServerUnavailable, call_once,
                                          with_retries)
from eaglewire.data.regenerate import (PendingConversation, RegenerateConfig, RegenerateReport, admit, prompt_ids,
                                       prompt_text, read_done_ids)

log = logging.getLogger(__name__)

REASONING_MODES = ("keep", "strip")
META_SUFFIX = ".meta.json"  # the sidecar beside a regenerated JSONL: <out>.meta.json
META_FORMAT = "eaglewire-regenerated"
PROBE_MESSAGES = [  # spaces, digits, accents, CJK, an emoji, code: where tokenizers tend to differ
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tokenizer probe: héllo wörld, 12345 + 678 = 13023 ✓ 日本語 🦅\n\t"
                                "def f(x):\n        return x ** 2  # done"},
]
_THINK = re.compile(r"<think>.*?(?:</think>\s*|$)", re.DOTALL)


@dataclass(kw_only=True)
class RemoteConfig:
    """Where replies come from when they do not come from the target in this process."""

    server: list[str] | None = field(default=None, metadata={
        "help": "regenerate through these OpenAI-compatible servers (base URLs, comma separated) instead of "
                "the target in this process"})
    concurrency: int = field(default=8, metadata={"help": "conversations in flight at once, over all servers"})
    server_model: str | None = field(default=None, metadata={
        "help": "the model id to request (default: the servers' first of /v1/models)"})
    reasoning: str = field(default="keep", metadata={
        "choices": REASONING_MODES, "help": "keep or strip the replies' <think>...</think> reasoning"})
    enable_thinking: bool | None = field(default=None, metadata={
        "help": "the chat template's thinking switch: chat_template_kwargs {enable_thinking: ...} sent to the "
                "servers, or rendered with in this process (default: neither, the template's own default); "
                "recorded in the shards' contract, which the doctor compares with serving"})
    retries: int = field(default=5, metadata={"help": "retries of a request on connection errors, 429 and 5xx"})
    retry_backoff: float = field(default=1.0, metadata={"help": "seconds before the first retry, doubled after each"})
    request_timeout: float = field(default=600.0, metadata={"help": "seconds one request may take"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "environment variable holding the servers' API key (read, never recorded)"})
    llamacpp_gguf: str | None = field(default=None, metadata={
        "help": "start llama-server on this GGUF for the run and regenerate through it (instead of --server)"})
    slots: int = field(default=8, metadata={"help": "with --llamacpp-gguf: llama-server's slots (-np; -cb above 1)"})
    server_threads: int | None = field(default=None, metadata={
        "help": "with --llamacpp-gguf: llama-server's threads (-t, -tb; default: this machine's cores)"})
    llamacpp_dir: str | None = field(default=None, metadata={
        "help": "with --llamacpp-gguf: the llama.cpp build to use (directory or llama-server binary)"})

    def __post_init__(self) -> None:
        if self.reasoning not in REASONING_MODES:
            raise ValueError(f"--reasoning must be one of {', '.join(REASONING_MODES)}, got {self.reasoning!r}")
        for name, low in (("concurrency", 1), ("retries", 0), ("slots", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}, got {value!r}")
        if self.server_threads is not None and self.server_threads < 1:
            raise ValueError(f"--server-threads must be >= 1, got {self.server_threads}")
        if self.retry_backoff < 0 or self.request_timeout <= 0:
            raise ValueError(f"--retry-backoff must be >= 0 and --request-timeout > 0, got {self.retry_backoff} "
                             f"and {self.request_timeout}")
        if self.server and self.llamacpp_gguf:
            raise ValueError("give --server URL (a running server) or --llamacpp-gguf FILE (one started for the "
                             "run), not both")

    @property
    def remote(self) -> bool:
        return bool(self.server or self.llamacpp_gguf)

    def template_kwargs(self) -> dict[str, Any] | None:
        return None if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


@dataclass(kw_only=True)
class RemoteReport(RegenerateReport):
    skipped: dict[str, int] = field(default_factory=dict)  # refused by a server: reason -> conversations
    requests: int = 0
    retries: int = 0
    requests_per_server: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        return (super().summary() + f"; {self.requests} request(s), {self.retries} retried"
                + (f"; {skipped} conversation(s) refused by the server ("
                   + "; ".join(f"{n}: {why}" for why, n in self.skipped.items()) + ")" if skipped else ""))


class TokenizerMismatch(ValueError):
    """The server tokenizes (or templates) differently from the target here; names where."""


# ------------------------------------------------------------------ replies and reasoning

def reply_text(content: str | None, reasoning: str | None, mode: str) -> str:
    """The reply to store: ``content`` with its reasoning kept or stripped (see the module's terms).

    With ``strip`` a ``</think>`` without an opening tag (templates that open the block in the
    generation prompt) drops everything before it, and an unclosed ``<think>`` runs to the end."""
    content = content or ""
    if mode == "strip":
        head, sep, tail = content.partition("</think>")
        if sep and "<think>" not in head:
            content = tail
        return _THINK.sub("", content).lstrip()
    if reasoning and reasoning.strip():
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    return content


def _answer(response: Any) -> tuple[str | None, str | None, bool, int]:
    """(content, reasoning, truncated, completion tokens) of a chat completion."""
    try:
        choice = response["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise ServerUnavailable(f"the server's answer is not a chat completion: {str(response)[:300]}") from None
    reasoning = message.get("reasoning_content") or message.get("reasoning")  # SGLang, llama-server; vLLM 0.33.0
    usage = response.get("usage") or {}
    return message.get("content"), reasoning, choice.get("finish_reason") == "length", int(
        usage.get("completion_tokens") or 0)


# ------------------------------------------------------------------ the servers' model and tokenizer

def served_model(clients: Sequence[Client], wanted: str | None) -> str:
    """The model id every server serves: ``wanted``, else the first server's first of /v1/models."""
    chosen = wanted
    for client in clients:
        answer = call_once(lambda c: c.get("/v1/models"), client)
        ids = [m.get("id") for m in answer.get("data", []) if isinstance(m, dict)] if isinstance(answer, dict) else []
        if not ids:
            raise ServerUnavailable(f"{client.url}/v1/models lists no model: {str(answer)[:200]}")
        chosen = chosen or ids[0]
        if chosen not in ids:
            raise ValueError(f"--server {client.url} serves {ids}, not {chosen!r}: give --server-model with one "
                             "they all serve, or servers of one model")
    return chosen


def _server_tokens(client: Client, model: str, messages: list[dict[str, str]], text: str,
                   template_kwargs: dict[str, Any] | None) -> tuple[str, list[int]] | None:
    """(which route, tokens) from the server's /tokenize, or None when it has none we can read.

    vLLM and SGLang render ``messages`` with their chat template; llama-server reads only
    ``content`` (answering ``{"tokens": []}`` without it), so the rendered text goes second."""
    chat = {"model": model, "messages": messages, "add_generation_prompt": True,
            **({"chat_template_kwargs": template_kwargs} if template_kwargs else {})}
    plain = {"content": text, "add_special": False, "parse_special": True}
    for how, body in (("/tokenize with messages", chat), ("/tokenize with the rendered text", plain)):
        try:
            answer = call_once(lambda c: c.post("/tokenize", body), client)
        except (RequestRefused, ServerUnavailable):  # no such route, or not this body's shape
            continue
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
            return how, tokens
    return None


def _difference(tokenizer: Any, ours: list[int], theirs: list[int]) -> str:
    """Where two token lists part: the index, a few tokens either side as ids and pieces."""
    i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    lo = max(0, i - 3)

    def show(ids: list[int]) -> str:
        part = ids[lo:i + 5]
        return f"{part} {tokenizer.convert_ids_to_tokens(part)}"

    return (f"{len(ours)} tokens here, {len(theirs)} there; first difference at token {i}: here {show(ours)}, "
            f"there {show(theirs)}")


def check_tokenization(client: Client, model: str, tokenizer: Any, messages: list[dict[str, str]],
                       template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Refuse (TokenizerMismatch) a server whose tokens of ``messages`` differ from the target's
    here; returns what was checked, for the manifest."""
    text = prompt_text(tokenizer, messages, template_kwargs)
    ours = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    checked: dict[str, Any] = {"server": client.url, "prompt_tokens": len(ours)}
    fix = ("the server must run the target's tokenizer and chat template (the same model files, --chat-template, "
           "and the same thinking switch: --enable-thinking); regenerated replies would otherwise be trained "
           "under another tokenization")
    found = _server_tokens(client, model, messages, text, template_kwargs)
    if found is not None:
        how, theirs = found
        checked["tokenize"] = how
        if theirs != ours:
            raise TokenizerMismatch(f"--server {client.url} tokenizes differently from the target ({how}): "
                                    f"{_difference(tokenizer, ours, theirs)}; text {text!r}. {fix}")
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0, "stream": False,
            **({"chat_template_kwargs": template_kwargs} if template_kwargs else {})}
    answer = call_once(lambda c: c.post("/v1/chat/completions", body), client)
    counted = (answer.get("usage") or {}).get("prompt_tokens") if isinstance(answer, dict) else None
    if counted is None:
        if found is None:
            raise TokenizerMismatch(f"--server {client.url} has no /tokenize and reports no usage.prompt_tokens: "
                                    "nothing shows that it tokenizes like the target, so it is not used")
    elif counted != len(ours):
        raise TokenizerMismatch(f"--server {client.url} counts {counted} prompt tokens for the probe where the "
                                f"target's chat template gives {len(ours)}: text {text!r}. {fix}")
    checked["usage_prompt_tokens"] = counted
    return checked


# ------------------------------------------------------------------ the sidecar

def meta_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.name + META_SUFFIX)


def read_meta(out: str | Path) -> dict[str, Any] | None:
    """The sidecar of a regenerated JSONL, or None when it has none."""
    path = meta_path(out)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e}); move it away to regenerate into {out} afresh") from e
    return meta if isinstance(meta, dict) and meta.get("format") == META_FORMAT else None


def check_meta(out: Path, settings: dict[str, Any]) -> None:
    meta = read_meta(out)
    if meta is None or not out.exists():
        return
    recorded = meta.get("settings", {})
    diff = sorted(k for k in set(recorded) | set(settings) if recorded.get(k) != settings.get(k))
    if diff:
        raise ValueError(f"{out} holds replies regenerated with other settings ("
                         + "; ".join(f"{k}: {recorded.get(k)!r} there, {settings.get(k)!r} now" for k in diff)
                         + "). Resuming would mix them: use another --out, or move that file (and "
                         f"{meta_path(out).name}) away")


def settings_record(config: RegenerateConfig, remote: RemoteConfig, *, model: str, target: str,
                    tokenizer: Any) -> dict[str, Any]:
    """What shapes the replies (a resume must match): the model, sampling, reasoning, template."""
    template = getattr(tokenizer, "chat_template", None) or ""
    sampling: dict[str, Any] = {"temperature": config.temperature, "max_tokens": config.max_new_tokens}
    if config.temperature > 0:
        sampling |= {"top_p": config.top_p, "seed": config.seed}
    return {"mode": "server", "model": model, "target": target, "sampling": sampling,
            "max_turns": config.max_turns, "max_prompt_tokens": config.max_prompt_tokens,
            "reasoning": remote.reasoning, "chat_template_kwargs": remote.template_kwargs(),
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()}


# ------------------------------------------------------------------ the run

def regenerate_remote(conversations: Sequence[Conversation], out_path: str | Path, *, tokenizer: Any,
                      config: RegenerateConfig, remote: RemoteConfig, urls: Sequence[str], target: str,
                      progress: bool = False, on_answer: Callable[[Any], None] | None = None) -> RemoteReport:
    """Replace every assistant reply of ``conversations`` by the servers' (see the module's text).
    ``on_answer`` sees every answer of a POST as it comes, the probes' included (a capturing server's states of
    them are discarded there).

    Raises TokenizerMismatch before any work when a server tokenizes unlike ``tokenizer``,
    ServerUnavailable when the servers stop answering (what is written is kept), ValueError for
    bad messages or a resume with other settings, DirectoryLocked for a second writer.
    """
    if not urls:
        raise ValueError("regenerate_remote needs at least one server URL (--server)")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    key = os.environ.get(remote.api_key_env) or None
    clients = [Client(u, api_key=key, timeout=remote.request_timeout, on_answer=on_answer) for u in urls]
    with file_lock(out_path.with_name(out_path.name + ".lock"), what=f"--out {out_path}"):
        model = served_model(clients, remote.server_model)
        settings = settings_record(config, remote, model=model, target=target, tokenizer=tokenizer)
        check_meta(out_path, settings)
        probes = [_first_prompt(conversations)] if _first_prompt(conversations) else []
        checked = [check_tokenization(c, model, tokenizer, m, remote.template_kwargs())
                   for c in clients for m in [PROBE_MESSAGES, *probes]]
        log.info("%d server(s) serve %r and tokenize like the target (%d probe(s))", len(clients), model,
                 len(checked))
        meta = {"format": META_FORMAT, "version": 1, "settings": settings, "servers": [c.url for c in clients],
                "probes": checked}
        atomic_write_json(meta_path(out_path), meta, fsync=True)
        report = _Run(clients, model, tokenizer, config, remote).run(conversations, out_path, progress)
        atomic_write_json(meta_path(out_path), {**meta, "report": asdict(report)}, fsync=True)
    log.info("%s", report.summary())
    return report


def _first_prompt(conversations: Sequence[Conversation]) -> list[dict[str, str]] | None:
    """The messages before the first assistant turn of the first conversation (a real probe)."""
    for conv in conversations[:1]:
        end = next((i for i, m in enumerate(conv.messages) if m.get("role") == "assistant"), None)
        if end:
            return [dict(m) for m in conv.messages[:end]]
    return None


class _Stopped(Exception):
    """The run stops (a server is gone, or the user interrupted): the conversation is not finished."""


class _Run:
    """One regeneration: workers run conversations turn by turn; the caller's thread writes them."""

    def __init__(self, clients: list[Client], model: str, tokenizer: Any, config: RegenerateConfig,
                 remote: RemoteConfig) -> None:
        self.clients, self.model, self.tokenizer = clients, model, tokenizer
        self.config, self.remote = config, remote
        self.policy = RetryPolicy(retries=remote.retries, backoff=remote.retry_backoff)
        self.stop = threading.Event()
        self.guard = threading.Lock()  # the tokenizer (a fast tokenizer is not thread safe) and the counters
        self.report = RemoteReport()

    def run(self, conversations: Sequence[Conversation], out_path: Path, progress: bool) -> RemoteReport:
        resumed, started = read_done_ids(out_path), set()
        if resumed:
            log.info("%s already holds %d conversation(s); skipping them", out_path, len(resumed))
        start = time.perf_counter()
        todo = list(admit(conversations, resumed, started, self.report))
        bar = tqdm(total=len(conversations), desc="regenerate", unit="conv", disable=not progress,
                   initial=len(conversations) - len(todo))
        with open(out_path, "a", encoding="utf-8") as out, bar, \
                ThreadPoolExecutor(self.remote.concurrency, thread_name_prefix="eaglewire-regenerate") as pool:
            try:
                self._drain(pool, todo, out, bar, start)
            except BaseException:
                self.stop.set()  # workers end after their request in flight
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            finally:
                self._finish(start)
        return self.report

    def _drain(self, pool: ThreadPoolExecutor, todo: list[tuple[int, Conversation]], out: Any, bar: Any,
               start: float) -> None:
        """Keep ``concurrency`` conversations in flight (twice, so no worker waits) and write each as it ends."""
        queue: Iterator[tuple[int, Conversation]] = iter(todo)
        inflight: set[Future] = set()

        def top_up() -> None:
            while len(inflight) < 2 * self.remote.concurrency and (item := next(queue, None)) is not None:
                inflight.add(pool.submit(self._conversation, *item))

        error: BaseException | None = None
        top_up()
        while inflight:
            done, _ = wait(inflight, return_when=FIRST_COMPLETED)
            for future in done:
                inflight.discard(future)
                try:
                    result = future.result()
                except _Stopped:
                    continue
                except Exception as e:  # the first failure stops the run; what finishes meanwhile is written
                    if error is None:
                        error = e
                        self.stop.set()
                    continue
                self._write(out, result)
                bar.update(1)
            if error is None:
                top_up()
            self._finish(start)
            bar.set_postfix(tok_s=f"{self.report.tokens_per_second:.1f}")
        if error is not None:
            raise error

    def _finish(self, start: float) -> None:
        self.report.seconds = time.perf_counter() - start
        self.report.tokens_per_second = self.report.new_tokens / max(self.report.seconds, 1e-9)

    def _conversation(self, index: int, conv: Conversation) -> tuple[PendingConversation, str | None]:
        """Regenerate one conversation turn by turn; (its state, the server's refusal if any)."""
        p = PendingConversation(conv)
        kwargs = self.remote.template_kwargs()
        while (prompt := p.next_prompt(self.config.max_turns)) is not None:
            if self.stop.is_set():
                raise _Stopped
            with self.guard:
                n = len(prompt_ids(self.tokenizer, prompt, kwargs))
            if n > self.config.max_prompt_tokens:
                log.debug("conversation %r: turn %d prompt has %d > max_prompt_tokens %d tokens; cut there",
                          conv.id, p.turns, n, self.config.max_prompt_tokens)
                p.cut = True
                break
            try:
                content, reasoning, truncated, tokens = _answer(self._request(index, prompt))
            except RequestRefused as e:
                return p, e.reason
            with self.guard:
                self.report.new_tokens += tokens
            text = reply_text(content, reasoning, self.remote.reasoning)
            if not text.strip():  # the loader rejects empty messages
                p.cut = True
                break
            p.add_reply(prompt, text, truncated)
        return p, None

    def _request(self, index: int, prompt: list[dict[str, str]]) -> Any:
        body: dict[str, Any] = {"model": self.model, "messages": prompt, "max_tokens": self.config.max_new_tokens,
                                "temperature": self.config.temperature, "stream": False}
        if self.config.temperature > 0:
            body |= {"top_p": self.config.top_p, "seed": self.config.seed + index}
        if (kwargs := self.remote.template_kwargs()) is not None:
            body["chat_template_kwargs"] = kwargs

        def call(client: Client) -> Any:
            with self.guard:
                self.report.requests += 1
                self.report.requests_per_server[client.url] = self.report.requests_per_server.get(client.url, 0) + 1
            return client.post("/v1/chat/completions", body)

        def retried() -> None:
            if self.stop.is_set():  # another conversation already stopped the run
                raise _Stopped
            with self.guard:
                self.report.retries += 1

        return with_retries(call, self.clients, start=index, policy=self.policy, on_retry=retried)

    def _write(self, out: Any, result: tuple[PendingConversation, str | None]) -> None:
        """Append one finished conversation in a single write, then flush + fsync."""
        p, refused = result
        if refused is not None:
            self.report.skipped = dict(Counter(self.report.skipped) + Counter({refused: 1}))
            log.warning("conversation %r: the server refused it (%s); skipped", p.conv.id, refused)
            return
        if p.turns == 0:
            self.report.conversations_dropped += 1
            return
        out.write(json.dumps(p.record(), ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())
        self.report.conversations_done += 1
        self.report.conversations_cut += p.cut
        self.report.turns_regenerated += p.turns
        self.report.turns_truncated += p.truncated


@contextmanager
def server_urls(remote: RemoteConfig, *, ctx_per_slot: int) -> Iterator[list[str]]:
    """The servers to regenerate through: ``--server``'s, or llama-server started on ``--llamacpp-gguf``
    for the block (``ctx_per_slot`` tokens of context per slot)."""
    if not remote.llamacpp_gguf:
        yield list(remote.server or [])
        return
    import tempfile

    from eaglewire import engines
    from eaglewire.engines.interface import RunSettings, ServedFiles, Shape

    gguf = Path(remote.llamacpp_gguf).expanduser()
    if not gguf.is_file():
        raise FileNotFoundError(f"--llamacpp-gguf {gguf}: no such file; give the target's GGUF")
    runtime = engines.file_reader(gguf.suffix).runtime  # the engine that loads such a file
    if remote.concurrency < remote.slots:
        log.warning("--concurrency %d < --slots %d: %d slot(s) stay idle", remote.concurrency, remote.slots,
                    remote.slots - remote.concurrency)
    settings = RunSettings(threads=remote.server_threads or os.cpu_count() or 1, install=remote.llamacpp_dir,
                           slots=remote.slots, ctx_per_slot=ctx_per_slot)
    why = runtime.available(settings)
    if why:
        raise FileNotFoundError(why)
    with tempfile.TemporaryDirectory(prefix="eaglewire-regenerate-") as logs, \
            runtime.serve(ServedFiles(gguf, None), Shape(), settings, log_path=Path(logs) / "server.log") as server:
        yield [server.url]
