"""import-data on the peers' captures as their own released code writes them.

Each writer is taken from the pinned release with ``ast`` and executed here, on real tensors
(nothing is installed; the GPU and the network are stubbed at the narrowest point):

- vLLM 0.33.0 (``vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py``):
  ``ExampleHiddenStatesConnector``'s scheduler and worker methods (file name, lock file, token
  ids, slot mapping, ``extract_from_kv_cache``, ``_write_tensors``) over a KV cache filled by
  ``basic_cache`` (``vllm/model_executor/models/extract_hidden_states.py``) with the states
  stacked on dim 1, as ``vllm/v1/spec_decode/extract_hidden_states.py`` does. CUDA streams and
  events are done at once, pinned memory is plain memory; the thread pool runs in place.
- speculators 0.9.0: ``prepare-data``'s ``build_speculator_training_dataset`` (its
  pre-tokenized path, ``data_generation/preprocessing.py``) then ``save_to_disk`` as
  ``cli/prepare_data.py`` does; ``generate-offline-data``'s ``_generate_and_save_hidden_states``
  with its workers (``cli/generate_offline_data.py``), its vLLM client
  (``data_generation/vllm_client.py``) and checks (``data_generation/offline.py``). Only the
  OpenAI client is a stand-in: its completions call runs the vLLM connector above.
- SpecForge: ``scripts/prepare_hidden_states.py`` is not in the released wheel (specforge 0.2.0
  ships the package only), so the file is kept verbatim in ``tests/data/peers/`` from
  github.com/sgl-project/SpecForge commit a6b6b0230009d15ec2a97a57384e6f53f0f96946 (the commit the
  0.2.0 wheel's sources match most closely; MIT, license beside it) and its git blob id is
  checked. ``HiddenStatesGenerator``'s ``_prepare_output_dirs``, ``_get_file_path`` and
  ``_save_tensor_sync`` write the files; the record comes from the wheel's
  ``OfflineCaptureLayout.materialize`` with the eagle3 provider's layout.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import fcntl
import functools
import gzip
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, Mapping

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eaglewire.data.import_data import ImportDataConfig, import_data
from eaglewire.data.shards import ShardDataset
from eaglewire.model.target import load_target
from tiny import save_tiny_dir

datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.engines

L, H, AUX = 8, 64, (2, 4, 5)
STORED = [*AUX, L]  # vLLM / speculators: the aux layers, the verifier's last state last
ROOT = Path(__file__).resolve().parents[1]
SPECFORGE_SCRIPT = ROOT / "data" / "peers" / "specforge_prepare_hidden_states.py"
SPECFORGE_BLOB = "838a462117c3fa4c36412d47b8ee49468f10c638"  # scripts/prepare_hidden_states.py at a6b6b023
log = logging.getLogger(__name__)


def _engine_wheels():
    spec = importlib.util.spec_from_file_location("_eaglewire_engine_wheels", ROOT / "engines" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wheels():
    return _engine_wheels().peer_wheels()


def take(source: str, names: list[str], ns: dict[str, Any], where: str) -> dict[str, Any]:
    """Execute the named top-level definitions (``Class.method`` for one method, as a function)
    of ``source`` in ``ns``; a staticmethod loses its decorator."""
    tree = ast.parse(source)
    top = {n.targets[0].id if isinstance(n, ast.Assign) else getattr(n, "name", None): n for n in tree.body
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
           or (isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name))}
    picked = []
    for name in names:
        owner, _, method = name.partition(".")
        node = top.get(owner)
        if node is not None and method:
            node = next((m for m in node.body if getattr(m, "name", None) == method), None)
            if node is not None:
                node.decorator_list = [d for d in node.decorator_list
                                       if not (isinstance(d, ast.Name) and d.id == "staticmethod")]
        if node is None:
            pytest.fail(f"{where} has no {name}: the writer moved; re-read it and update the reader")
        picked.append(node)
    exec(compile(ast.Module(body=picked, type_ignores=[]), where, "exec"), ns)
    return ns


# ---------------------------------------------------------------- vLLM 0.33.0: the connector

VLLM_CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
VLLM_EXTRACT = "vllm/model_executor/models/extract_hidden_states.py"


class _DoneEvent:
    def record(self, stream=None): pass
    def synchronize(self): pass
    def query(self): return True


class _CpuTorch:
    """torch for the connector's CUDA code on a CPU: copies are done at once, pinned = plain memory."""

    cuda = SimpleNamespace(Event=_DoneEvent, stream=lambda s: contextlib.nullcontext(), Stream=object)

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty_like(x, **kw):
        kw.pop("pin_memory", None)
        return torch.empty_like(x, **kw)


