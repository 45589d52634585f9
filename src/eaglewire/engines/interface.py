"""What an engine can do, declared in types: each engine package ends with one ``SPEC = EngineSpec(...)``
and ``registry.py`` lists the specs. An ability is a field that is set (``spec.exporter``,
``spec.runtime``), never a function found by name.

| field      | ability                                                          | used by                     |
|------------|------------------------------------------------------------------|-----------------------------|
| eagle3     | its reading of EAGLE-3 ids (per version x target model file)     | export, import, doctor      |
| dflash     | its reading of DFlash ids                                        | export, import, doctor      |
| exporter   | writes a draft in its format                                     | ``eaglewire export --to``   |
| importer   | reads a checkpoint in its format                                 | ``eaglewire import --from`` |
| linter     | its config / draft file and launch flags read, the fields it computes with | ``doctor --engine`` |
| measure    | a running server's own account of what it accepted              | ``doctor --engine-url``     |
| runtime    | eaglewire installs/finds it, launches it at a shape, stops it    | ``bench``, ``tune``         |
| installer  | installs it here once, and finds the one the commands use        | ``eaglewire engines``       |
| stated_costs | ranked from a stated cost model (GPU engines)                  | ``tune``                    |
| sampling   | how it accepts a sampled draft token; its temperature at launch  | ``doctor --temperature``    |

``Runtime`` and ``RunningServer`` are the protocol of an engine that runs on this machine; eaglewire's
own engine runs in process and has none (bench and tune call it directly).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Protocol

from eaglewire.core.generation import GenerationStats

# engines.export_draft, handed to a runtime that exports its own draft: (draft_dir, to, out_dir, **settings)
ExportDraft = Callable[..., Any]
IdsFn = Callable[[list[int], int, "str | None"], list[int]]  # (ids or boundaries, num layers, target arch)
ReadIds = Callable[[dict[str, Any]], "tuple[dict[str, list[int] | None], list[str]]"]  # config -> (label -> ids, notes)


@dataclass(frozen=True, kw_only=True)
class IdReading:
    """How an engine turns a family's boundaries into config ids and back, and where its config keeps them."""

    to_ids: IdsFn
    to_boundaries: IdsFn
    read_ids: ReadIds | None = None  # None: no config of its own keeps them (eaglewire reads the contract, llama.cpp a GGUF)
    read_notes: Callable[[list[int], list[int], int, str | None], list[str]] | None = None  # what an import states
    per_model_file: bool = False  # the reading depends on the target's model file (needs target_arch)
    needs_target_arch: bool = False  # no reading at all without the target's architecture
    families: Callable[[], dict[str, list[str]]] | None = None  # reading -> the target families that read ids so


@dataclass(frozen=True, kw_only=True)
class Exporter:
    export: Callable[..., Any]  # (draft, fmt, out, ExportConfig, *, target, allow, others) -> ExportReport
    export_dflash: Callable[..., Any] | None = None  # same signature, a DFlash draft
    pruned_dflash: bool = False  # its DFlash export carries a pruned vocabulary (d2t and the head's rows)


@dataclass(frozen=True, kw_only=True)
class Importer:
    parse_config: Callable[..., Any]  # (config dict, *, where) -> (DraftConfig, ids, ...)
    parse_dflash_config: Callable[..., Any] | None = None
    default_only: str | None = None  # its checkpoints always mean the default boundaries: the reason why


@dataclass(frozen=True, kw_only=True)
class ArchReading:
    """Whether one build of an engine feeds EAGLE-3 drafts for a target architecture (``Linter.arch_reading``)."""

    build: str  # the build it was read from
    arch: str | None  # the engine's own name for the target's architecture; None: it cannot tell which
    serves: bool
    served: frozenset[str]  # the architectures it feeds EAGLE-3 drafts for
    why_not: str  # what happens where it does not (its code's own words)
    fix: str  # what to do where it does not, or where it cannot tell


@dataclass(frozen=True, kw_only=True)
class DraftFileLayout:
    """What an engine's own draft file (llama.cpp's GGUF) makes it feed a draft trained on ``declared``
    (``Linter.draft_file_layout``)."""

    recorded: str  # what the file records, in its own keys
    feeds: list[int] | None  # the boundaries it feeds from the file; None where it would load none
    problem: str | None  # what is wrong for the trained boundaries, with the exact fix; None: fed as trained


