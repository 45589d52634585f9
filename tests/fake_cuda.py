"""A CPU stand-in for one CUDA device: find device-placement faults without a GPU.

Every tensor stays on the CPU, but each one's storage is tagged with the device CUDA would have put it
on (``cuda`` when made with ``device="cuda"``, moved by ``.to("cuda")`` / ``.cuda()``, or computed from a
``cuda`` tensor), ``Tensor.device`` answers that device, and an op that mixes the two raises CUDA's own
error: the faults that crashed ``train`` and ``doctor`` on the first GPU (a CPU tensor indexed by a CUDA
one; two devices in one op) fail here the same way, in the CPU suite. What it cannot show: kernels,
speed, numerics (the arithmetic is the CPU's), NCCL; autocast for ``cuda`` is the CPU's autocast. Those
need a GPU (the ``cuda`` marker).

CUDA graphs (``fake_cuda(graphs=True)``; without it a capture fails, as on a machine that refuses one): a
capture records the aten calls its body makes, with their arguments (the very tensors, and Python values as
they were), and a replay calls them again in order, writing each result into the tensor the capture made --
what a graph does with its kernels and their buffers. So a body whose replay would read a value baked in at
capture (a Python int, a tensor the caller replaced), or a caller that keeps a graph's output past the next
replay, goes as wrong here as on a GPU; and a host synchronisation inside a capture (``.item()``,
``.tolist()``, a copy to or from the host) raises CUDA's capture error.

Rules mirrored from CUDA: a 0-dim CPU tensor may join a CUDA op (a scalar); ``copy_`` and ``.to`` cross
devices; a CUDA tensor may be indexed by CPU indices, a CPU tensor not by CUDA ones; ``.numpy()`` of a
CUDA tensor is refused; a CPU generator cannot sample CUDA tensors.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
MIXED = "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"

# Ops where devices may differ (CUDA moves or accepts the other side itself).
_CROSS = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::lift_fresh",
          "aten::lift_fresh_copy", "aten::set_", "aten::_local_scalar_dense", "aten::detach", "aten::alias"}
_INDEXING = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_", "aten::_unsafe_index",
             "aten::_unsafe_index_put"}


class _Tags:
    """Storage address -> placed on the fake CUDA device, forgotten when the storage dies (torch keeps one Python
    object per live storage, so a finalizer on it fires then): an address the allocator hands out again starts
    untagged. A storage made outside the modes (a safetensors mmap, C++ alone) has no tag: it takes its place
    from the call that uses it."""

    def __init__(self) -> None:
        self.cuda: set[int] = set()
        self.known: set[int] = set()

    @staticmethod
    def key(t: torch.Tensor) -> int | None:
        if t.device.type != "cpu" or t.is_meta:
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        return ptr or None

    def of(self, t: torch.Tensor) -> str | None:
        k = self.key(t)
        if k is None or k not in self.known:
            return None
        return "cuda" if k in self.cuda else "cpu"

    def set(self, t: torch.Tensor, device: str) -> None:
        if (k := self.key(t)) is None:
            return
        if k not in self.known:
            self.known.add(k)
            weakref.finalize(t.untyped_storage(), self._forget, k)
        (self.cuda.add if device == "cuda" else self.cuda.discard)(k)

    def _forget(self, k: int) -> None:
        self.known.discard(k)
        self.cuda.discard(k)


def _tensors(*trees) -> list[torch.Tensor]:
    """The tensors among (nested lists, tuples, dicts of) arguments: on every op, so no pytree."""
    out: list[torch.Tensor] = []
    stack = list(trees)
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    out.reverse()
    return out


def _is_cuda_device(d) -> bool:
    if d is None or isinstance(d, torch.Tensor):
        return False
    if isinstance(d, int):
        return True  # .to(0): a CUDA ordinal
    try:
        return torch.device(d).type == "cuda"
    except (RuntimeError, TypeError):
        return False


class _Dispatch(TorchDispatchMode):
    """Every aten op (backward and optimizer included): check the inputs' devices, tag the outputs."""

    def __init__(self, tags: _Tags, function_mode: _Function) -> None:
        super().__init__()
        self.tags, self.fn = tags, function_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        inputs = _tensors(args, kwargs)
        placed = [(t, self.tags.of(t)) for t in inputs]
        on_cuda = any(d == "cuda" for _, d in placed)
        if on_cuda and name not in _CROSS:
            self._check(name, args, placed)
        out = func(*args, **kwargs)
        device = self.fn.pending or ("cuda" if on_cuda and name not in _CROSS else None)
        if device is None and all(d is None for _, d in placed):  # made from nothing placed (zeros, empty, ...)
            device = self.fn.context
        if name in ("aten::copy_",):
            device = None  # copy_ keeps its destination's place
        elif device is None and name in ("aten::lift_fresh", "aten::lift_fresh_copy"):
            device = self.fn.context  # torch.tensor(data): made in C++ first, its address may be a freed one's
        elif device is None and name in _CROSS:
            device = self.tags.of(inputs[0]) if inputs else None
        for t in _tensors(out):
            if name == "aten::copy_" and inputs and t is args[0]:
                continue
            self.tags.set(t, device or "cpu")
        return out

    def _check(self, name: str, args, placed) -> None:
        if name in _INDEXING:
            self_device = self.tags.of(args[0])
            index_devices = {self.tags.of(t) for t in _tensors(args[1:]) if t.dim() > 0}
            if self_device == "cpu" and "cuda" in index_devices:
                raise RuntimeError("indices should be either on cpu or on the same device as the indexed "
                                   "tensor (cpu)")
            return
        if any(d == "cpu" and t.dim() > 0 for t, d in placed):
            raise RuntimeError(f"{MIXED} ({name})")


