"""``eaglewire serve`` against a live uvicorn on loopback, spoken to with the official openai client.

Invariants: greedy text equals the plain engine's for the same prompt ids, streamed chunks
concatenate to the non-streamed text, bad input is a 4xx naming the field and the server keeps
serving, a full queue is a 429, a client that leaves frees its slot at once, no request waits for
another's tokenization, a stream outliving the grace period still ends with [DONE].
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import uvicorn
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from eaglewire.core.contract import HiddenStateContract
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.text import StopStrings, encode_prompt
from eaglewire.core.tokens import stop_token_ids
from eaglewire.model.draft import DraftConfig, Eagle3Draft
from eaglewire.serve.app import Server, exit_status, serve_app
from eaglewire.serve.serve_config import ServeConfig, add_serve_args
from eaglewire.serve.routes import create_app
from servers import live_server, loopback_server, wait_started

MODEL = "tiny-chat"
MAX_TOKENS = 12
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"

pytestmark = pytest.mark.usefixtures("one_thread")


def random_draft(target, bounds=(2, 4, 5)):
    torch.manual_seed(0)
    V = target.vocab_size
    draft = Eagle3Draft(DraftConfig.from_target(target.text_config, num_aux=len(bounds), draft_vocab_size=V,
                                                vocab_size=V))
    draft.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return draft, HiddenStateContract(aux_boundaries=bounds, target=target.fingerprint)


STEP_DELAY = 0.2  # seconds a step of a slow engine's batch takes


def slow_app(target, **kwargs):
    """A plain server whose engine takes STEP_DELAY seconds a step: requests that hold the engine."""
    app = create_app(SpecDecoder(target), model_name=MODEL, **kwargs)
    engine = app.state.worker.engine
    step = engine.step

    def slow_step():
        advanced = step()
        time.sleep(STEP_DELAY)
        return advanced

    engine.step = slow_step
    return app


@pytest.fixture(scope="module")
def server(chat_tiny_target):
    """A speculative server (random draft, so greedy output must still equal plain greedy)."""
    draft, contract = random_draft(chat_tiny_target)
    decoder = SpecDecoder(chat_tiny_target, draft, contract, SpecConfig(num_steps=3, topk=2, num_draft_tokens=6))
    with live_server(create_app(decoder, model_name=MODEL)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def slow_server(chat_tiny_target):
    """One slot, an API key, and an engine slow enough to be caught busy."""
    app = slow_app(chat_tiny_target, max_queue=1, api_key="sekret")
    with live_server(app) as (url, _):
        yield url


def client(url: str, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def reference(target, prompt_ids: list[int], max_tokens: int = MAX_TOKENS, stops=None) -> tuple[str, int]:
    """(text, completion tokens) of plain greedy decoding, as ``eaglewire generate`` does it."""
    tok = target.tokenizer
    ids, _ = SpecDecoder(target).generate(prompt_ids, max_new_tokens=max_tokens,
                                          stop_token_ids=set(stop_token_ids(tok, target.model)),
                                          should_stop=StopStrings(tok, stops) if stops else None)
    return StopStrings(tok, stops).cut(tok.decode(ids, skip_special_tokens=True)), len(ids)


def chat_ids(target, content: str) -> list[int]:
    return encode_prompt(target.tokenizer, [{"role": "user", "content": content}], chat=True)


def text_ids(target, prompt: str) -> list[int]:
    return encode_prompt(target.tokenizer, prompt, chat=False)


def raw(url: str, method: str, path: str, body: bytes | dict | None = None,
        headers: dict | None = None, timeout: float = 30) -> tuple[int, dict | str]:
    """A hand-made request, for what a real client refuses to send (malformed JSON, missing keys)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, json.loads(text) if resp.getheader("content-type", "").startswith("application/json") else text


