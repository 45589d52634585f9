"""Regeneration through OpenAI-compatible servers.

Invariants: through ``eaglewire serve`` greedy replies equal in-process greedy regeneration of the
same target; two servers give what one gives and both work; a 503 is retried; an interrupted run
resumes to what an uninterrupted one writes; a server that tokenizes otherwise is refused before
any reply is asked; reasoning is kept or stripped; each turn is asked on the regenerated history.
A stdlib fake server on loopback covers what a real one rarely does on demand (503s, refusals,
reasoning fields, a wrong tokenizer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from eaglewire.core.locks import DirectoryLocked
from eaglewire.data.conversations import Conversation, load_conversations
from eaglewire.data.openai_client import ServerUnavailable
from eaglewire.data.regenerate import RegenerateConfig, regenerate
from eaglewire.data.remote_regenerate import (RemoteConfig, TokenizerMismatch, prompt_ids, read_meta,
                                              regenerate_remote, reply_text)
from eaglewire.engines.llamacpp.server import ServerConfig, plain_server_config, server_args
from eaglewire.model.target import Target
from servers import live_server

MODEL = "fake-model"
NEW = 8


def _conv(cid: str, *turns: str) -> Conversation:
    return Conversation(id=cid, messages=[{"role": ("user", "assistant")[i % 2], "content": t}
                                          for i, t in enumerate(turns)])


CONVERSATIONS = [_conv(str(i), f"Question {i}: what is {i} plus {i}?", "old reply") for i in range(6)]
MULTI = _conv("m", "first question", "old 1", "second question", "old 2", "third question", "old 3")


class Fake:
    """An OpenAI-compatible server's behaviour: the reply is a function of the whole prompt."""

    def __init__(self, tokenizer, *, tokenize: str | None = "messages", fail: int = 0, fail_after: int | None = None,
                 refuse: str | None = None, reasoning: str | None = None, count_shift: int = 0,
                 token_shift: bool = False, captures: bool = False) -> None:
        self.tokenizer, self.tokenize, self.fail, self.fail_after = tokenizer, tokenize, fail, fail_after
        self.refuse, self.reasoning, self.count_shift, self.token_shift = refuse, reasoning, count_shift, token_shift
        self.captures = captures  # every completion names a states file, as vLLM with extract_hidden_states does
        self.requests: list[dict] = []  # chat completions beyond the probes, in arrival order
        self.completions = 0  # every chat completion, probes included
        self.lock = threading.Lock()

    def ids(self, messages: list[dict]) -> list[int]:
        return prompt_ids(self.tokenizer, messages, None)

    def handle(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        if path == "/tokenize" and self.tokenize == "messages" and "messages" in body:
            ids = self.ids(body["messages"])
            if self.token_shift:
                ids[3] += 1
            return 200, {"tokens": ids, "count": len(ids), "max_model_len": 4096}
        if path == "/tokenize" and self.tokenize == "content":
            # llama-server answers a body without "content" with no tokens
            ids = self.tokenizer(body["content"], add_special_tokens=False)["input_ids"] if "content" in body else []
            return 200, {"tokens": ids}
        if path != "/v1/chat/completions":
            return 404, {"detail": "Not Found"}
        with self.lock:
            self.completions += 1
            number = self.completions
        status, answer = self.chat(body)
        if self.captures and status == 200:
            answer["kv_transfer_params"] = {"hidden_states_path": f"/states/{number}.safetensors"}
        return status, answer

    def chat(self, body: dict) -> tuple[int, dict]:
        messages = body["messages"]
        usage = {"prompt_tokens": len(self.ids(messages)) + self.count_shift}
        if body["max_tokens"] == 1:  # the probe
            return 200, {"choices": [{"message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                         "usage": usage | {"completion_tokens": 1}}
        with self.lock:
            self.requests.append(body)
            served = len(self.requests)
        if served <= self.fail or (self.fail_after is not None and served > self.fail_after):
            return 503, {"error": {"message": "busy"}}
        if self.refuse is not None and self.refuse in messages[-1]["content"]:
            return 400, {"error": {"message": "prompt too long"}}
        turns = sum(m["role"] == "assistant" for m in messages)
        text = f"reply {turns} to {messages[-1]['content'][:12]} after {len(json.dumps(messages))}"
        message = {"role": "assistant", "content": text}
        if self.reasoning == "field":  # SGLang's and llama-server's name
            message["reasoning_content"] = " pondering "
        elif self.reasoning == "vllm":  # vLLM 0.33.0's
            message["reasoning"] = "pondering"
        elif self.reasoning == "inline":
            message["content"] = "<think>pondering</think>\n\n" + text
        return 200, {"choices": [{"message": message, "finish_reason": "stop"}],
                     "usage": usage | {"completion_tokens": 5}}


@contextmanager
def fake_server(fake: Fake):
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            status, data = fake.handle(method, self.path, body)
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def run(tokenizer, urls, out: Path, conversations=CONVERSATIONS, **remote):
    return regenerate_remote(conversations, out, tokenizer=tokenizer, urls=urls, target="tiny",
                             config=RegenerateConfig(max_new_tokens=NEW, max_prompt_tokens=400),
                             remote=RemoteConfig(**{"retry_backoff": 0.0, "concurrency": 3, **remote}))


def records(path: Path) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


# -- spreading, retrying, resuming ------------------------------------------------------

def test_two_servers_share_the_work_and_write_what_one_writes(tmp_path, smollm2_tokenizer):
    one, a, b = Fake(smollm2_tokenizer), Fake(smollm2_tokenizer), Fake(smollm2_tokenizer, tokenize="content")
    with fake_server(one) as u1:
        run(smollm2_tokenizer, [u1], tmp_path / "one.jsonl")
    with fake_server(a) as ua, fake_server(b) as ub:
        report = run(smollm2_tokenizer, [ua, ub], tmp_path / "two.jsonl", concurrency=4)
    assert records(tmp_path / "two.jsonl") == records(tmp_path / "one.jsonl")
    assert len(records(tmp_path / "two.jsonl")) == len(CONVERSATIONS)
    assert len(a.requests) == len(b.requests) == len(CONVERSATIONS) // 2  # round robin
    assert report.requests_per_server == {ua: 3, ub: 3} and report.conversations_done == 6
    meta = read_meta(tmp_path / "two.jsonl")
    assert meta["settings"]["model"] == MODEL and meta["servers"] == [ua, ub]
    assert {p["tokenize"] for p in meta["probes"]} == {"/tokenize with messages", "/tokenize with the rendered text"}


def test_a_503_is_retried(tmp_path, smollm2_tokenizer):
    fake = Fake(smollm2_tokenizer, fail=2)
    with fake_server(fake) as url:
        report = run(smollm2_tokenizer, [url], tmp_path / "out.jsonl", concurrency=1)
    assert report.retries == 2 and report.conversations_done == len(CONVERSATIONS)
    assert len(fake.requests) == len(CONVERSATIONS) + 2


def test_an_interrupted_run_resumes_to_the_uninterrupted_output(tmp_path, smollm2_tokenizer):
    with fake_server(Fake(smollm2_tokenizer)) as url:
        run(smollm2_tokenizer, [url], tmp_path / "whole.jsonl")
    out = tmp_path / "out.jsonl"
    with fake_server(Fake(smollm2_tokenizer, fail_after=2)) as url:  # the server goes away after 2 replies
        with pytest.raises(ServerUnavailable, match="run the same command again"):
            run(smollm2_tokenizer, [url], out, concurrency=1, retries=1)
    assert len(records(out)) == 2
    with fake_server(fake := Fake(smollm2_tokenizer)) as url:
        report = run(smollm2_tokenizer, [url], out)
    assert report.conversations_skipped_resumed == 2 and len(fake.requests) == len(CONVERSATIONS) - 2
    assert records(out) == records(tmp_path / "whole.jsonl")


def test_when_a_run_stops_every_conversation_answered_is_written(tmp_path, smollm2_tokenizer):
    out = tmp_path / "out.jsonl"
    with fake_server(Fake(smollm2_tokenizer, fail_after=4)) as url:
        with pytest.raises(ServerUnavailable):
            run(smollm2_tokenizer, [url], out, concurrency=3, retries=1)
    assert len(records(out)) == 4


def test_a_refused_request_is_a_counted_skip(tmp_path, smollm2_tokenizer):
    with fake_server(Fake(smollm2_tokenizer, refuse="Question 4")) as url:
        report = run(smollm2_tokenizer, [url], tmp_path / "out.jsonl")
    assert report.skipped == {"prompt too long": 1} and "4" not in records(tmp_path / "out.jsonl")
    assert report.conversations_done == len(CONVERSATIONS) - 1


def test_a_second_writer_is_locked_out(tmp_path, smollm2_tokenizer):
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom eaglewire.core.locks import file_lock\n"
         f"with file_lock({str(out) + '.lock'!r}):\n    print('held', flush=True)\n    time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with fake_server(Fake(smollm2_tokenizer)) as url, pytest.raises(DirectoryLocked, match=f"pid {holder.pid}"):
            run(smollm2_tokenizer, [url], out)
    finally:
        holder.kill()
        holder.wait()


def test_other_settings_are_refused_on_resume(tmp_path, smollm2_tokenizer):
    with fake_server(Fake(smollm2_tokenizer)) as url:
        run(smollm2_tokenizer, [url], tmp_path / "out.jsonl", conversations=CONVERSATIONS[:2])
        with pytest.raises(ValueError, match=r"reasoning: 'keep' there, 'strip' now"):
            run(smollm2_tokenizer, [url], tmp_path / "out.jsonl", reasoning="strip")


# -- the tokenizer probe -----------------------------------------------------------------

@pytest.mark.parametrize("fake_kw, message", [
    (dict(token_shift=True), r"tokenizes differently.*/tokenize with messages.*first difference at token 3"),
    (dict(tokenize=None, count_shift=1), r"counts (\d+) prompt tokens for the probe where the target's chat "
                                         r"template gives \d+"),
])
def test_a_server_that_tokenizes_otherwise_is_refused_before_any_work(tmp_path, smollm2_tokenizer, fake_kw, message):
    fake = Fake(smollm2_tokenizer, **fake_kw)
    with fake_server(fake) as url, pytest.raises(TokenizerMismatch, match=message):
        run(smollm2_tokenizer, [url], tmp_path / "out.jsonl")
    assert fake.requests == [] and not (tmp_path / "out.jsonl").exists()


# -- reasoning, turns ----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["field", "vllm", "inline"])
@pytest.mark.parametrize("mode", ["keep", "strip"])
def test_reasoning_is_kept_or_stripped(tmp_path, smollm2_tokenizer, where, mode):
    with fake_server(Fake(smollm2_tokenizer, reasoning=where)) as url:
        run(smollm2_tokenizer, [url], tmp_path / "out.jsonl", conversations=CONVERSATIONS[:1], reasoning=mode)
    reply = records(tmp_path / "out.jsonl")["0"]["messages"][-1]["content"]
    assert reply.startswith("reply 0 to Question 0") == (mode == "strip")
    if mode == "keep":
        want = "<think>\npondering\n</think>\n\n" if where != "inline" else "<think>pondering</think>\n\n"
        assert reply.startswith(want) and reply.removeprefix(want).startswith("reply 0 to Question 0")
    assert read_meta(tmp_path / "out.jsonl")["settings"]["reasoning"] == mode


def test_reply_text_strips_a_block_opened_in_the_prompt_and_an_unclosed_one():
    assert reply_text("thoughts</think>\n\nanswer", None, "strip") == "answer"
    assert reply_text("<think>still thinking", None, "strip") == ""
    assert reply_text("a <think>x</think> b", None, "strip") == "a b"
    assert reply_text("answer", "", "keep") == "answer"


def test_each_turn_is_asked_on_the_regenerated_history(tmp_path, smollm2_tokenizer):
    fake = Fake(smollm2_tokenizer)
    with fake_server(fake) as url:
        report = run(smollm2_tokenizer, [url], tmp_path / "out.jsonl", conversations=[MULTI])
    messages = records(tmp_path / "out.jsonl")["m"]["messages"]
    assert report.turns_regenerated == 3 and [m["content"] for m in messages[::2]] == [
        "first question", "second question", "third question"]
    for k, request in enumerate(fake.requests):  # turn k is asked on the replies written before it
        assert request["messages"] == messages[:2 * k + 1]
    assert "old" not in json.dumps(messages)


def test_enable_thinking_is_sent_and_recorded(tmp_path, smollm2_tokenizer):
    fake = Fake(smollm2_tokenizer)
    with fake_server(fake) as url:
        run(smollm2_tokenizer, [url], tmp_path / "out.jsonl", conversations=CONVERSATIONS[:1], enable_thinking=False)
    assert fake.requests[0]["chat_template_kwargs"] == {"enable_thinking": False}
    assert read_meta(tmp_path / "out.jsonl")["settings"]["chat_template_kwargs"] == {"enable_thinking": False}


# -- through eaglewire's own server ----------------------------------------------------------

@contextmanager
def eaglewire_server(target: Target):
    from eaglewire.decode.spec_decoder import SpecDecoder
    from eaglewire.serve.routes import create_app

    with live_server(create_app(SpecDecoder(target), model_name="tiny-chat")) as (url, _):
        yield url


def test_through_eaglewire_serve_equals_in_process_greedy(tmp_path, lively_target):
    conversations = CONVERSATIONS[:3] + [MULTI]
    config = RegenerateConfig(max_new_tokens=NEW, max_prompt_tokens=400)
    regenerate(lively_target, conversations, tmp_path / "here.jsonl", config=config)
    with eaglewire_server(lively_target) as url:
        report = regenerate_remote(conversations, tmp_path / "served.jsonl", tokenizer=lively_target.tokenizer,
                                   urls=[url], target="tiny", config=config, remote=RemoteConfig(concurrency=2))
    here, served = records(tmp_path / "here.jsonl"), records(tmp_path / "served.jsonl")
    assert served == here and report.turns_regenerated == 6
    assert len({r["messages"][1]["content"] for r in served.values()}) > 1  # replies depend on the prompt
    probes = read_meta(tmp_path / "served.jsonl")["probes"]
    assert "tokenize" not in probes[0] and probes[0]["usage_prompt_tokens"] == probes[0]["prompt_tokens"]


def test_prepare_regenerates_through_a_server_and_records_it(tmp_path, chat_tiny_target):
    from eaglewire.data.prepare import PrepareConfig, prepare

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in CONVERSATIONS[:3]))
    fake = Fake(chat_tiny_target.tokenizer)
    with fake_server(fake) as url:
        prepare(PrepareConfig(out=str(tmp_path / "shards"), data=str(data), max_length=64, batch_tokens=256,
                              regenerate=True, max_new_tokens=NEW, remote=RemoteConfig(server=[url])),
                target=chat_tiny_target, progress=False)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["status"]["regenerated_by"]["model"] == MODEL and manifest["status"]["complete"]
    assert manifest["source"]["regenerate"]["server"]["reasoning"] == "keep"
    done, _ = load_conversations(tmp_path / "shards" / "regenerated.rank0.jsonl")
    assert [c.messages[1]["content"][:7] for c in done] == ["reply 0"] * 3 and len(fake.requests) == 3

    # The JSONL of `regenerate` as --data: its sidecar goes into the manifest's source.
    out = tmp_path / "shards" / "regenerated.rank0.jsonl"
    prepare(PrepareConfig(out=str(tmp_path / "again"), data=str(out), max_length=64, batch_tokens=256),
            target=chat_tiny_target, progress=False)
    again = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert again["source"]["regenerated_by"] == read_meta(out)["settings"]
    with pytest.raises(ValueError, match="add --regenerate"):
        PrepareConfig(out="x", remote=RemoteConfig(server=[url]))


class CapturingEngine:
    """A capturing engine (``CapturedStates``) whose server is ``fake``: the in-process states of what it is sent;
    the answers it is handed back to discard are recorded."""

    def __init__(self, target, url, boundaries):
        from eaglewire.data.engine_capture import states_here

        self.target, self.url, self.boundaries, self.version = target, url, boundaries, "fake 1.0"
        self.states_here, self.sent, self.discarded = states_here, [], []

    def states(self, ids):
        self.sent.append(ids)
        here = self.states_here(self.target, ids)
        return torch.stack([here[b] for b in self.boundaries], dim=1)  # [T, n, H]

    def discard(self, answer):
        self.discarded.append((answer or {}).get("kv_transfer_params"))


def test_prepare_regenerates_through_the_capturing_engine(tmp_path, chat_tiny_target, monkeypatch):
    """--regenerate --capture ENGINE without --server: the engine's server writes the replies (one server does
    both), the states it kept of every completion are released (the probes' too), and the states are of the
    regenerated conversations; the source records it, so a resume cannot mix in replies made elsewhere."""
    from eaglewire.data.prepare import PrepareConfig, prepare
    from eaglewire.data.shards import ShardDataset
    from eaglewire.engines.vllm import capture as vcap

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in CONVERSATIONS[:3]))
    fake = Fake(chat_tiny_target.tokenizer, captures=True)
    engines = []
    with fake_server(fake) as url:
        @contextmanager
        def capture(self, target, boundaries, num_layers, arch, settings, *, work_dir, url=None):
            assert settings.max_model_len >= RegenerateConfig(max_new_tokens=NEW).context  # a reply fits
            engines.append(CapturingEngine(chat_tiny_target, fake_url, [*boundaries, num_layers]))
            yield engines[-1]

        fake_url = url
        monkeypatch.setattr(vcap.VllmCapturer, "capture", capture)
        config = PrepareConfig(out=str(tmp_path / "shards"), data=str(data), max_length=64, batch_tokens=256,
                               regenerate=True, max_new_tokens=NEW, capture="vllm", dtype="fp32")
        assert config.regenerates_through_capture
        prepare(config, target=chat_tiny_target, progress=False)
    engine = engines[0]
    assert len(fake.requests) == 3 and fake.completions == 5  # three replies and the two tokenizer probes
    assert sorted(d["hidden_states_path"] for d in engine.discarded if d) == sorted(
        f"/states/{n}.safetensors" for n in range(1, 6))
    done, _ = load_conversations(tmp_path / "shards" / "regenerated.rank0.jsonl")
    assert [c.messages[1]["content"][:7] for c in done] == ["reply 0"] * 3
    shards = ShardDataset(tmp_path / "shards")
    assert sorted(map(list, (s["input_ids"].tolist() for s in shards))) == sorted(engine.sent)
    text = chat_tiny_target.tokenizer.decode(engine.sent[0])
    assert "reply 0 to Question" in text and "old reply" not in text
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["source"]["regenerate"]["server"]["capture"] == "vllm"
    assert manifest["status"]["capture"] == "fake 1.0" and manifest["status"]["complete"]