class _Function(TorchFunctionMode):
    """Python-level calls: ``device=`` arguments, ``.to``/``.cuda``/``.cpu``, ``Tensor.device``, ``.numpy``."""

    def __init__(self, tags: _Tags) -> None:
        super().__init__()
        self.tags = tags
        self.pending: str | None = None  # the device a call asked for (device=, .to, .cuda, .cpu)
        self.context: str | None = None  # the device of the call's own tensors
        self.capturing = False  # inside a fake CUDA graph's capture

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__objclass__", None)
        if name == "__get__" and owner is not None:  # a property of Tensor
            prop = getattr(func, "__self__", None)
            prop_name = getattr(prop, "__name__", "")
            t = args[0]
            if prop_name == "device":
                return CUDA if self.tags.of(t) == "cuda" else func(*args, **kwargs)
            if prop_name == "is_cuda":
                return self.tags.of(t) == "cuda"
            if prop_name == "is_cpu":
                return self.tags.of(t) != "cuda"
            return func(*args, **kwargs)
        if self.capturing and func in (torch.Tensor.tolist, torch.Tensor.item) and self.tags.of(args[0]) == "cuda":
            raise RuntimeError(f"{CAPTURING} (a host read: {name})")
        if func is torch.Tensor.numpy and self.tags.of(args[0]) == "cuda":
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        if func is torch.Tensor.pin_memory or func is torch.Tensor.is_pinned:
            return args[0] if func is torch.Tensor.pin_memory else False
        kwargs.pop("pin_memory", None)  # page-locked host memory: ordinary memory here
        gen = kwargs.get("generator")
        if gen is not None and not _cuda_generator(gen) and any(self.tags.of(t) == "cuda" for t in _tensors(args)):
            raise RuntimeError("Expected a 'cuda' device type for generator but found 'cpu'")
        target = None
        if func is torch.Tensor.cuda:
            target, func, args = "cuda", torch.Tensor.clone, args[:1]
            kwargs = {}
        elif func is torch.Tensor.cpu:
            if self.tags.of(args[0]) == "cuda":
                target, func, args, kwargs = "cpu", torch.Tensor.clone, args[:1], {}
            else:
                return func(*args, **kwargs)
        elif func is torch.Tensor.to:
            target, args, kwargs = self._to(args, kwargs)
        elif "device" in kwargs and kwargs["device"] is not None:
            if _is_cuda_device(kwargs["device"]):
                target, kwargs["device"] = "cuda", "cpu"
            elif torch.device(kwargs["device"]).type == "cpu":
                target = "cpu"  # (meta and others pass as they are)
        # what a kernel makes without tensor inputs (zeros, empty, ...) gets its options from the call's tensors
        context = target or ("cuda" if any(self.tags.of(t) == "cuda" for t in _tensors(args, kwargs)) else "cpu")
        outer = self.pending, self.context
        self.pending, self.context = target, context
        try:
            out = func(*args, **kwargs)
        finally:
            self.pending, self.context = outer
        made_from_nothing = not _tensors(args, kwargs)  # torch.tensor, from_numpy, frombuffer: not all dispatched
        if target is not None or made_from_nothing:
            for t in _tensors(out):
                self.tags.set(t, target or "cpu")
        return out

    def _to(self, args, kwargs):
        """``Tensor.to``'s forms: (device), (dtype), (device, dtype), (tensor), device=/dtype= keywords."""
        self_t = args[0]
        device = kwargs.pop("device", None)
        flags = []
        for a in args[1:]:
            if isinstance(a, torch.Tensor):  # .to(other): other's device and dtype
                device = CUDA if self.tags.of(a) == "cuda" else CPU
                kwargs["dtype"] = a.dtype
            elif isinstance(a, torch.dtype):
                kwargs["dtype"] = a
            elif isinstance(a, bool):
                flags.append(a)
            elif a is not None:
                device = a
        kwargs.update(zip(("non_blocking", "copy"), flags))
        if kwargs.get("dtype", 0) is None:
            kwargs.pop("dtype")
        if device is None:
            return None, (self_t,), kwargs
        if not _is_cuda_device(device) and torch.device(device).type != "cpu":
            return None, (self_t,), {**kwargs, "device": device}  # meta and others pass as they are
        target = "cuda" if _is_cuda_device(device) else "cpu"
        here = self.tags.of(self_t) or "cpu"
        if target != here:
            kwargs["copy"] = True  # a move is a new storage: the source keeps its place
        return target, (self_t,), kwargs


