"""The serving engines eaglewire speaks, one module each, and their registry.

| module       | engine                                        | abilities                                                 |
|--------------|-----------------------------------------------|-----------------------------------------------------------|
| eaglewire.py | eaglewire's own engine                        | lint, run here, measure                                   |
| sglang.py    | SGLang (ids per target model file)            | export, import, lint, measure                             |
| vllm/        | vLLM / speculators (alias ``speculators``)    | export, import, lint, measure, run here, install, capture |
| specforge.py | SpecForge checkpoints                         | import                                                    |
| llamacpp/    | llama.cpp: install, server, GGUF export, lint | export, lint, run here, measure, install                  |
| eagle.py     | the EAGLE-3 reference code                    | import                                                    |

Each module owns what eaglewire knows of its engine: its id reading (with the file and function
of the released code it was read from), where its config keeps the ids, its checkpoint format
(export / import), its launch-flag lint and, for llama.cpp, install / launch / metrics.
``registry.py`` lists them (with command_settings.py and foreign_draft.py, the modules above the engines).
No engine imports another (tests/test_layers.py): what several share sits below them, in the
other modules here: interface.py (the spec's types), shared.py, model_file.py, flags.py, export.py,
importing.py, the formats several engines read or write (dflash_format.py, speculators_format.py,
zlab_layout.py), served_counts.py and spec_decode_metrics.py (a running server's own account of
what it accepted, ``measure_served`` in each module that can measure) and sampling_defaults.py.
"""

from eaglewire.engines.export import ExportConfig, ExportReport
from eaglewire.engines.formats.importing import ImportReport
from eaglewire.engines.interface import Ability, EngineSpec
from eaglewire.engines.registry import (ENGINES, Engine, canonical, file_reader, file_readers, export_draft, from_engine, get, import_draft,
                                        infer_boundaries, names, read_ids, refusal, sampling_of, served_elsewhere,
                                        to_engine)
from eaglewire.engines.formats.eagle3_layout import FormatError

__all__ = ["Ability", "ENGINES", "Engine", "EngineSpec", "ExportConfig", "ExportReport", "FormatError", "ImportReport", "canonical",
           "export_draft", "file_reader", "file_readers", "from_engine", "get", "import_draft", "infer_boundaries", "names", "read_ids", "refusal", "sampling_of", "served_elsewhere",
           "to_engine"]