@dataclass(frozen=True, kw_only=True)
class Linter:
    """``doctor --engine``: what the engine's config (or draft file) and launch flags make it do. Readings only,
    facts and strings: the doctor (``doctor/checks.py``) builds its checks from them, the same for every engine."""

    lint_flags: Callable[..., Any]  # (flags, declared, num_layers, arch) -> Flags
    lint_dflash_flags: Callable[..., Any] | None = None  # (..., block_size) -> Flags
    config_fix: Callable[[list[int], int, str | None], str] | None = None  # the config line that feeds ``declared``
    dflash_config_fix: Callable[..., str] | None = None  # (declared, num_layers, arch, config) -> the line
    read_served: Callable[..., Any] | None = None  # (config, tensors, *, own_embedding_differs) -> ServedDraft
    served_config_key: Callable[[dict[str, Any]], str] | None = None  # where read_served found the draft layer's config
    launch_template_kwargs: Callable[[str], "dict[str, Any] | None"] | None = None  # chat-template kwargs in flags
    template_kwargs_fix: Callable[[dict[str, Any]], str] | None = None  # the flag that sets them
    template_kwargs_flag: str | None = None  # the launch flag that sets them
    refusal: Callable[[str | None], "str | None"] | None = None  # why it serves no EAGLE-3 draft for a target
    # its reading of a config, per target model file (engines whose model file decides the ids)
    file_for: Callable[[str | None], Any] | None = None  # arch -> the ModelFile whose rule applies
    readings: Callable[[list[int], int], dict[str, Any]] | None = None  # ids -> model-file family -> boundaries/why
    cannot_feed: Callable[[list[int], int, str | None], str] | None = None  # why a block-output file cannot feed them
    num_aux: Callable[[dict[str, Any]], int] | None = None  # aux states it sizes the draft's fc for
    label: str | None = None  # how the doctor's checks name it ("llama.cpp"); None: its registry name
    default_n_max: int | None = None  # tokens it drafts a round when its flags do not say, a DFlash block's at most
    # (None: a chain of 5, a DFlash block's block_size - 1)
    arch_reading: Callable[[str], ArchReading] | None = None  # arch -> whether it feeds EAGLE-3 drafts for it
    target_file_arch: Callable[[str], "str | None"] | None = None  # its own target file (a GGUF) -> the arch recorded
    # an engine that loads a draft file of its own (llama.cpp's GGUF), not a config.json beside the weights:
    draft_file_layout: Callable[..., DraftFileLayout] | None = None  # (path, declared, num_layers, family)
    draft_file_vocab: Callable[..., "str | None"] | None = None  # (path, vocab_ids [Vd] or None) -> its d2t's problem
    vocab_fix: str | None = None  # the fix for a d2t it reads as other tokens
    draft_file_fix: str | None = None  # what to pass where the doctor was shown no draft file
    read_draft_file: Callable[..., Any] | None = None  # (path, draft, *, emb_rows) -> FieldReading of its own file
    draft_file_layers: Callable[[Any], "list[int] | None"] | None = None  # path -> the boundaries its file feeds
    # (engine config, declared, num_layers, the layout served or None, dflash) -> the fix, for an engine whose layout
    # lives in a draft file of its own (llama.cpp's GGUF); None: config_fix's line in the draft's config.json
    layout_fix: Callable[..., str] | None = None
    norm_flags: tuple[str, ...] = ()  # the norm flags it reads from a draft's config (it computes with those only)
    d2t_reading: str | None = None  # how it reads d2t: "offsets" (target id = draft id + d2t) or "ids" (absolute)
    field_fix: str | None = None  # the one fix for any field it reads otherwise (llama.cpp: re-export the GGUF)
    draft_embedding: bool = True  # it may embed draft tokens with a draft checkpoint's own embed_tokens (SGLang: never)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How an engine samples (``doctor --temperature``): the rule it accepts a drafted token by, and where its
    default temperature comes from when requests send none."""

    acceptance_rule: str  # the rule in words, with the released code it was read from
    # (launch flags, the target's directory or None) -> the temperature they make it sample at, None where they
    # say nothing (engines/serving/sampling_defaults.py's Temperature)
    launch_temperature: Callable[[str, "Path | None"], Any] | None = None


# ---------------------------------------------------------------- engines that run here


@dataclass(frozen=True)
class Shape:
    """What a launched server speculates: ``n_max`` drafted tokens a round (0: plain decoding), drafting stopped
    below draft probability ``p_min`` where the engine has such a stop."""

    n_max: int = 0
    p_min: float = 0.0

    @property
    def plain(self) -> bool:
        return self.n_max == 0

    def label(self) -> str:
        return "plain" if self.plain else f"chain {self.n_max}" + (f", p-min {self.p_min:g}" if self.p_min else "")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """How eaglewire runs an engine here: bench's and tune's ``--engine-*`` options."""

    threads: int = 2  # pinned, as measuring needs
    flags: tuple[str, ...] = ()  # more launch flags for every launch
    install: str | None = None  # a build or interpreter to use instead of eaglewire's install
    target_file: str | None = None  # the engine's own target file (a GGUF) instead of one exported here
    draft_file: str | None = None  # the engine's own draft file instead of one exported here
    slots: int = 1  # requests it decodes together (regeneration and loads serve many; one request, one)
    ctx_per_slot: int = 4096  # tokens of context each slot holds


@dataclass(frozen=True)
class ServedFiles:
    """What a launch loads: the target (a directory or file) and the draft (None: plain only)."""

    target: Path
    draft: Path | None
    family: str = "eagle3"


@dataclass(frozen=True)
class DraftTotals:
    """A running server's cumulative account of drafting: rounds (verify passes that had a draft) and the seconds
    it spent drafting (None where the engine does not report them apart)."""

    rounds: int
    draft_seconds: float | None


@dataclass
class Answer:
    tokens: list[int]  # new token ids
    stats: GenerationStats  # the engine's own counters of this request


class RunningServer(Protocol):
    url: str

    def generate(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int) -> Answer: ...

    def complete(self, ids: list[int], *, max_new_tokens: int, temperature: float, seed: int,
                 ignore_eos: bool = False) -> list[int]:
        """One completion's new token ids and nothing else read: many clients may call it at once (a load);
        ``ignore_eos``: exactly ``max_new_tokens`` tokens (a fixed batch while costs are timed)."""

    def spec_rounds(self) -> int | None:
        """Verify passes that checked a draft so far, every request's together (the engine's own counter);
        None for a plain launch."""

    def draft_totals(self) -> DraftTotals | None: ...


class Runtime(Protocol):
    """An engine eaglewire runs on this machine: found or installed, launched with or without a draft at a shape,
    stopped on leaving the ``serve`` context."""

    label: str  # how reports name it ("llama.cpp", "vLLM")
    install_hint: str  # the command that installs it

    def available(self, settings: RunSettings) -> str | None:
        """None where it can run here, else why not (with the install command)."""

    def version(self, settings: RunSettings) -> str: ...

    def files(self, draft_dir: str | None, target: str, work_dir: Path, settings: RunSettings, *,
              export: ExportDraft | None = None, allow: frozenset[str] = frozenset()) -> ServedFiles:
        """The files it serves: the user's own (``settings``) or ``draft_dir`` / ``target`` exported into ``work_dir``
        with ``export`` (the registry's ``export_draft``: an engine package never calls back into the registry)."""

    def can_run(self, shape: Shape, family: str) -> str | None:
        """None where it can launch ``shape`` for a ``family`` draft, else why not."""

    def draft_steps(self, n_max: int, family: str) -> int:
        """Draft forwards a round of ``n_max`` tokens runs (tune's cost fit)."""

    def serve(self, files: ServedFiles, shape: Shape, settings: RunSettings, *, log_path: Path,
              draft_timing: bool = False) -> AbstractContextManager[RunningServer]:
        """A server at ``shape``, stopped on leaving the context; ``draft_timing``: so that ``draft_totals`` can
        tell the drafting time apart (a log level that may cost speed: tune's probes, not bench)."""


# ---------------------------------------------------------------- installing an engine here

Progress = Callable[[str, "float | None"], None]  # (stage or build line, percent or None)


@dataclass(frozen=True, kw_only=True)
class InstallSettings:
    """``eaglewire engines install|which``'s options (flags and checks: command_settings.EnginesConfig)."""

    install: str | None = None  # the user's own (llama.cpp: a build directory or llama-server; vLLM, SGLang: a python)
    jobs: int | None = None  # parallel compile jobs, where it builds (default: all cores)
    build: bool = False  # build into the cache even when one is on PATH
    source: str | None = None  # what it builds from instead of the pinned source (SGLang's CPU kernels)
    export: ExportDraft | None = None  # the registry's export_draft, for a smoke run that serves a draft


class InstallError(RuntimeError):
    """An engine that is not installed here, or whose installation does not run; the message says what to do."""


class Installed(Protocol):
    """What an installer found or made: the rows ``eaglewire engines`` prints."""

    def rows(self) -> list[tuple[str, str]]: ...


class Installer(Protocol):
    """An engine eaglewire installs here once (with progress) and finds again (``eaglewire engines install|which``)."""

    title: str  # the table's title: the engine and the release eaglewire pins

    def install(self, settings: InstallSettings, progress: Progress) -> Installed:
        """Install it (a no-op, but its smoke run, where it is); InstallError where it cannot."""

    def which(self, settings: InstallSettings) -> Installed:
        """The installation the commands will use; InstallError (with the install command) where there is none."""


# ---------------------------------------------------------------- capturing states through an engine


@dataclass(frozen=True)
class CaptureSettings:
    """How ``prepare --capture ENGINE`` runs the engine that captures (defaults in ``PrepareConfig``)."""

    dtype: str = "float32"  # the dtype the engine computes the target in (its own spelling)
    threads: int = 2
    tensor_parallel: int = 1
    install: str | None = None  # the engine's installation (vLLM: its python)
    max_model_len: int = 2048


class CapturedStates(Protocol):
    """A running engine that hands back the target's hidden states of a token sequence."""

    version: str  # the engine's release, as the manifest records it ("vllm 0.32.0")
    boundaries: list[int]  # what each captured slot holds, in order
    url: str  # its OpenAI-compatible server, which generates too (``prepare --regenerate`` through it)
    last_state: str  # the label slot's side of the final norm: "pre-norm" (boundary L as is) or "post-norm"

    def states(self, token_ids: list[int]) -> Any:
        """The states of ``token_ids`` through the target: a float tensor [T, len(boundaries), H]."""

    def discard(self, answer: Any) -> None:
        """Release what the server kept for a request whose states are not wanted (a generation's answer)."""


@dataclass
class StatesFile:
    """One file of states an engine's capture wrote for one request."""

    states: Any  # [T, n, H] float tensor in the stored dtype and slot order
    token_ids: Any | None  # [T] the tokens the states are of; None where the file holds none


class Capturer(Protocol):
    """An engine that captures hidden states (its ``extract_hidden_states`` or the like)."""

    label: str

    def read_file(self, path: Path, *, token_ids: bool = True) -> StatesFile:
        """One file its capture writes per request, read as written (the one reader: its own capture and
        ``import-data`` of files it wrote elsewhere); KeyError naming a missing tensor (``token_ids``: required)."""

    def launch_line(self, target: str, boundaries: list[int], num_layers: int, arch: str | None,
                    settings: CaptureSettings, storage: Path) -> str:
        """The command a user runs to serve ``target`` with capture at ``boundaries`` (``--capture-url``)."""

    def capture(self, target: str, boundaries: list[int], num_layers: int, arch: str | None,
                settings: CaptureSettings, *, work_dir: Path, url: str | None = None,
                ) -> AbstractContextManager[CapturedStates]:
        """States of ``boundaries`` (boundary ``num_layers`` included) from a server launched here, or the one the
        user runs at ``url``; stopped on leaving the context where launched."""


# ---------------------------------------------------------------- how an engine stops a chain


def _path_label(n_max: int, p_min: float, n_min: int, block: bool) -> str:
    what = f"{n_max} drafted from one block" if block else f"chain of {n_max}"
    return what + (f", --draft-min-prob {p_min:g}" if p_min else "")


@dataclass(frozen=True)
class ChainRule:
    """How an engine stops a drafted chain, and how its launch spells a shape (tune's labels).

    ``token_stop``: a drafted token is kept while its own draft probability (renormalised over the sampler's top
    tokens) reaches p-min, and a round runs one more draft forward than it keeps; otherwise the path probability
    from the root is compared and a chain of n runs n - 1 forwards after the first (eaglewire, SGLang, vLLM)."""

    token_stop: bool = False
    block_stops: bool = False  # a DFlash draft's shapes have p-min stops too
    p_min_stops: bool = True  # it has a probability stop at all (vLLM drafts a fixed k)
    label: Callable[[int, float, int, bool], str] = _path_label  # (n_max, p_min, n_min, block) -> its spelling


PATH_RULE = ChainRule()  # eaglewire's own, which SGLang shares


# ---------------------------------------------------------------- the spec


class Ability(Enum):
    """What ``names`` and ``get`` can ask an engine for; each is a field of ``EngineSpec`` being set."""

    EXPORT = "export"
    EXPORT_PRUNED_DFLASH = "export_pruned_dflash"  # its DFlash export carries a pruned vocabulary
    IMPORT = "import"
    LINT = "lint"
    MEASURE = "measure"
    RUN_HERE = "run_here"
    STATED_COSTS = "stated_costs"
    CAPTURE = "capture"  # it captures hidden states (prepare --capture)
    INSTALL = "install"  # eaglewire installs it here (eaglewire engines)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    name: str
    aliases: tuple[str, ...] = ()
    version: str | None = None  # the release its readings were taken from
    eagle3: IdReading | None = None
    dflash: IdReading | None = None
    exporter: Exporter | None = None
    importer: Importer | None = None
    linter: Linter | None = None
    measure: Callable[..., Any] | None = None  # (url, prompts, *, max_new_tokens, timeout) -> ServedCounts
    served_version: Callable[[str], "str | None"] | None = None  # a running server's own version, asked at its url
    served_flags: Callable[[str], "str | None"] | None = None  # the launch flags a running server says it runs with
    # served version -> (the release whose reading judges it, e.g. "vLLM 0.32.0"; the line that says so)
    judged: Callable[["str | None"], "tuple[str, str]"] | None = None
    runtime: Runtime | None = None
    installer: Installer | None = None  # eaglewire installs it here and finds it again
    stated_costs: bool = False
    reads_export: Callable[..., list[str]] | None = None  # SERVING.md lines: how it reads another engine's export
    chain_rule: ChainRule = PATH_RULE  # how it stops a chain and spells a shape
    draft_file_suffix: str | None = None  # the suffix of the draft files it loads (".gguf"), where it has its own
    block_follows_shape: bool = False  # it runs a DFlash block of n_max + 1 tokens, not the trained block
    in_process: bool = False  # eaglewire's own engine: run in this process (bench, tune), no server to launch
    capturer: Capturer | None = None  # it captures hidden states for prepare
    sampling: Sampling | None = None  # how it samples (None: not read; the doctor takes eaglewire's)

    def can(self, ability: Ability) -> bool:
        if not isinstance(ability, Ability):
            raise TypeError(f"an engine ability is an engines.Ability, not {ability!r}")
        return {Ability.EXPORT: self.exporter is not None,
                Ability.EXPORT_PRUNED_DFLASH: self.exporter is not None and self.exporter.pruned_dflash,
                Ability.IMPORT: self.importer is not None,
                Ability.LINT: self.linter is not None,
                Ability.MEASURE: self.measure is not None,
                Ability.RUN_HERE: self.runtime is not None or self.in_process,
                Ability.STATED_COSTS: self.stated_costs,
                Ability.CAPTURE: self.capturer is not None,
                Ability.INSTALL: self.installer is not None}[ability]

    def reading(self, family: str) -> IdReading | None:
        """Its reading of ``family``'s ids (None: it serves no such draft)."""
        return self.eagle3 if family == "eagle3" else self.dflash

    @property
    def per_model_file(self) -> bool:
        """Its reading of EAGLE-3 ids depends on the target's model file (needs ``target_arch``)."""
        return self.eagle3 is not None and self.eagle3.per_model_file

    @property
    def needs_target_arch(self) -> bool:
        """It has no reading at all without the target's architecture."""
        return self.eagle3 is not None and self.eagle3.needs_target_arch


def needs_exporter(export: ExportDraft | None) -> ExportDraft:
    """``export`` where a runtime must export a draft; without one, say what to pass."""
    if export is None:
        raise ValueError("exporting the draft needs the exporter: pass export=eaglewire.engines.export_draft, or "
                         "name the draft file the engine serves")
    return export
