"""Every command on a CUDA device, end to end on a tiny chat target: prepare (capture, in-process regeneration,
--head-only from an engine's host states), train (EAGLE-3, and DFlash with its decoding and doctor), the doctor (conversations, --data, --stored, users' traffic, a temperature, --engine-url against the
served draft), generate, bench, tune, serve, export, the quickstart.

Two devices run the same test: a real GPU where torch sees one (marker ``cuda``: ``pytest -m cuda`` on a GPU
machine), and everywhere else the CPU's stand-in for one (``fake_cuda.py``), which tags every tensor with the
device CUDA would have put it on and raises CUDA's own errors where an op mixes devices: the two crashes of the
first GPU run (train's vocabulary coverage, the doctor's batches) fail it on the CPU. Its CUDA graphs capture and
replay (a host read inside a capture raises), so the steps run the graph path they run on a GPU. The CPU path
itself is what the rest of the suite runs.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from eaglewire.cli import main
from fake_cuda import fake_cuda

DEVICES = [pytest.param("fake", id="fake-cuda"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device: the fake-cuda run covers placement")])]


@pytest.fixture(params=DEVICES)
def on_device(request):
    """A context that runs its body on the device (the fake one patches torch while it lasts)."""
    return (lambda: fake_cuda(graphs=True)) if request.param == "fake" else contextlib.nullcontext


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama with SmolLM2's tokenizer and chat template saved as a --target, conversations, prompts."""
    from tiny import tiny_target

    root = tmp_path_factory.mktemp("devices")
    target = tiny_target("llama", vocab_size=len(smollm2_tokenizer), tokenizer=smollm2_tokenizer, num_layers=8,
                         hidden_size=64, initializer_range=0.2)
    target.model.save_pretrained(root / "target")
    smollm2_tokenizer.save_pretrained(root / "target")
    chats = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Count to {i + 2}."},
                                                {"from": "gpt", "value": " ".join(map(str, range(i + 4)))}]}
             for i in range(10)]
    (root / "chats.json").write_text(json.dumps(chats))
    asks = [{"messages": [{"role": "user", "content": f"Tell me about {x}."}]} for x in ("cats", "rain")]
    (root / "traffic.jsonl").write_text("\n".join(map(json.dumps, asks)))
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i + 3}.",
                                                              "chat": True}) for i in range(2)))
    return root


def run(*argv: str) -> int:
    return main([str(a) for a in argv])


def decode_on_device(w, out, bench_configs: str, capsys) -> dict[str, dict]:
    """With the draft at ``out / "draft"``, on the device: greedy ``generate`` prints plain decoding's text, and
    ``bench`` runs ``bench_configs`` -> its rows by name."""
    target, cuda = ["--target", w / "target"], ["--device", "cuda"]
    capsys.readouterr()
    common = ["generate", *target, *cuda, "--dtype", "fp32", "--prompt", "Count to 5.", "--chat", "--max-new-tokens", 8]
    assert run(*common) == 0
    plain = capsys.readouterr().out
    assert run(*common, "--draft", out / "draft", "--speculative-num-steps", 3, "--speculative-eagle-topk", 1,
               "--speculative-num-draft-tokens", 4) == 0
    assert capsys.readouterr().out == plain
    assert run("bench", *target, *cuda, "--draft", out / "draft", "--dataset", w / "prompts.jsonl", "--max-new-tokens",
               8, "--warmup", 0, "--configs", bench_configs, "--out", out / "bench", "--no-progress") == 0
    return {r["name"]: r for r in json.loads((out / "bench" / "bench.json").read_text())["rows"]}


