"""docs/engines.md's table of every field that changes what the draft computes, against the code that checks it:
each field the engine-fields check can report has a row, and the GGUF column's keys are the ones
engines/llamacpp/served.py reads."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from eaglewire.doctor import engine_reading
import eaglewire.engines.llamacpp.served as gguf_served
import eaglewire.engines.serving.served_draft as served_draft
from eaglewire.engines.serving.served_draft import TRAINED_NORMS, ServedDraft, mismatches
from eaglewire.model.draft import DraftConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "engines.md"


def _table() -> list[list[str]]:
    text = DOC.read_text()
    section = text[text.index("## Every field that changes what the draft computes"):]
    section = section[:section.index("\n## ", 1)]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")]


def _everything_otherwise(cfg: DraftConfig) -> ServedDraft:
    """A reading that differs from ``cfg`` in every field ``mismatches`` compares."""
    return ServedDraft(engine="e", norms={k: True for k in TRAINED_NORMS}, draft_vocab_size=cfg.draft_vocab_size + 1,
                       target_hidden_size=cfg.target_hidden_size + 1, num_aux=cfg.num_aux + 1,
                       hidden_size=cfg.hidden_size + 1, head_dim=cfg.head_dim + 1, rms_norm_eps=cfg.rms_norm_eps * 2,
                       rope_theta=cfg.rope_theta * 2, rope_parameters={"rope_type": "linear", "factor": 2.0},
                       embedding="draft", lm_head="target", layer="qwen3")


def test_every_field_the_check_reports_has_a_row():
    cfg = DraftConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      target_hidden_size=64, num_aux=3, vocab_size=256, draft_vocab_size=64)
    fields = {m.field for m in mismatches(_everything_otherwise(cfg), cfg)}
    # the fields read beside the config (tensors in the served directory or GGUF)
    for module in (engine_reading, served_draft, gguf_served):
        fields |= set(re.findall(r'Mismatch\("(\w+)"', inspect.getsource(module)))
    assert {"norm_before_fc", "rms_norm_eps", "lm_head", "embed_tokens", "d2t"} <= fields  # the probe probes
    first = " ".join(row[0] for row in _table())
    missing = sorted(f for f in fields if f"`{f}`" not in first)
    assert not missing, f"fields the engine-fields check reports without a row in {DOC.name}: {missing}"


def test_the_gguf_column_names_the_keys_and_tensors_the_reader_reads():
    rows = _table()
    header = rows[0]
    column = header.index("llama.cpp 11434 GGUF (`src/models/eagle3.cpp`)")
    text = " ".join(row[column] for row in rows[1:])
    source = inspect.getsource(gguf_served)
    keys = set(re.findall(r'key\("([\w.]+)"', source)) - {"target_layers"}
    tensors = {gguf_served.NORM_BEFORE_FC_TENSOR, gguf_served.OWN_EMBEDDING_TENSOR, gguf_served.OWN_HEAD_TENSOR}
    for name in keys | tensors:
        leaf = name.rsplit(".", 1)[-1] if name not in tensors else name
        assert leaf in text, f"{name} (read by engines/llamacpp/served.py) is not in the doc's GGUF column"
    assert f"llama.cpp {gguf_served.BUILD}" in header[column]