CAPTURING = "CUDA error: operation not permitted when stream is capturing"


class _GraphRecorder(TorchDispatchMode):
    """Inside a capture: every aten call is made (the body runs) and recorded for the graph's replays."""

    def __init__(self, tags: _Tags, function_mode: _Function) -> None:
        super().__init__()
        self.tags, self.fn = tags, function_mode
        self.trace: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name == "aten::_local_scalar_dense":
            raise RuntimeError(f"{CAPTURING} (a host read: {name})")
        places = {self.tags.of(t) for t in _tensors(args, kwargs) if t.dim() > 0} - {None}
        moved = self.fn.pending is not None and places and places != {self.fn.pending}  # .to / .cpu / .cuda
        copied = name in ("aten::copy_", "aten::_copy_from") and len(places) > 1
        if moved or copied:
            raise RuntimeError(f"{CAPTURING} (a copy between the host and the device: {name})")
        out = func(*args, **kwargs)
        self.trace.append((func, args, kwargs, out))
        return out


class _Graph:
    """``torch.cuda.CUDAGraph()``: replays the aten calls its capture recorded, into the capture's tensors."""

    def __init__(self, *_, **__) -> None:
        self.trace: list[tuple] | None = None

    def replay(self) -> None:
        assert self.trace is not None, "replay of a graph never captured"
        for func, args, kwargs, out in self.trace:
            new = func(*args, **kwargs)
            for old, fresh in zip(_tensors(out), _tensors(new)):
                if old.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():  # not a view, not in place
                    old.copy_(fresh)

    def pool(self) -> object:
        return ("fake graph pool", id(self))

    def reset(self) -> None:
        self.trace = None