def test_every_command_runs_on_cuda(tmp_path, workspace, on_device, capsys):
    w, out = workspace, tmp_path
    target = ["--target", w / "target"]
    cuda = ["--device", "cuda"]
    with on_device():
        # prepare: capture on the device, then with replies regenerated in process
        assert run("prepare", *target, *cuda, "--data", w / "chats.json", "--out", out / "shards", "--max-length", 64,
                   "--batch-tokens", 256, "--no-progress") == 0
        status = json.loads((out / "shards" / "manifest.json").read_text())["status"]
        assert status["capture_precision"]["device"] == "cuda", status
        assert run("prepare", *target, *cuda, "--data", w / "chats.json", "--out", out / "regenerated",
                   "--regenerate", "--num-conversations", 3, "--max-new-tokens", 8, "--max-length", 64,
                   "--no-progress") == 0

        # train on the device (the first GPU run crashed here), resumable state and all
        assert run("train", *target, *cuda, "--data", out / "shards", "--out", out / "draft", "--ttt-steps", 2,
                   "--draft-vocab-size", 128, "--max-steps", 2, "--batch-tokens", 256, "--val-sequences", 2,
                   "--no-progress") == 0
        assert "acc 0 (held-out)" in capsys.readouterr().out

        # the doctor in its three ways of getting states (the first GPU run crashed on a fresh capture), with users'
        # traffic and a sampling temperature on the first
        doctor = ["doctor", "--draft", out / "draft", *target, *cuda, "--engine-prompts", 1, "--engine-tokens", 8,
                  "--min-tokens", 50, "--skip-label-check", "--include-training", "--num-sequences", 4, "--steps", 2,
                  "--no-tune"]
        traffic = ["--traffic", w / "traffic.jsonl", "--traffic-prompts", 2, "--traffic-tokens", 8,
                   "--temperature", 0.7]
        for extra in (["--conversations", w / "chats.json", *traffic], ["--data", out / "shards"],
                      ["--data", out / "shards", "--stored"]):
            code = run(*doctor, *extra, "--json", out / "doctor.json")
            report = json.loads((out / "doctor.json").read_text())
            assert code in (0, 1, 3) and report["checks"], (extra, capsys.readouterr())  # a verdict, not a crash
            assert "acc@0" in report["accuracy"] and "judged tokens" in report["facts"], extra  # it measured

        # decoding: generate (greedy speculative == plain on the device), bench, tune
        rows = decode_on_device(w, out, "1,0,0,0;1,2,1,3", capsys)
        assert rows["1,2,1,3"]["same_output_as_plain"] is not None
        assert run("tune", *target, *cuda, "--draft", out / "draft", "--dataset", w / "prompts.jsonl", "--offset", 0,
                   "--num-prompts", 1, "--max-new-tokens", 8, "--max-steps", 2, "--out", out / "tune.json") == 0
        assert json.loads((out / "tune.json").read_text())["ranked"]

    # serve: two chat completions on the device (its decoding thread runs under the same device)
    with on_device():
        from openai import OpenAI

        from eaglewire.decode.spec_config import SpecConfig
        from eaglewire.decode.load import load_decoder
        from eaglewire.serve.routes import create_app
        from servers import live_server

        decoder = load_decoder(str(w / "target"), str(out / "draft"), SpecConfig.chain(2), device="cuda")
        assert decoder.target.device.type == "cuda"
        with live_server(create_app(decoder, model_name="tiny")) as (url, _):
            client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            for words in ("Name three colours.", "Count to 4."):
                r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words}],
                                                   max_tokens=6, temperature=0)
                assert r.usage.completion_tokens > 0
            # the doctor against the running server: its served acceptance read, on the device
            code = run("doctor", "--draft", out / "draft", *target, *cuda, "--conversations", w / "chats.json",
                       "--engine", "eaglewire", "--engine-url", url, "--engine-prompts", 1, "--engine-tokens", 8,
                       "--min-tokens", 50, "--skip-label-check", "--num-sequences", 4, "--no-tune",
                       "--json", out / "doctor-served.json")
            report = json.loads((out / "doctor-served.json").read_text())
            assert code in (0, 1, 3) and "served acceptance" in {c["name"] for c in report["checks"]}, report

    # the quickstart, every stage on the device (regeneration, capture, training, the doctor, bench, tune)
    with on_device():
        assert run("quickstart", *target, *cuda, "--data", w / "chats.json", "--num-conversations", 5,
                   "--heldout-conversations", 3, "--max-length", 64, "--max-new-tokens", 6, "--minutes", 0.03,
                   "--draft-vocab-size", 128, "--ttt-steps", 2, "--bench-dataset", w / "prompts.jsonl",
                   "--bench-prompts", 1, "--tune-prompts", 1, "--bench-tokens", 4, "--bench-configs",
                   "1,0,0,0;1,2,1,3", "--out", out / "quickstart") in (0, 1)  # 1: the doctor's verdict on a toy draft
        assert (out / "quickstart" / "summary.md").is_file()

    # export reads a draft trained on the device as any other (device-agnostic files)
    assert run("export", "--draft", out / "draft", "--to", "vllm", "--out", out / "vllm") == 0
    assert (out / "vllm" / "config.json").exists()