class _InPlaceExecutor:
    def submit(self, fn, *args):
        future = Future()
        future.set_result(fn(*args))
        return future


class FakeVllm:
    """vLLM 0.33.0 serving ``extract_hidden_states`` with the example connector: the target's
    states (``states_for(token_ids)`` -> [T, n, H]) cached by ``basic_cache`` and written by the
    connector's own methods, one request at a time."""

    def __init__(self, wheel, storage: Path, states_for, block_size: int = 16, num_blocks: int = 64):
        ns: dict[str, Any] = {"torch": _CpuTorch(), "os": os, "fcntl": fcntl, "partial": functools.partial,
                              "save_file": save_file, "logger": log, "dataclass": __import__("dataclasses").dataclass,
                              "field": __import__("dataclasses").field, "KVConnectorMetadata": object,
                              "gpu_sync_allowed": contextlib.nullcontext, "Any": Any}
        self.fn = take(wheel.text(VLLM_CONNECTOR), [
            "extract_from_kv_cache", "PendingSave", "ExampleHiddenStatesConnectorMetadata",
            "ExampleHiddenStatesConnector.build_connector_meta", "ExampleHiddenStatesConnector.wait_for_save",
            "ExampleHiddenStatesConnector.request_finished", "ExampleHiddenStatesConnector.get_finished",
            "ExampleHiddenStatesConnector._submit_async_write", "ExampleHiddenStatesConnector._write_tensors",
            "ExampleHiddenStatesConnector._on_write_done"], ns, VLLM_CONNECTOR)
        take(wheel.text(VLLM_EXTRACT), ["basic_cache"], self.fn, VLLM_EXTRACT)
        self.states_for, self.block_size, self.next_block, self.requests = states_for, block_size, 1, 0
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, n, block_size, H], allocated on first use
        self.num_blocks = num_blocks
        self.me = SimpleNamespace(
            _storage_path=str(storage), allow_custom_save_path=False, use_lock=True, _is_tp_rank_zero=True,
            _pending_saves={}, _request_filenames={}, _lock_fds={}, _req_futures={}, _req_copy_events={},
            _accumulated_finished_req_ids=set(), _block_size=block_size, _executor=_InPlaceExecutor(),
            _write_tensors=self.fn["_write_tensors"], _get_copy_stream=lambda: SimpleNamespace(wait_event=id),
            has_connector_metadata=lambda: True, _get_connector_metadata=lambda: self.meta)
        self.me._on_write_done = functools.partial(self.fn["_on_write_done"], self.me)
        self.me._submit_async_write = functools.partial(self.fn["_submit_async_write"], self.me)

    def complete(self, prompt: list[int]) -> tuple[str, torch.Tensor]:
        """One completions request with max_tokens=1: (the hidden_states_path returned, the states cached)."""
        me, f = self.me, self.fn
        req_id = f"cmpl-{self.requests:08x}-0"
        self.requests += 1
        new = SimpleNamespace(req_id=req_id, sampling_params=SimpleNamespace(extra_args=None))
        self.meta = f["build_connector_meta"](me, SimpleNamespace(scheduled_new_reqs=[new]))
        f["wait_for_save"](me)  # the lock file exists, held, before the client hears the path
        states = self.states_for(prompt)  # [T, n, H]
        if self.kv_cache is None:
            self.kv_cache = torch.zeros(self.num_blocks, states.shape[1], self.block_size, states.shape[2],
                                        dtype=states.dtype)
        me._kv_cache = self.kv_cache
        blocks = -(-len(prompt) // self.block_size)
        block_ids = list(range(self.next_block, self.next_block + blocks))
        self.next_block += blocks
        slots = torch.tensor([block_ids[t // self.block_size] * self.block_size + t % self.block_size
                              for t in range(len(prompt))])  # [T]
        f["basic_cache"](states, self.kv_cache, slots)
        request = SimpleNamespace(request_id=req_id, kv_transfer_params=None, prompt_token_ids=list(prompt),
                                  all_token_ids=list(prompt) + [0])
        delay, params = f["request_finished"](me, request, block_ids)
        assert delay
        self.meta = f["build_connector_meta"](me, SimpleNamespace(scheduled_new_reqs=[]))
        f["get_finished"](me, {req_id})  # extracts from the KV cache, writes, releases the lock
        return params["hidden_states_path"], states


def target_states(prompt: list[int]) -> torch.Tensor:
    """[T, 4, H] bf16: what the target's layers AUX and L hold for ``prompt`` (seeded by it)."""
    g = torch.Generator().manual_seed(hash(tuple(prompt)) % 2**31)
    return (torch.randn(len(prompt), len(STORED), H, generator=g) * 3).to(torch.bfloat16)


def test_vllm_connector_files_import_bit_for_bit(wheels, target_dir, tmp_path):
    storage = tmp_path / "vllm-hs"
    server = FakeVllm(wheels["vllm"], storage, target_states)
    g = torch.Generator().manual_seed(1)
    written = {}
    for t in (5, 17, 33):
        path, states = server.complete(torch.randint(0, 256, (t,), generator=g).tolist())
        written[Path(path).stem] = states
    assert sorted(p.name for p in storage.iterdir()) == sorted(
        [f"{r}.safetensors" for r in written] + [f"{r}.safetensors.lock" for r in written])
    run_import("vllm", storage, tmp_path / "out", target_dir)
    back = ShardDataset(tmp_path / "out")
    assert sorted(back.sequence_ids) == sorted(written)
    for seq_id, item in zip(back.sequence_ids, back):
        assert_states_equal(item, written[seq_id])


# ---------------------------------------------------------------- speculators 0.9.0

SPEC_PRE = "speculators/data_generation/preprocessing.py"
SPEC_GEN = "speculators/cli/generate_offline_data.py"
SPEC_CLIENT = "speculators/data_generation/vllm_client.py"
SPEC_OFFLINE = "speculators/data_generation/offline.py"
SPEC_DATA = "speculators/train/data.py"


def speculators_prepare(wheel, rows: list[dict], out: Path, seq_length: int = 2048) -> None:
    """prepare-data on speculator-format rows: build_speculator_training_dataset, then save_to_disk."""
    ns = {"torch": torch, "log": log, "HFDataset": datasets.Dataset, "ProcessorLike": Any,
          "ProcessorMixin": type("ProcessorMixin", (), {}), "nullcontext": contextlib.nullcontext,
          "set_default_torch_num_threads": contextlib.nullcontext, "Literal": Literal}
    take(wheel.text(SPEC_PRE), ["_append_row", "_warn_seq_length", "_passthrough_pretokenized", "_preprocess_batch",
                                "build_speculator_training_dataset"], ns, SPEC_PRE)
    raw = datasets.Dataset.from_list(rows)
    dataset = ns["build_speculator_training_dataset"](dataset=raw, processor=object(), max_length=seq_length,
                                                      num_proc=1)
    assert "dataset.save_to_disk(output)" in wheel.text("speculators/cli/prepare_data.py")
    dataset.save_to_disk(str(out))


class _FakeOpenAI:
    """openai.AsyncOpenAI for generate-offline-data: the model list, and completions that the vLLM
    connector above answers (prompt_token_ids and kv_transfer_params, as vLLM returns them)."""

    server: FakeVllm

    def __init__(self, **kw):
        from openai.types.completion import Completion, CompletionChoice

        async def models_list():
            return SimpleNamespace(data=[SimpleNamespace(id="tiny-target")])

        async def create(*, model, prompt, max_tokens, extra_body, timeout):
            assert max_tokens == 1 and extra_body == {"return_token_ids": True}
            path, _ = self.server.complete(prompt)
            choice = CompletionChoice.model_construct(index=0, text="", finish_reason="length",
                                                      prompt_token_ids=list(prompt))
            return Completion.model_construct(id="cmpl", choices=[choice], created=0, model=model,
                                              object="text_completion", kv_transfer_params={"hidden_states_path": path})

        self.models = SimpleNamespace(list=models_list)
        self.completions = SimpleNamespace(create=create)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def speculators_generate(wheels, preprocessed: Path, output: Path | None, server: FakeVllm) -> None:
    """generate-offline-data --preprocessed-data PRE [--output OUT] --validate-outputs."""
    from openai.types.chat import ChatCompletion
    from openai.types.completion import Completion
    from tqdm import tqdm

    wheel = wheels["speculators"]
    ns: dict[str, Any] = {"torch": torch, "logger": log, "Path": Path, "safe_open": safe_open}
    take(wheel.text(SPEC_OFFLINE), ["check_hidden_states", "get_existing_hidden_state_indices",
                                    "find_corrupt_hidden_state_indices", "get_indices_to_process"], ns, SPEC_OFFLINE)
    ns.update(asyncio=asyncio, fcntl=fcntl, functools=functools, os=os, time=time, Any=Any, ClientItem=dict,
              Completion=Completion, ChatCompletion=ChatCompletion,
              openai=SimpleNamespace(AsyncClient=object, Client=object))
    take(wheel.text(SPEC_CLIENT), ["DEFAULT_REQUEST_TIMEOUT", "DEFAULT_MAX_RETRIES", "RETRY_BACKOFF_BASE",
                                   "InvalidResponseError", "_handle_retry_error", "with_retries", "extract_output",
                                   "generate_hidden_states_async", "_poll_lock_async", "wait_for_lock_async"],
         ns, SPEC_CLIENT)
    data_ns = take(wheel.text(SPEC_DATA), ["_has_multimodal_content", "build_client_item"],
                   {"ClientItem": dict, "cast": lambda t, v: v}, SPEC_DATA)
    _FakeOpenAI.server = server
    ns.update(shutil=shutil, tqdm=tqdm, load_from_disk=datasets.load_from_disk, load_file=load_file,
              build_client_item=data_ns["build_client_item"], openai=SimpleNamespace(AsyncOpenAI=_FakeOpenAI))
    take(wheel.text(SPEC_GEN), ["_MAX_CORRUPT_REPORTED", "_drop_unreadable_cached_files", "_FailureTracker",
                                "_worker", "_feed_queue", "_shutdown_workers", "_generate_and_save_hidden_states"],
         ns, SPEC_GEN)
    asyncio.run(ns["_generate_and_save_hidden_states"](
        model=None, endpoint="http://127.0.0.1:9/v1", preprocessed_data=str(preprocessed),
        output=None if output is None else str(output), max_samples=None, concurrency=2, validate_outputs=True,
        request_timeout=30, max_retries=0, fail_on_error=False, max_consecutive_errors=None, world_size=1, rank=0))


def speculator_rows(n: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(2)
    rows = []
    for i in range(n):
        t = 6 + 5 * i
        mask = (torch.arange(t) >= t // 2).long()  # the reply: the second half
        rows.append({"input_ids": torch.randint(0, 256, (t,), generator=g).tolist(), "loss_mask": mask.tolist()})
    return rows


@pytest.mark.parametrize("variant", ["default", "output", "states-dir"])
def test_speculators_default_output_imports_bit_for_bit(variant, wheels, target_dir, tmp_path):
    """import-data --from speculators <preprocessed> on speculators' own output: every stored state equal."""
    rows = speculator_rows()
    pre = tmp_path / "preprocessed"
    speculators_prepare(wheels["speculators"], rows, pre)
    server = FakeVllm(wheels["vllm"], tmp_path / "vllm-staging", target_states)
    output = tmp_path / "hs-elsewhere" if variant == "output" else None
    speculators_generate(wheels, pre, output, server)
    states_dir = output or pre / "hidden_states"
    assert sorted(p.name for p in states_dir.iterdir()) == sorted(f"hs_{i}.safetensors" for i in range(len(rows)))
    src, kw = {"default": (pre, {}), "output": (output, {"tokens": str(pre)}),
               "states-dir": (pre / "hidden_states", {})}[variant]
    run_import("speculators", src, tmp_path / "out", target_dir, **kw)
    back = ShardDataset(tmp_path / "out")
    assert back.sequence_ids == [f"hs_{i}" for i in range(len(rows))]
    for i, item in enumerate(back):
        stored = load_file(str(states_dir / f"hs_{i}.safetensors"))
        assert stored["hidden_states"].dtype == torch.bfloat16  # stored bf16, imported bf16: bit for bit
        assert torch.equal(stored["hidden_states"], target_states(rows[i]["input_ids"]))  # what vLLM cached
        assert torch.equal(item["input_ids"].long(), torch.tensor(rows[i]["input_ids"]))
        assert torch.equal(item["loss_mask"].long(), torch.tensor(rows[i]["loss_mask"]))
        assert_states_equal(item, stored["hidden_states"])


def test_speculators_output_without_rows_names_the_flag(wheels, target_dir, tmp_path):
    pre = tmp_path / "preprocessed"
    speculators_prepare(wheels["speculators"], speculator_rows(2), pre)
    out = tmp_path / "hs-elsewhere"
    speculators_generate(wheels, pre, out, FakeVllm(wheels["vllm"], tmp_path / "staging", target_states))
    from eaglewire.data.foreign import ForeignDataError

    with pytest.raises(ForeignDataError, match="pass --tokens <preprocessed-data>"):
        run_import("speculators", out, tmp_path / "o", target_dir)
    with pytest.raises(ForeignDataError, match=r"nor does .*hidden_states"):
        run_import("speculators", tmp_path, tmp_path / "o", target_dir)


# ---------------------------------------------------------------- SpecForge

SF_PROVIDERS = "specforge/algorithms/common/providers.py"
SF_EAGLE3 = "specforge/algorithms/eagle3/providers.py"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_specforge_script_is_the_cited_commits():
    assert git_blob_id(SPECFORGE_SCRIPT.read_bytes()) == SPECFORGE_BLOB


def specforge_layout(wheel):
    """The eagle3 provider's OfflineCaptureLayout, built by the wheel's own class."""
    import dataclasses
    import typing

    ns = {"dataclass": dataclasses.dataclass, "Tuple": typing.Tuple, "Any": Any, "Mapping": Mapping}
    take(wheel.text(SF_PROVIDERS), ["_non_empty", "OfflineCaptureLayout"], ns, SF_PROVIDERS)
    call = next(n for n in ast.walk(wheel.tree(SF_EAGLE3)) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "OfflineCaptureLayout")
    return ns["OfflineCaptureLayout"](**{k.arg: ast.literal_eval(k.value) for k in call.keywords})


def specforge_write(wheel, samples: list[dict], out: Path, compress: bool, group: int = 4) -> None:
    """HiddenStatesGenerator's file writing, on one sample at a time as its generate() hands it over."""
    from typing import List, Optional

    ns = {"gzip": gzip, "os": os, "torch": torch, "is_tp_rank_0": lambda: True, "Mapping": Mapping,
          "Optional": Optional, "List": List}
    take(SPECFORGE_SCRIPT.read_text(), ["HiddenStatesGenerator._save_tensor_sync",
                                        "HiddenStatesGenerator._get_file_path",
                                        "HiddenStatesGenerator._prepare_output_dirs"], ns, str(SPECFORGE_SCRIPT))
    me = SimpleNamespace(compress=compress, compression_level=6, file_group_size=group,
                         file_extension=".ckpt.gz" if compress else ".ckpt")
    layout = specforge_layout(wheel)
    ns["_prepare_output_dirs"](me, str(out), 0, len(samples))
    for idx, s in enumerate(samples):
        record = layout.materialize({"input_ids": s["input_ids"].clone(), "loss_mask": s["loss_mask"].clone(),
                                     "aux_hidden_states": s["aux"].clone().unsqueeze(0),  # [1, T, k*H]
                                     "last_hidden_states": s["last"].clone().unsqueeze(0)})  # [1, T, H]
        ns["_save_tensor_sync"](me, record, ns["_get_file_path"](me, str(out), idx))


@pytest.mark.parametrize("compress", [False, True])
def test_specforge_files_import(compress, wheels, target_dir, tmp_path):
    target = load_target(str(target_dir), device="cpu", dtype="fp32")
    g = torch.Generator().manual_seed(3)
    samples = []
    for i in range(6):
        t = 7 + 2 * i
        pre_norm = torch.randn(t, H, generator=g) * 4
        samples.append({"input_ids": torch.randint(0, 256, (t,), generator=g), "loss_mask": (torch.rand(t, generator=g)
                        > 0.3).long(), "aux": torch.randn(t, len(AUX) * H, generator=g).to(torch.bfloat16),
                        "pre_norm": pre_norm, "last": target.decoder.norm(pre_norm).to(torch.bfloat16)})
    src = tmp_path / "hidden_states"
    specforge_write(wheels["specforge"], samples, src, compress)
    suffix = ".ckpt.gz" if compress else ".ckpt"
    assert sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()) == sorted(
        f"rows_{i // 4 * 4}-{i // 4 * 4 + 4}/data_{i}{suffix}" for i in range(6))
    # SpecForge ids [1, 3, 4] are the outputs of layers 1, 3, 4: boundaries AUX
    run_import("specforge", src, tmp_path / "out", target_dir, boundaries=list(AUX))
    back = ShardDataset(tmp_path / "out")
    by_id = dict(zip(back.sequence_ids, back))
    assert sorted(by_id) == sorted(f"rows_{i // 4 * 4}-{i // 4 * 4 + 4}/data_{i}" for i in range(6))
    for i, s in enumerate(samples):
        item = by_id[f"rows_{i // 4 * 4}-{i // 4 * 4 + 4}/data_{i}"]
        assert torch.equal(item["aux_hidden"], s["aux"])  # stored bf16, imported bf16: bit for bit
        assert torch.equal(item["input_ids"].long(), s["input_ids"]) and torch.equal(item["loss_mask"].long(),
                                                                                     s["loss_mask"])
        # the post-norm state comes back through the final norm: the head's argmax is the target's
        want, got = target.head(s["pre_norm"]), target.head(item["last_hidden"].float())  # [T, V] each
        # the state took another path (norm, bf16, un-norm, norm again), so compare argmaxes where the
        # target's top two logits are not a near-tie that a rounding on another CPU's kernels could flip
        top2 = want.topk(2, -1).values  # [T, 2]
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # [T]
        assert clear.float().mean() > 0.9
        assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


# ---------------------------------------------------------------- shared

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_dir(tmp_path_factory.mktemp("target"), num_layers=L, hidden_size=H)


def run_import(layout: str, src: Path, out: Path, target_dir: Path, **kw):
    kw.setdefault("boundaries", STORED)
    # the peers' writers store whatever states they are handed: here random ones of a random target,
    # which no head predicts from; the label check has its own tests (tests/data/test_label_check.py)
    kw.setdefault("skip_label_check", True)
    return import_data(ImportDataConfig(src=str(src), layout=layout, out=str(out), target=str(target_dir), **kw))


def assert_states_equal(item: dict, stored: torch.Tensor) -> None:
    """The shard's aux and last states against the [T, n, H] stored ones, bit for bit (same dtype)."""
    t = stored.shape[0]
    assert item["aux_hidden"].dtype == stored.dtype == item["last_hidden"].dtype
    assert torch.equal(item["aux_hidden"].reshape(t, len(AUX), H), stored[:, :len(AUX)])  # [T, k, H]
    assert torch.equal(item["last_hidden"], stored[:, -1])