class _Stream:
    def __init__(self, *_, **__) -> None:
        pass

    def wait_stream(self, _stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _graph_context(tags: _Tags, function_mode: _Function):
    """``torch.cuda.graph(graph, pool=...)``: record the body's calls into ``graph``."""
    @contextlib.contextmanager
    def graph(cuda_graph: _Graph, pool=None, stream=None, capture_error_mode=None):
        recorder = _GraphRecorder(tags, function_mode)
        function_mode.capturing = True
        try:
            with recorder:
                yield
        finally:
            function_mode.capturing = False
        cuda_graph.trace = recorder.trace
    return graph


class _Event:
    """``torch.cuda.Event(enable_timing=True)`` on the host clock."""

    def __init__(self, enable_timing: bool = False, **_) -> None:
        self.t = 0.0

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end.t - self.t) * 1000.0


_CUDA_GENERATORS: list[torch.Generator] = []  # kept alive while the fake lasts; few are made


def _cuda_generator(g: torch.Generator) -> bool:
    return any(g is c for c in _CUDA_GENERATORS)


class _Generator(torch.Generator):
    """``torch.Generator(device="cuda")``: a CPU generator that says it is a CUDA one."""

    def __new__(cls, device="cpu"):
        g = super().__new__(cls, "cpu")
        if _is_cuda_device(device):
            _CUDA_GENERATORS.append(g)
        return g

    @property
    def device(self) -> torch.device:
        return CUDA if any(self is c for c in _CUDA_GENERATORS) else CPU



@contextlib.contextmanager
def fake_cuda(*, graphs: bool = False) -> Iterator[_Tags]:
    """Run the body as if one CUDA device were present (see the module's docstring); ``graphs``: with CUDA
    graphs that capture and replay (else a capture fails)."""
    tags = _Tags()
    function_mode = _Function(tags)
    dispatch_mode = _Dispatch(tags, function_mode)
    rng = torch.get_rng_state
    patches = [
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.current_device", lambda: 0),
        mock.patch("torch.cuda.set_device", lambda d: None),
        mock.patch("torch.cuda.synchronize", lambda device=None: None),
        mock.patch("torch.cuda.is_bf16_supported", lambda *a, **k: True),
        mock.patch("torch.cuda.get_device_name", lambda device=None: "fake CUDA (CPU)"),
        mock.patch("torch.cuda.get_device_capability", lambda device=None: (9, 0)),
        mock.patch("torch.cuda.max_memory_allocated", lambda device=None: 0),
        mock.patch("torch.cuda.memory_allocated", lambda device=None: 0),
        mock.patch("torch.cuda.reset_peak_memory_stats", lambda device=None: None),
        mock.patch("torch.cuda.empty_cache", lambda: None),
        mock.patch("torch.cuda.get_rng_state", lambda device="cuda": rng()),
        mock.patch("torch.cuda.set_rng_state", lambda state, device="cuda": None),
        mock.patch("torch.cuda.manual_seed", lambda seed: None),
        mock.patch("torch.cuda.manual_seed_all", lambda seed: None),
        mock.patch("torch.cuda.Event", _Event),
        mock.patch("torch.Generator", _Generator),
    ]
    if graphs:
        patches += [
            mock.patch("torch.cuda.CUDAGraph", _Graph),
            mock.patch("torch.cuda.graph", _graph_context(tags, function_mode)),
            mock.patch("torch.cuda.Stream", _Stream),
            mock.patch("torch.cuda.current_stream", lambda device=None: _Stream()),
            mock.patch("torch.cuda.stream", lambda stream: contextlib.nullcontext()),
            mock.patch("torch.cuda.graph_pool_handle", lambda: ("fake graph pool", None)),
        ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(function_mode)
        stack.enter_context(dispatch_mode)
        yield tags


__all__ = ["fake_cuda", "MIXED"]