class _EngineOnTheHost:
    """An engine's capture as ``prepare --capture vllm`` reads it: every boundary asked for, as host tensors (an
    engine hands its states through files), computed by the whole target loaded in this process on the CPU."""

    def __init__(self, target, boundaries):
        self.target, self.boundaries, self.version = target, boundaries, "fake 1.0"

    def states(self, ids):
        from eaglewire.data.engine_capture import states_here

        here = states_here(self.target, ids)
        return torch.stack([here[b] for b in self.boundaries], dim=1).cpu()  # [T, n, H] on the host


def test_prepare_head_only_checks_an_engines_host_states_on_the_device(tmp_path, workspace, on_device, monkeypatch,
                                                                       capsys):
    """``prepare --head-only --capture ENGINE`` on the device: the engine's states arrive on the host, the head-only
    target's last layer and head run on the device (the last-layer check, then the label check), shards written.
    The label check's head-only rule (calibration) refuses a random target's honest states, as it should: it runs
    to its verdict on the device, then ``--skip-label-check`` lets the capture through."""
    from eaglewire.engines.vllm import capture as vcap
    from eaglewire.model.target import load_target

    whole = load_target(str(workspace / "target"), device="cpu", dtype=torch.float32)
    L = whole.num_layers

    @contextlib.contextmanager
    def capture(self, target, boundaries, num_layers, arch, settings, *, work_dir, url=None):
        assert L - 1 in boundaries and num_layers == L  # the head-only check's boundary L-1 was asked for
        yield _EngineOnTheHost(whole, [*boundaries, num_layers])

    monkeypatch.setattr(vcap.VllmCapturer, "capture", capture)
    prepare = ["prepare", "--target", workspace / "target", "--device", "cuda", "--dtype", "fp32", "--capture", "vllm",
               "--head-only", "--aux-boundaries", "1,4", "--data", workspace / "chats.json", "--max-length", 64,
               "--no-progress"]
    with on_device():
        assert run(*prepare, "--out", tmp_path / "judged") == 2
        assert "argmax agrees with the stored next token" in capsys.readouterr().err  # the verdict, not a crash
        assert run(*prepare, "--out", tmp_path / "shards", "--skip-label-check") == 0
    status = json.loads((tmp_path / "shards" / "manifest.json").read_text())["status"]
    assert status["capture"] == "fake 1.0" and status["capture_precision"]["device"] == "cuda", status
    check = status["capture_check"]
    assert check["sequences"] > 0 and check["max_relative_error"][str(L)] < 1e-4 and "instead" in check, check


def test_a_dflash_draft_trains_decodes_and_is_judged_on_the_device(tmp_path, workspace, on_device, capsys):
    """The other draft family on the device: ``train --family dflash`` from shards captured there, then generate
    (speculative == plain), bench and the doctor with that draft (its block pass and context on the device)."""
    w, out = workspace, tmp_path
    target, cuda = ["--target", w / "target"], ["--device", "cuda"]
    with on_device():
        assert run("prepare", *target, *cuda, "--data", w / "chats.json", "--out", out / "shards", "--max-length", 64,
                   "--batch-tokens", 256, "--no-progress") == 0
        assert run("train", *target, *cuda, "--family", "dflash", "--block-size", 4, "--data", out / "shards", "--out",
                   out / "draft", "--max-steps", 2, "--batch-tokens", 256, "--val-sequences", 2, "--no-progress") == 0
        decode_on_device(w, out, "1,0,0,0;1,3,2,4", capsys)
        code = run("doctor", "--draft", out / "draft", *target, *cuda, "--data", out / "shards", "--engine-prompts", 1,
                   "--engine-tokens", 8, "--min-tokens", 50, "--skip-label-check", "--include-training",
                   "--num-sequences", 4, "--no-tune", "--json", out / "doctor.json")
        report = json.loads((out / "doctor.json").read_text())
        assert code in (0, 1, 3) and report["checks"] and "judged tokens" in report["facts"], capsys.readouterr()