# -- the command and llama-server's launch ---------------------------------------------------

def test_the_command_takes_a_list_of_servers():
    from eaglewire.cli import build_parser
    from eaglewire.core.configs import config_from_args
    from eaglewire.data.regenerate_command import RegenerateCommandConfig

    args = build_parser().parse_args(["regenerate", "--out", "x.jsonl", "--server", "http://a:1,http://b:2",
                                      "--concurrency", "16", "--reasoning", "strip", "--no-enable-thinking"])
    config = config_from_args(RegenerateCommandConfig, args)
    assert config.remote.server == ["http://a:1", "http://b:2"] and config.remote.concurrency == 16
    assert config.remote.template_kwargs() == {"enable_thinking": False} and config.remote.reasoning == "strip"
    with pytest.raises(ValueError, match="--reasoning must be one of keep, strip"):
        RemoteConfig(reasoning="save")


def test_llama_server_slots_and_context_per_slot():
    args = server_args(plain_server_config(Path("m.gguf"), slots=8, threads=2, ctx_per_slot=1024), port=1)
    assert args[args.index("-np") + 1] == "8" and "-cb" in args and args[args.index("-c") + 1] == str(8 * 1024)
    assert args[args.index("-t") + 1] == "2" and args[args.index("-tb") + 1] == "2"
    one = server_args(ServerConfig(model=Path("m.gguf")), port=1)  # the doctor's and bench's launch: unchanged
    assert one[one.index("-np") + 1] == "1" and "-cb" not in one


def test_the_command_regenerates_in_process_without_a_server_and_refuses_other_settings(tmp_path, target_dir,
                                                                                        capsys):
    from eaglewire.cli import main

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in CONVERSATIONS[:2]))
    out = tmp_path / "r.jsonl"
    argv = ["regenerate", "--target", str(target_dir), "--data", str(data), "--out", str(out),
            "--max-new-tokens", "4", "--device", "cpu", "--no-progress"]
    assert main(argv) == 0
    assert set(records(out)) == {"0", "1"} and "prepare --data" in capsys.readouterr().out
    settings = read_meta(out)["settings"]
    assert settings["mode"] == "in-process" and settings["sampling"] == {"temperature": 0.0, "max_tokens": 4}
    assert main(argv[:-4] + ["8", "--device", "cpu", "--no-progress"]) == 2
    assert "max_tokens" in capsys.readouterr().err and not out.with_name("r.jsonl.lock").exists()
