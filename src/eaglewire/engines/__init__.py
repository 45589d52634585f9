"""The serving engines eaglewire speaks, one package each, and their registry.

| package / module    | engine                                        | abilities                                                 |
|---------------------|-----------------------------------------------|-----------------------------------------------------------|
| eaglewire/          | eaglewire's own engine                        | lint, run here, measure                                   |
| sglang/             | SGLang (ids per target model file)            | export, import, lint, measure                             |
| vllm/               | vLLM / speculators (alias ``speculators``)    | export, import, lint, measure, run here, install, capture |
| llamacpp/           | llama.cpp: install, server, GGUF export, lint | export, lint, run here, measure, install                  |
| formats/specforge.py | SpecForge checkpoints (alias ``zlab``)       | import                                                    |
| formats/eagle.py    | the EAGLE-3 reference code                    | import                                                    |

Each engine package owns what eaglewire knows of its engine: its id reading (with the file and function of the
released code it was read from), where its config keeps the ids, its checkpoint format (export / import), its
launch-flag lint and, where it runs here, install / launch / metrics; its ``__init__.py`` assembles its ``SPEC``.
Here at the root: ``interface.py`` (the spec's types), ``registry.py`` (the one list; with ``command_settings.py``
and ``formats/foreign_draft.py`` the modules above the engines) and ``export.py``. No engine imports another
(tests/test_layers.py): what several share sits below them, in ``formats/`` (the layouts several engines read or
write, importing, the target model file) and ``serving/`` (what a running server reports: served drafts, counts,
spec-decode metrics, sampling defaults, launch flags).
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
