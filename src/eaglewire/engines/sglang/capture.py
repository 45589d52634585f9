"""Hidden states captured by SGLang (0.5.23): its capture-only aux mode, and its final state for the labels.

SGLang 0.5.23 captures a target's aux states without a draft: ``--enable-return-aux-hidden-states
--speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids IDS`` (srt/arg_groups/validation_hook.py
``handle_aux_hidden_state_capture``: the algorithm only names the capture convention and is reset, no draft is
loaded). The ids are read as an EAGLE-3 draft's (srt/model_executor/model_runner_components/
spec_aux_hidden_state.py -> the model file's ``set_eagle3_layers_to_capture``), so ``readings.to_ids`` gives them;
they must be non-negative, so boundary 0 of a Llama-family target (id -1) cannot be asked for. A request with
``return_hidden_states: true`` is answered with ``meta_info.hidden_states``: the prompt's rows, each the
``len(ids)`` states concatenated (srt/layers/logits_processor.py ``pack_aux_hidden_states``), as JSON floats.

Boundary L (the label state) is no id: the hooks capture a layer's input, and nothing follows the last layer
(logits_processor.py ``_check_aux_hidden_states``). So a second server, ``--enable-return-hidden-states``,
answers the final state, which SGLang returns after the final norm (a Llama model file hands the logits processor
the normed state). ``states`` hands it over as it came, in slot L, and says so (``last_state``): prepare stores it
as ``import-data --last-state post-norm`` does, y / norm(1), whose norm is y again, so the target's head on it
gives SGLang's logits.

``--capture-url AUX_URL,LABEL_URL`` points at two servers the user runs with ``launch_line``'s flags.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from eaglewire.engines.interface import CaptureSettings, ServedFiles, Shape, StatesFile
from eaglewire.engines.serving.served_counts import post_json
from eaglewire.engines.serving.served_target import served_target
from eaglewire.engines.sglang.installation import SglangError, require
from eaglewire.engines.sglang.readings import NAME, to_boundaries, to_ids
from eaglewire.engines.sglang.server import DTYPE, SglangServer, served_version

log = logging.getLogger(__name__)

POST_NORM = "post-norm"  # what slot L holds (label_check.POST_NORM's spelling)
LABEL_FLAGS = ("--enable-return-hidden-states",)


def capture_ids(boundaries: Sequence[int], num_layers: int, arch: str | None) -> list[int]:
    """The ids SGLang's capture flag is sent for ``boundaries`` (boundary ``num_layers`` left out: the label server
    answers it), refused where one would be negative (the flag takes none)."""
    aux = sorted(set(boundaries) - {num_layers})
    if not aux:
        raise SglangError("SGLang captures aux boundaries beside the label state; none was asked for")
    ids = to_ids(aux, num_layers, arch)
    if any(i < 0 for i in ids):
        raise SglangError(f"boundaries {aux} are SGLang ids {ids} on this target's model file, and SGLang's "
                          "--return-aux-hidden-state-layer-ids takes no negative id (boundary 0, the embedding "
                          "output, is id -1): capture here (--capture here), or train on boundaries from 1 up")
    return ids


def capture_flags(ids: Sequence[int]) -> list[str]:
    return ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *(str(i) for i in ids)]


def request_body(token_ids: Sequence[int]) -> dict[str, Any]:
    """One prefill that returns the prompt's states (one token generated, greedy)."""
    return {"input_ids": list(token_ids), "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


def prompt_rows(meta_info: dict[str, Any], num_tokens: int, width: int, *, who: str) -> torch.Tensor:
    """[T, width] the prompt's rows of ``meta_info.hidden_states``: a list per forward (the prefill's chunks are
    lists of rows, a decode step's one row), taken in order up to the prompt's ``num_tokens``."""
    rows: list[list[float]] = []
    for part in meta_info.get("hidden_states") or []:
        if part and isinstance(part[0], list):
            rows.extend(part)
        elif part:
            rows.append(part)
    if len(rows) < num_tokens or any(len(r) != width for r in rows[:num_tokens]):
        got = f"{len(rows)} rows of {sorted({len(r) for r in rows})}" if rows else "no hidden_states"
        raise SglangError(f"the {who} answered {got}, not {num_tokens} rows of {width}: it was not launched with "
                          "the flags `eaglewire prepare --capture sglang` prints (or a prefix cache served part of "
                          "the prompt: launch it with --disable-radix-cache)")
    return torch.tensor(rows[:num_tokens], dtype=torch.float32)


def launch_command(target: Path | str, flags: Sequence[str], settings: CaptureSettings) -> list[str]:
    return ["python", "-m", "sglang.launch_server", "--model-path", str(target), "--dtype", settings.dtype,
            "--disable-radix-cache", *(["--tp-size", str(settings.tensor_parallel)]
                                       if settings.tensor_parallel > 1 else []), *flags]


def split_urls(url: str) -> tuple[str, str]:
    """``--capture-url AUX_URL,LABEL_URL`` (SGLang answers the label state from a second server)."""
    parts = [p.strip() for p in url.split(",") if p.strip()]
    if len(parts) != 2:
        raise SglangError(f"--capture-url {url!r}: SGLang captures through two servers, so give "
                          "AUX_URL,LABEL_URL (the two launch lines `eaglewire prepare --capture sglang` prints)")
    return parts[0], parts[1]


@dataclass
class SglangCapturedStates:
    """SGLang at ``aux_url`` (aux states) and ``label_url`` (the final state): the engine interface's
    ``CapturedStates``; slot L holds the post-norm final state (``last_state``)."""

    aux_url: str
    label_url: str
    version: str
    boundaries: list[int]  # the aux slots in id order, then boundary L
    hidden_size: int
    last_state: str = POST_NORM
    timeout: float = 600.0

    @property
    def url(self) -> str:  # regeneration goes to the aux server: a plain target
        return self.aux_url

    def _rows(self, url: str, token_ids: list[int], width: int, who: str) -> torch.Tensor:
        answer = post_json(url.rstrip("/") + "/generate", request_body(token_ids), timeout=self.timeout,
                           who=who, error=SglangError, hint="; pass the servers' base URLs as --capture-url")
        return prompt_rows(answer.get("meta_info") or {}, len(token_ids), width, who=f"{who} at {url}")

    def states(self, token_ids: list[int]) -> torch.Tensor:
        H, k = self.hidden_size, len(self.boundaries) - 1
        aux = self._rows(self.aux_url, token_ids, k * H, "SGLang aux server").view(len(token_ids), k, H)  # [T, kH] -> [T, k, H]
        last = self._rows(self.label_url, token_ids, H, "SGLang label server")  # [T, H], after the final norm
        return torch.cat([aux, last[:, None]], dim=1)  # [T, k + 1, H]

    def discard(self, answer: Any) -> None:
        """Nothing is kept: a generation returns no states unless asked."""


@dataclass
class SglangCapturer:
    """SGLang as ``prepare --capture sglang`` runs it (the ``Capturer`` of the engine interface)."""

    label: str = "SGLang"

    def read_file(self, path: Path, *, token_ids: bool = True) -> StatesFile:
        raise SglangError(f"SGLang writes no states files ({path}): its states come back in its answers; capture "
                          "through it with `eaglewire prepare --capture sglang`")

    def _plan(self, boundaries: list[int], num_layers: int, arch: str | None,
              settings: CaptureSettings) -> tuple[list[int], list[int]]:
        if settings.dtype != DTYPE:
            raise SglangError(f"SGLang's CPU kernels compute in {DTYPE}; the target here is {settings.dtype}, so the "
                              f"cross-check would compare two precisions: pass --dtype {DTYPE}")
        ids = capture_ids(boundaries, num_layers, arch)
        return ids, to_boundaries(ids, num_layers, arch) + [num_layers]

    def launch_line(self, target: str, boundaries: list[int], num_layers: int, arch: str | None,
                    settings: CaptureSettings, storage: Path) -> str:
        ids = capture_ids(boundaries, num_layers, arch)
        path = served_target(target, "SGLang", SglangError)
        return (shlex.join(launch_command(path, ["--port", "30000", *capture_flags(ids)], settings))
                + "\n  and\n  " + shlex.join(launch_command(path, ["--port", "30001", *LABEL_FLAGS], settings))
                + "\n  then --capture-url http://HOST:30000,http://HOST:30001")

    @contextmanager
    def capture(self, target: str, boundaries: list[int], num_layers: int, arch: str | None,
                settings: CaptureSettings, *, work_dir: Path, url: str | None = None
                ) -> Iterator[SglangCapturedStates]:
        ids, slots = self._plan(boundaries, num_layers, arch, settings)
        path = served_target(target, "SGLang", SglangError)
        config = json.loads((path / "config.json").read_text())
        hidden = (config.get("text_config") or config)["hidden_size"]
        if url is not None:
            aux_url, label_url = split_urls(url)
            version = served_version(aux_url) or "unknown"
            yield SglangCapturedStates(aux_url, label_url, f"{NAME} {version}", slots, hidden)
            return
        installation = require(settings.install)
        files = ServedFiles(target=path, draft=None)
        with ExitStack() as stack:
            servers = [stack.enter_context(SglangServer(installation, files, Shape(), threads=settings.threads,
                                                        flags=flags, log_path=Path(work_dir) / f"sglang-{name}.log"))
                       for name, flags in (("capture", capture_flags(ids)), ("label", LABEL_FLAGS))]
            log.info("SGLang %s captures ids %s (boundaries %s) at %s, the label state at %s", installation.version,
                     ids, slots, servers[0].url, servers[1].url)
            yield SglangCapturedStates(servers[0].url, servers[1].url, f"{NAME} {installation.version}", slots,
                                       hidden)


CAPTURER = SglangCapturer()
