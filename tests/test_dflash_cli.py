"""A DFlash draft directory through ``eaglewire generate``, ``serve`` and ``bench`` on a tiny target: the same
text as plain decoding, the family in bench's rows, what needs an EAGLE-3 draft refused in words,
and llama-server launched with a DFlash GGUF as draft-dflash."""

import json

import pytest
import torch
from openai import OpenAI

from eaglewire.cli import main
from eaglewire.core.tokens import stop_token_ids
from eaglewire.decode.dflash_drafter import DFlashDrafter
from eaglewire.decode.text import encode_prompt
from eaglewire.decode.spec_decoder import SpecConfig, SpecDecoder
from eaglewire.decode.load import load_decoder
from eaglewire.serve.routes import create_app
from servers import live_server
from tiny import save_random_dflash_draft

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory, chat_tiny_target):
    return save_random_dflash_draft(tmp_path_factory.mktemp("dflash"), chat_tiny_target, block_size=4)


def test_generate_with_a_dflash_draft_prints_the_plain_text(target_dir, dflash_dir, capsys):
    common = ["generate", "--target", str(target_dir), "--prompt", "Count to 5.", "--chat", "--max-new-tokens", "10",
              "--device", "cpu"]
    assert main(common) == 0
    plain = capsys.readouterr()
    for shape in (["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"],
                  ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5"]):
        assert main(common + ["--draft", str(dflash_dir), *shape]) == 0
        spec = capsys.readouterr()
        assert spec.out == plain.out and "10 tokens in" in spec.err
        verified = float(spec.err.split("(")[1].split(" tokens verified")[0])
        assert verified == int(shape[-1])  # every round verifies the shape's tokens
    assert main(common + ["--draft", str(dflash_dir)]) == 2  # the default 5 steps: more than a block of 4 drafts
    err = capsys.readouterr().err
    assert "--speculative-num-steps 5" in err and "block size 4" in err and "--speculative-num-steps 3 or lower" in err


def test_serve_with_a_dflash_draft_answers_as_plain(target_dir, dflash_dir, chat_tiny_target):
    decoder = load_decoder(str(target_dir), str(dflash_dir), SpecConfig.chain(3), device="cpu")
    assert isinstance(decoder.drafter, DFlashDrafter)
    messages = [{"role": "user", "content": "Name three colours."}]
    tok = decoder.target.tokenizer
    ids = encode_prompt(tok, messages, chat=True)
    want, _ = SpecDecoder(chat_tiny_target).generate(ids, max_new_tokens=12,
                                                     stop_token_ids=set(stop_token_ids(tok, chat_tiny_target.model)))
    with live_server(create_app(decoder, model_name="tiny")) as (url, _):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == tok.decode(want, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(want)


def write_prompts(path, n):
    path.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i + 3}.", "chat": True})
                               for i in range(n)))
    return path


def test_bench_with_a_dflash_draft(tmp_path, target_dir, dflash_dir, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    common = ["bench", "--target", str(target_dir), "--draft", str(dflash_dir), "--dataset", str(prompts),
              "--max-new-tokens", "10", "--warmup", "0", "--device", "cpu", "--no-progress"]
    out = tmp_path / "report"
    assert main(common + ["--configs", "1,0,0,0;1,3,1,4;1,2,2,5", "--out", str(out)]) == 0
    capsys.readouterr()
    rows = {r["name"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert rows["1,0,0,0"]["method"] == "plain"
    for name, steps in (("1,3,1,4", 3), ("1,2,2,5", 2)):
        assert rows[name]["method"] == "dflash" and rows[name]["same_output_as_plain"] == 2
        assert len(rows[name]["position_acceptance"]) == steps and rows[name]["speedup"] is not None
    assert rows["1,3,1,4"]["verified_per_pass"] == 4.0

    refused = {"1,0,0,0;1,5,1,6": ["config 1,5,1,6", "block size 4", "3 or lower"],
               "recommended": ["--configs recommended", "dflash draft", "--configs '1,0,0,0;1,7,1,8'"]}
    for configs, words in refused.items():
        assert main(common + ["--configs", configs, "--out", str(tmp_path / "r2")]) == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err


def test_bench_launches_llama_server_with_a_dflash_gguf_as_draft_dflash(tmp_path):
    """bench --engine llamacpp on a DFlash draft: its chains run as llama.cpp's draft-dflash (a block of
    n_max + 1), an EAGLE-3 draft's as draft-eagle3, plain without a draft."""
    from eaglewire.bench.bench_command import parse_config, shape_of
    from eaglewire.engines.interface import RunSettings, ServedFiles
    from eaglewire.engines.llamacpp.runtime import launch_config
    from eaglewire.engines.llamacpp.server import server_args

    def args(run, family):
        files = ServedFiles(tmp_path / "t.gguf", tmp_path / "d.gguf", family)
        return server_args(launch_config(files, shape_of(run), RunSettings(threads=2)), port=1)

    chain = args(parse_config("1,3,1,4"), "dflash")
    assert chain[chain.index("--spec-type") + 1] == "draft-dflash" and chain[chain.index("--spec-draft-n-max") + 1] == "3"
    eagle = args(parse_config("1,3,1,4"), "eagle3")
    assert eagle[eagle.index("--spec-type") + 1] == "draft-eagle3"
    assert "--spec-type" not in args(None, "dflash") and "-md" not in args(None, "dflash")
