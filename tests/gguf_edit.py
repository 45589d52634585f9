"""A GGUF rewritten by gguf-py (llama.cpp's own package) with fields and tensors changed: the faults a
user or another tool writes into a draft GGUF, built the way those files are made."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def rewrite_gguf(src: Path, dst: Path, *, fields: dict[str, bool | int | float] | None = None,
                 tensors: dict[str, np.ndarray] | None = None) -> Path:
    """``src`` copied to ``dst`` with ``fields`` set (bool/int/float scalars) and ``tensors`` replaced or added
    (float32 arrays in PyTorch's layout, [rows, cols]); everything else as it was."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    fields, tensors = dict(fields or {}), dict(tensors or {})
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if field.name in fields:
            writer.add_key_value(field.name, fields.pop(field.name), vtype)
        else:
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for name, value in fields.items():
        kind = (gguf.GGUFValueType.BOOL if isinstance(value, bool) else gguf.GGUFValueType.UINT32
                if isinstance(value, int) else gguf.GGUFValueType.FLOAT32)
        writer.add_key_value(name, value, kind)
    for t in reader.tensors:
        if t.name in tensors:
            writer.add_tensor(t.name, np.ascontiguousarray(tensors.pop(t.name), dtype=np.float32))
        else:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