def samples(text: str) -> list:
    """The samples of a /metrics text, read by prometheus_client's own parser."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items())


def five_xx(text: str) -> float:
    return sum(s.value for s in samples(text) if s.name == "eaglewire_requests_total" and s.labels["status"][0] == "5")


# -- answers ---------------------------------------------------------------------

def test_chat_equals_plain_greedy_with_usage(server, chat_tiny_target):
    ids = chat_ids(chat_tiny_target, "Name three colours.")
    want, n = reference(chat_tiny_target, ids)
    r = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
                                               max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if n == MAX_TOKENS else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)
    assert r.object == "chat.completion" and r.model == MODEL


def test_completion_equals_plain_greedy_with_usage(server, chat_tiny_target):
    ids = text_ids(chat_tiny_target, "Once upon a time")
    want, n = reference(chat_tiny_target, ids)
    r = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == want
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), n)
    token_ids = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert token_ids.choices[0].text == want
    default = client(server).completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert default.choices[0].text == reference(chat_tiny_target, ids, max_tokens=16)[0]  # OpenAI's default: 16


@pytest.mark.parametrize("chat", [True, False])
def test_stream_concatenates_to_the_whole_answer(server, chat):
    c = client(server)
    if chat:
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=MAX_TOKENS,
                  temperature=0)
        whole = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        want = whole.choices[0].message.content
    else:
        kw = dict(model=MODEL, prompt="The weather today", max_tokens=MAX_TOKENS, temperature=0)
        whole = c.completions.create(**kw)
        chunks = list(c.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        want = whole.choices[0].text
    assert text == want and len(chunks) > 2
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stop_strings_cut_the_text(server, chat_tiny_target):
    prompt = "List some animals:"
    full, _ = reference(chat_tiny_target, text_ids(chat_tiny_target, prompt), max_tokens=16)
    assert len(full) >= 8, full
    stop = full[4:7]
    want = full[:full.index(stop)]
    c = client(server)
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    chunks = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                  stop=["never-said-xyz", stop], stream=True)
    assert "".join(ch.choices[0].text for ch in chunks) == want


def test_seeded_sampling_repeats(server):
    kw = dict(model=MODEL, prompt="Pick a word:", max_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    a, b = (client(server).completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b


def test_models_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert raw(server, "GET", "/health") == (200, {"status": "ok"})
    spec = raw(server, "GET", "/openapi.json")[1]  # the routes parse their bodies; the models are still documented
    body = spec["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.rsplit("/", 1)[1] in spec["components"]["schemas"]


# -- bad input ------------------------------------------------------------------

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LONG = "word " * 600  # more tokens than the tiny target's 512 positions

BAD = [  # (what, path, body, status, param)
    ("malformed JSON", CHAT, b'{"messages": [', 400, None),
    ("not an object", CHAT, b"[1, 2]", 400, None),
    ("no messages", CHAT, {"model": MODEL, "max_tokens": 4}, 400, "messages"),
    ("empty messages", CHAT, {**GOOD, "messages": []}, 400, "messages"),
    ("unknown role", CHAT, {**GOOD, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("content not text", CHAT, {**GOOD, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("negative max_tokens", CHAT, {**GOOD, "max_tokens": -3}, 400, "max_tokens"),
    ("zero max_tokens", CHAT, {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", CHAT, {**GOOD, "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens a string", CHAT, {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    ("temperature negative", CHAT, {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("temperature a string", CHAT, {**GOOD, "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", CHAT, {**GOOD, "top_p": 0}, 400, "top_p"),
    ("stop a number", CHAT, {**GOOD, "stop": 5}, 400, "stop"),
    ("stop empty", CHAT, {**GOOD, "stop": [""]}, 400, "stop"),
    ("stream not a bool", CHAT, {**GOOD, "stream": "yes"}, 400, "stream"),
    ("seed a float", CHAT, {**GOOD, "seed": 1.5}, 400, "seed"),
    ("n > 1", CHAT, {**GOOD, "n": 3}, 400, "n"),
    ("chat prompt too long", CHAT, {**GOOD, "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("unknown model", CHAT, {**GOOD, "model": "gpt-9"}, 404, "model"),
    ("no prompt", COMPLETIONS, {"model": MODEL, "max_tokens": 4}, 400, "prompt"),
    ("prompt a number", COMPLETIONS, {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("prompt too long", COMPLETIONS, {"model": MODEL, "prompt": LONG, "max_tokens": 4}, 400, "prompt"),
    ("token id out of range", COMPLETIONS, {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    ("two prompts", COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ("unknown route", "/v1/embeddings", {"model": MODEL}, 404, None),
    ("not UTF-8", CHAT, b'{"model": "\xff", "messages": []}', 400, None),
    ("empty body", CHAT, b"", 400, None),
    ("tools", CHAT, {**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("tool_choice", CHAT, {**GOOD, "tool_choice": "required"}, 400, "tool_choice"),
    ("json mode", CHAT, {**GOOD, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("seed past torch's 64 bits", CHAT, {**GOOD, "seed": 1180591620717411303424}, 400, "seed"),
    ("seed of 5,000 digits", CHAT, b'{"messages": [], "seed": 1' + b"0" * 5000 + b"}", 400, None),
    ("nested 100,000 deep", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("nested 900 deep in an ignored field", CHAT, json.dumps(GOOD)[:-1].encode() + b', "x": ' + b"[" * 900
     + b"]" * 900 + b"}", 200, None),
    ("lone surrogate", CHAT, {**GOOD, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400,
     "messages[0].content"),
    ("lone surrogate in a stop", COMPLETIONS, {"model": MODEL, "prompt": "x", "stop": ["\udfff"]}, 400, "stop[0]"),
    ("image part", CHAT, {**GOOD, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
]


def test_bad_input_is_a_4xx_naming_the_field_and_serving_goes_on(server):
    for what, path, body, status, param in BAD:
        got, reply = raw(server, "POST", path, body)
        assert got == status, (what, reply)
        if status == 200:
            continue
        assert set(reply["error"]) == {"message", "type", "param", "code"}, what
        assert reply["error"]["param"] == param, (what, reply)
        assert param is None or param in reply["error"]["message"], (what, reply)
        code = reply["error"]["code"]  # OpenAI's error object: null or a string token, not a status number
        assert code is None or (isinstance(code, str) and not code.isdigit()), (what, reply)
    assert raw(server, "POST", CHAT, GOOD)[0] == 200


def test_errors_say_what_is_wrong(server):
    status, reply = raw(server, "POST", CHAT, b'{"messages": "caf\xe9"}')  # latin-1, not UTF-8
    assert status == 400 and "UTF-8" in reply["error"]["message"] and "this server has" not in reply["error"]["message"]
    status, reply = raw(server, "POST", CHAT, {**GOOD, "messages": [{"role": "user", "content": "a\ud800b"}]})
    assert "not valid Unicode" in reply["error"]["message"] and "chat template" not in reply["error"]["message"]
    assert "tools is not supported" in raw(server, "POST", CHAT, {**GOOD, "tools": [{"type": "function"}]})[1][
        "error"]["message"]
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    message = raw(server, "POST", CHAT, {**GOOD, "messages": [image]})[1]["error"]["message"]
    assert "'image_url'" in message and "only text content parts" in message, message


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_body_not_sent_as_json_is_415(server, content_type):
    """The CORS "simple request" types (and none at all): a web page may send them to a local server
    without a preflight, so reading them as JSON would let any page drive a server without --api-key."""
    conn = http.client.HTTPConnection(*server.removeprefix("http://").split(":"), timeout=30)
    conn.putrequest("POST", CHAT)
    body = json.dumps(GOOD).encode()
    if content_type:
        conn.putheader("Content-Type", content_type)
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    resp = conn.getresponse()
    reply = json.loads(resp.read())
    conn.close()
    assert resp.status == 415, reply
    assert "Content-Type: application/json" in reply["error"]["message"] and repr(content_type or "nothing") in reply[
        "error"]["message"]
    assert raw(server, "POST", CHAT, GOOD, headers={"Content-Type": "application/json; charset=utf-8"})[0] == 200


@pytest.mark.parametrize("value", [2**70, -2**70])
def test_no_integer_field_value_is_a_server_error(server, value):
    """Every integer field, past any C integer: a 4xx naming the field, or an answer; never a 5xx."""
    cases = [(CHAT, {**GOOD, f: value}, f) for f in ("max_tokens", "max_completion_tokens", "top_k", "seed", "n")]
    cases += [(COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 1, f: value}, f)
              for f in ("logprobs", "top_k", "seed")]
    cases += [(COMPLETIONS, {"model": MODEL, "prompt": [value], "max_tokens": 1}, "prompt")]
    for path, body, field in cases:
        status, reply = raw(server, "POST", path, body)
        assert status < 500, (field, reply)
        assert status == 200 or reply["error"]["param"] == field, (field, reply)


def test_what_a_lenient_reader_takes(server):
    """Text content parts, tools that are empty."""
    parts = [{"type": "text", "text": "Name three "}, {"type": "text", "text": "colours."}]
    c = client(server)
    as_parts = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}],
                                         max_tokens=MAX_TOKENS, temperature=0, tools=[])
    as_text = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name three colours."}],
                                        max_tokens=MAX_TOKENS, temperature=0)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage == as_text.usage


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server, chat_tiny_target, monkeypatch):
    import eaglewire.serve.token_budget as token_budget

    calls = []
    real = token_budget.encode_prompt
    monkeypatch.setattr(token_budget, "encode_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    context = client(server).models.list().data[0].max_model_len
    token_chars = token_budget.max_token_chars(chat_tiny_target.tokenizer)
    assert token_chars is not None and token_chars > 1
    too_long = "a" * (context * token_chars)  # at least `context` tokens, whatever the tokenizer makes of it
    for path, body, param in [(COMPLETIONS, {"model": MODEL, "prompt": too_long}, "prompt"),
                              (CHAT, {**GOOD, "messages": [{"role": "user", "content": too_long}]}, "messages")]:
        status, reply = raw(server, "POST", path, body)
        assert status == 400 and reply["error"]["param"] == param, reply
        assert reply["error"]["code"] == "context_length_exceeded"
    assert calls == [], "the prompt was tokenized"
    # The floor never refuses what fits: more characters than the context has tokens, yet few tokens.
    fits = "#" * (80 * 50)
    r = client(server).completions.create(model=MODEL, prompt=fits, max_tokens=1)
    assert len(fits) > context > r.usage.prompt_tokens and calls


def test_tokenizing_does_not_hold_up_the_server(server, monkeypatch):
    """A prompt being tokenized (a long one takes seconds) must not stall other requests."""
    import eaglewire.serve.routes as routes

    entered, release = threading.Event(), threading.Event()
    real = routes.completion_prompt_ids

    def slow(*args, **kwargs):
        entered.set()
        release.wait(20)
        return real(*args, **kwargs)

    monkeypatch.setattr(routes, "completion_prompt_ids", slow)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client(server).completions.create, model=MODEL, prompt="hi", max_tokens=2)
        try:
            assert entered.wait(20)
            assert raw(server, "GET", "/health", timeout=5) == (200, {"status": "ok"})  # answered meanwhile
        finally:
            release.set()
        assert pending.result().usage.completion_tokens >= 1


def test_a_body_over_the_limit_is_413_before_it_is_parsed(chat_tiny_target):
    app = create_app(SpecDecoder(chat_tiny_target), model_name=MODEL, max_request_bytes=1000)
    body = json.dumps({"model": MODEL, "prompt": "x " * 1000, "max_tokens": 1}).encode()
    with live_server(app) as (url, _):
        status, reply = raw(url, "POST", COMPLETIONS, body)  # refused by its Content-Length
        assert status == 413 and "--max-request-bytes" in reply["error"]["message"], reply
        assert "1000" in reply["error"]["message"]
        status, reply = raw(url, "POST", COMPLETIONS, iter([body[i:i + 300] for i in range(0, len(body), 300)]))
        assert status == 413, reply  # no Content-Length (chunked): refused as it arrives
        assert raw(url, "POST", COMPLETIONS, {"model": MODEL, "prompt": "x", "max_tokens": 1})[0] == 200
        assert metric(raw(url, "GET", "/metrics")[1], "eaglewire_requests_total", status="413") == 2


def test_a_body_that_never_arrives_whole_is_408(chat_tiny_target):
    """A client that declares more bytes than it sends is answered once --request-timeout passes."""
    app = create_app(SpecDecoder(chat_tiny_target), model_name=MODEL, request_timeout=0.5)
    with live_server(app) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 100\r\n\r\n{\"model\":".encode())
            reply = b""
            while b"}}" not in reply:
                reply += sock.recv(4096) or pytest.fail(f"closed without an answer: {reply!r}")
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), head
        error = json.loads(body)["error"]
        assert "--request-timeout" in error["message"] and "9 of 100 bytes" in error["message"], error
        assert raw(url, "POST", CHAT, GOOD)[0] == 200  # serving goes on
    with pytest.raises(ValueError, match="request_timeout"):
        create_app(SpecDecoder(chat_tiny_target), model_name=MODEL, request_timeout=0)


def test_the_client_sees_bad_input_as_bad_request(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2)
    assert e.value.param == "n" and "only n=1" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    assert e.value.param == "max_tokens"


# -- load, metrics ---------------------------------------------------------------

def test_concurrent_clients_some_leaving_early(server, chat_tiny_target):
    """6 clients x 3 requests: whole chat answers, streamed completions, streams dropped after one chunk."""
    prompts = ["alpha", "beta gamma", "delta"]
    chat_want = {p: reference(chat_tiny_target, chat_ids(chat_tiny_target, p))[0] for p in prompts}
    text_want = {p: reference(chat_tiny_target, text_ids(chat_tiny_target, p))[0] for p in prompts}
    before = raw(server, "GET", "/metrics")[1]

    def one_client(i: int) -> int:
        c, checked = client(server), 0
        for j in range(3):
            p, kind = prompts[(i + j) % 3], (i + j) % 3
            msgs = [{"role": "user", "content": p}]
            if kind == 0:
                r = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
                assert r.choices[0].message.content == chat_want[p]
                checked += 1
            elif kind == 1:
                chunks = c.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True)
                assert "".join(ch.choices[0].text for ch in chunks) == text_want[p]
                checked += 1
            else:
                chunks = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0,
                                                   stream=True)
                next(iter(chunks))
                chunks.close()  # leave mid-stream
        return checked

    with ThreadPoolExecutor(6) as pool:
        assert sum(pool.map(one_client, range(6))) == 12
    after = raw(server, "GET", "/metrics")[1]
    assert five_xx(after) == 0
    assert metric(after, "eaglewire_requests_total") - metric(before, "eaglewire_requests_total") >= 18
    assert metric(after, "eaglewire_queue_depth") == 0
    r = client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "alpha"}],
                                               max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].message.content == chat_want["alpha"]


def test_load_8_clients_x_5_requests_all_complete(server, chat_tiny_target):
    """As measured on the real target (8 x 5: 40/40, no 5xx), on the tiny one."""
    prompts = ["one", "two three", "four", "five six seven"]
    want = {p: reference(chat_tiny_target, chat_ids(chat_tiny_target, p), max_tokens=4)[0] for p in prompts}
    before = raw(server, "GET", "/metrics")[1]

    def one_client(i: int) -> int:
        c, done = client(server), 0
        for j in range(5):
            p = prompts[(i + j) % len(prompts)]
            kw = dict(model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=4, temperature=0)
            if j % 2:
                text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True))
            else:
                text = c.chat.completions.create(**kw).choices[0].message.content
            assert text == want[p]
            done += 1
        return done

    with ThreadPoolExecutor(8) as pool:
        assert sum(pool.map(one_client, range(8))) == 40
    after = raw(server, "GET", "/metrics")[1]
    assert five_xx(after) == 0
    ok = {"path": CHAT, "status": "200"}
    assert metric(after, "eaglewire_requests_total", **ok) - metric(before, "eaglewire_requests_total", **ok) == 40


def test_metrics_in_prometheus_text(server):
    client(server).completions.create(model=MODEL, prompt="count", max_tokens=MAX_TOKENS, temperature=0)
    raw(server, "POST", CHAT, {**GOOD, "n": 2})
    status, text = raw(server, "GET", "/metrics")
    assert status == 200
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert (kinds["eaglewire_requests"], kinds["eaglewire_accept_length"], kinds["eaglewire_queue_depth"]) == (
        "counter", "histogram", "gauge")
    for name in ["eaglewire_requests_total", "eaglewire_generated_tokens_total", "eaglewire_prompt_tokens_total",
                 "eaglewire_accept_length_bucket", "eaglewire_accept_length_count", "eaglewire_position_acceptance",
                 "eaglewire_tokens_per_second", "eaglewire_queue_depth", "eaglewire_requests_running",
                 "eaglewire_requests_cancelled_total"]:
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert 'path="/v1/completions",status="200"' in text and 'path="/v1/chat/completions",status="400"' in text
    assert metric(text, "eaglewire_generated_tokens_total") >= MAX_TOKENS
    assert 'eaglewire_position_acceptance{position="3"}' in text  # num_steps 3
    assert metric(text, "eaglewire_accept_length_count") > 0


# -- API key, a full queue, clients that leave, shutdown -------------------------

KEY = {"Authorization": "Bearer sekret"}


def test_api_key(slow_server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(slow_server, "wrong").models.list()
    assert e.value.code == "invalid_api_key"
    status, reply = raw(slow_server, "POST", CHAT, b"not json")
    assert status == 401 and "no API key" in reply["error"]["message"]
    assert [m.id for m in client(slow_server, "sekret").models.list().data] == [MODEL]
    assert raw(slow_server, "GET", "/health")[0] == 200  # probes need no key
    assert raw(slow_server, "GET", "/v1/models", headers={"Authorization": "bearer sekret"})[0] == 200  # any case
    status, reply = raw(slow_server, "GET", "/v1/models", headers={"Authorization": "Basic sekret"})
    assert status == 401 and "'Basic'" in reply["error"]["message"]
    assert raw(slow_server, "GET", "/metrics")[0] == 401  # counts of the server's use are the key holder's
    assert raw(slow_server, "GET", "/metrics", headers=KEY)[0] == 200


def test_metrics_public_opts_metrics_out_of_the_key(chat_tiny_target):
    app = create_app(SpecDecoder(chat_tiny_target), model_name=MODEL, api_key="sekret", metrics_public=True)
    with live_server(app) as (url, _):
        assert raw(url, "GET", "/metrics")[0] == 200
        assert raw(url, "GET", "/v1/models")[0] == 401


def test_full_queue_is_429_then_serving_resumes(slow_server):
    c = client(slow_server, "sekret")
    busy = c.completions.create(model=MODEL, prompt="slow", max_tokens=6, temperature=0, stream=True)
    chunks = iter(busy)
    next(chunks)  # admitted and decoding: the one slot is taken
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=MODEL, prompt="next", max_tokens=1)
    assert e.value.code == "queue_full" and "--max-queue 1" in e.value.message
    assert int(e.value.response.headers["retry-after"]) >= 1
    list(chunks)
    assert c.completions.create(model=MODEL, prompt="next", max_tokens=1).usage.completion_tokens == 1


def leave_streaming(url: str) -> None:
    stream = client(url, "sekret").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "long"}], max_tokens=16, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)  # the role chunk, then text: decoding has begun (16 rounds ~ 3.2 s)
    stream.close()


def leave_waiting(url: str) -> None:
    """Hang up on a non-streamed request while it is being decoded."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "long", "max_tokens": 16}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer sekret\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head + body)
        deadline = time.monotonic() + 5
        while metric(raw(url, "GET", "/metrics", headers=KEY)[1], "eaglewire_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)


@pytest.mark.parametrize("leave", [leave_streaming, leave_waiting])
def test_a_client_that_leaves_frees_its_slot_at_once(slow_server, leave):
    c = client(slow_server, "sekret")
    cancelled = metric(raw(slow_server, "GET", "/metrics", headers=KEY)[1], "eaglewire_requests_cancelled_total")
    leave(slow_server)
    left = time.monotonic()
    while True:
        try:
            c.completions.create(model=MODEL, prompt="next", max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.monotonic() - left < 1.5, "the slot was not freed"
            time.sleep(0.05)
    assert time.monotonic() - left < 2.0, "the engine kept decoding for a client that left"
    metrics = raw(slow_server, "GET", "/metrics", headers=KEY)[1]
    assert metric(metrics, "eaglewire_requests_cancelled_total") == cancelled + 1


def test_shutdown_lets_in_flight_requests_finish(chat_tiny_target):
    app = slow_app(chat_tiny_target, max_queue=2)
    results: list = []
    with live_server(app) as (url, server):
        c = client(url)
        stream = iter(c.completions.create(model=MODEL, prompt="a", max_tokens=4, temperature=0, stream=True))
        first = next(stream)
        waiting = threading.Thread(target=lambda: results.append(
            c.completions.create(model=MODEL, prompt="b", max_tokens=2, temperature=0)))
        waiting.start()
        deadline = time.monotonic() + 5
        while metric(raw(url, "GET", "/metrics")[1], "eaglewire_queue_depth") < 1:  # queued behind the first
            assert time.monotonic() < deadline
            time.sleep(0.02)
        server.should_exit = True
        text = first.choices[0].text + "".join(ch.choices[0].text for ch in stream)
        waiting.join(10)
    assert results and results[0].usage.completion_tokens == 2
    assert text == reference(chat_tiny_target, text_ids(chat_tiny_target, "a"), max_tokens=4)[0]
    with pytest.raises(openai.APIConnectionError):
        c.models.list()


def test_shutdown_past_the_grace_period_ends_streams_with_an_error_and_done(chat_tiny_target):
    app = slow_app(chat_tiny_target)
    logged: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = logged.append
    body = {"model": MODEL, "prompt": "a", "max_tokens": 16, "stream": True}
    uvicorn_log = logging.getLogger("uvicorn.error")
    try:
        with live_server(app, graceful=0.3) as (url, server):
            uvicorn_log.addHandler(handler)  # after uvicorn configured its logging
            host, port = url.removeprefix("http://").split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", COMPLETIONS, body=json.dumps(body), headers={"Content-Type": "application/json"})
            lines = (line.decode().strip() for line in iter(conn.getresponse().readline, b""))
            events = [next(line for line in lines if line)]  # 16 rounds would take ~3.2 s
            stopped = time.monotonic()
            server.should_exit = True
            events += [line for line in lines if line]
            conn.close()
    finally:
        uvicorn_log.removeHandler(handler)
    assert time.monotonic() - stopped < 2.0
    assert events[-1] == "data: [DONE]", events
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "shutting_down" and "--graceful-timeout" in error["message"], error
    assert not logged, [r.getMessage() for r in logged]  # no cancelled task, no ASGI traceback


def test_serve_app_decodes_on_the_calling_thread_and_stops_on_ctrl_c(chat_tiny_target):
    """What ``eaglewire serve`` runs: the engine stays on the thread that loaded the models (a
    second thread gets a second OpenMP pool and slow small GEMMs: serve_app says why), HTTP runs
    beside it, and SIGINT shuts both down and gives the signal back."""
    engine_threads: list[int] = []

    app = create_app(SpecDecoder(chat_tiny_target), model_name=MODEL, engine_thread=False)
    engine = app.state.worker.engine
    add = engine.add

    def recording_add(*args, **kwargs):
        engine_threads.append(threading.get_ident())
        return add(*args, **kwargs)

    engine.add = recording_add
    server, sock, url = loopback_server(app)
    texts: list[str] = []
    heard_ctrl_c: list[bool] = []

    def ask_then_ctrl_c() -> None:
        try:
            wait_started(server)
            texts.append(client(url).completions.create(model=MODEL, prompt="a", max_tokens=3,
                                                        temperature=0).choices[0].text)
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 5
            while not server.should_exit and time.monotonic() < deadline:
                time.sleep(0.02)
            heard_ctrl_c.append(server.should_exit)
        finally:  # whatever failed above, do not leave serve_app running
            server.should_exit = True

    default_handler = signal.getsignal(signal.SIGINT)
    asker = threading.Thread(target=ask_then_ctrl_c, daemon=True)
    asker.start()
    assert serve_app(server, sockets=[sock])
    asker.join(10)
    assert texts == [reference(chat_tiny_target, text_ids(chat_tiny_target, "a"), max_tokens=3)[0]]
    assert heard_ctrl_c == [True], "SIGINT did not start the shutdown"
    assert server.interrupted and exit_status(server, True) == 130  # as every command on Ctrl-C
    assert engine_threads == [threading.get_ident()]
    assert signal.getsignal(signal.SIGINT) is default_handler
    assert app.state.worker.closing


# -- the command -----------------------------------------------------------------

def test_serve_flags_default_to_spec_config_and_are_checked():
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    from eaglewire.core.configs import config_from_args

    config = config_from_args(ServeConfig, parser.parse_args(["--target", "smollm2-135m"]))
    assert config.spec == SpecConfig()
    assert (config.host, config.port, config.max_queue, config.api_key) == ("127.0.0.1", 8000, 64, None)
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        config_from_args(ServeConfig, parser.parse_args(["--target", "x", "--speculative-eagle-topk", "1"]))
    with pytest.raises(ValueError, match="--max-queue"):
        ServeConfig(target="x", max_queue=0)
    assert config.max_request_bytes >= 1 << 20
    limited = config_from_args(ServeConfig, parser.parse_args(["--target", "x", "--max-request-bytes", "5000"]))
    assert limited.max_request_bytes == 5000
    with pytest.raises(ValueError, match="--max-request-bytes"):
        ServeConfig(target="x", max_request_bytes=0)
    assert config.request_timeout > 0 and not config.metrics_public
    timed = config_from_args(ServeConfig, parser.parse_args(["--target", "x", "--request-timeout", "5",
                                                              "--metrics-public"]))
    assert (timed.request_timeout, timed.metrics_public) == (5.0, True)
    with pytest.raises(ValueError, match="--request-timeout"):
        ServeConfig(target="x", request_timeout=0)
    assert exit_status(Server(uvicorn.Config(None)), True) == 0  # SIGTERM: a clean stop
    assert exit_status(Server(uvicorn.Config(None)), False) == 1


def test_logprobs_are_refused_by_both_request_models():
    from pydantic import ValidationError

    from eaglewire.serve.request_bodies import ChatCompletionRequest, CompletionRequest

    with pytest.raises(ValidationError, match="logprobs are not supported"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True)
    with pytest.raises(ValidationError, match="logprobs are not supported"):
        CompletionRequest(model="m", prompt="x", logprobs=2)


# -- speculative acceptance as vLLM reports it (doctor --engine-url reads it) ------

def test_per_request_spec_metrics_and_counters_agree_and_ids_are_greedys(chat_tiny_target):
    """With --per-request-spec-decode-metrics each whole answer carries vLLM's
    metrics.speculative_decoding; /metrics' vLLM-named counters grow by exactly those figures;
    return_token_ids gives plain greedy's ids."""
    from eaglewire.engines.serving.spec_decode_metrics import spec_counters

    draft, contract = random_draft(chat_tiny_target)
    decoder = SpecDecoder(chat_tiny_target, draft, contract, SpecConfig.chain(3))
    ids = text_ids(chat_tiny_target, "count to ten")
    greedy, _ = SpecDecoder(chat_tiny_target).generate(ids, max_new_tokens=MAX_TOKENS,
                                                       stop_token_ids=set(stop_token_ids(chat_tiny_target.tokenizer,
                                                                                         chat_tiny_target.model)))
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    with live_server(create_app(decoder, model_name=MODEL, per_request_metrics="detailed")) as (url, _):
        before = spec_counters(raw(url, "GET", "/metrics")[1], "eaglewire_")
        status, answer = raw(url, "POST", COMPLETIONS, body)
        after = spec_counters(raw(url, "GET", "/metrics")[1], "eaglewire_")
        plain = raw(url, "POST", COMPLETIONS, {"prompt": ids, "max_tokens": 2, "temperature": 0})[1]
    assert status == 200 and answer["choices"][0]["token_ids"] == greedy
    spec = answer["metrics"]["speculative_decoding"]
    assert spec["num_spec_tokens"] == 3 and len(spec["acceptance_histogram"]) == 4
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"]) == len(spec["per_step_accepted"]) > 0
    assert spec["num_draft_tokens"] == 3 * spec["num_spec_steps"]  # a chain of 3 drafts 3 every step
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"])
    assert before == {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": [0, 0, 0]}
    assert after["drafts"] == spec["num_spec_steps"] and after["draft_tokens"] == spec["num_draft_tokens"]
    assert after["accepted"] == spec["num_accepted_draft_tokens"] == sum(after["per_pos"])
    assert "token_ids" not in plain["choices"][0]  # only when asked, as vLLM


def test_no_per_request_metrics_unless_asked_and_none_without_a_draft(server, chat_tiny_target):
    _, answer = raw(server, "POST", COMPLETIONS, {"prompt": "count", "max_tokens": 2, "temperature": 0})
    assert "metrics" not in answer
    with live_server(create_app(SpecDecoder(chat_tiny_target), model_name=MODEL,
                                per_request_metrics="summary")) as (url, _):
        _, answer = raw(url, "POST", COMPLETIONS, {"prompt": "count", "max_tokens": 2, "temperature": 0})
        text = raw(url, "GET", "/metrics")[1]
    assert "metrics" not in answer and "spec_decode" not in text  # plain decoding: as vLLM without speculation
    with pytest.raises(ValueError, match="per_request_metrics"):
        create_app(SpecDecoder(chat_tiny_target), model_name=MODEL, per_request_metrics="all")


# -- continuous batching ---------------------------------------------------------

def test_concurrent_requests_decode_in_one_batch(chat_tiny_target):
    """4 clients at once share the engine's steps (one after another, 4 x 5 steps; together, about 5 plus the
    steps before the last one joined), each still gets its greedy answer, and /metrics says how many the last step
    advanced and whether it drafted."""
    prompts = ["one", "two three", "four", "five six seven"]
    want = {p: reference(chat_tiny_target, text_ids(chat_tiny_target, p), max_tokens=6)[0] for p in prompts}
    with live_server(slow_app(chat_tiny_target)) as (url, _):
        def ask(p: str) -> str:
            return client(url).completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, prompts)) == [want[p] for p in prompts]
        text = raw(url, "GET", "/metrics")[1]
    steps = metric(text, "eaglewire_decode_steps_total", kind="plain")
    assert 5 <= steps <= 12, steps  # 20 if they had run one at a time
    assert metric(text, "eaglewire_decode_steps_total", kind="speculative") == 0
    assert metric(text, "eaglewire_speculating") == 0 and metric(text, "eaglewire_batch_size") == 0  # idle now


def test_serve_refuses_a_schedule_measured_elsewhere(tmp_path):
    from dataclasses import replace

    from eaglewire.concurrency.schedule import Schedule, ScheduleRange, schedule_key
    from eaglewire.decode.load import load_decode_target
    from eaglewire.serve.app import serve
    from tiny import save_random_draft, save_tiny_dir

    target_dir = save_tiny_dir(tmp_path / "target")
    target = load_decode_target(str(target_dir))
    draft_dir = save_random_draft(tmp_path / "draft", target)
    key = schedule_key(target, draft_dir)
    Schedule([ScheduleRange(2, SpecConfig.chain(3)), ScheduleRange(3, None)],
             replace(key, device="NVIDIA H200")).save(tmp_path / "schedule.json")
    with pytest.raises(ValueError, match=r"device: 'NVIDIA H200' != .*run `eaglewire tune --concurrency"):
        serve(ServeConfig(target=str(target_dir), draft=str(draft_dir), schedule=str(tmp_path / "schedule.json")))
