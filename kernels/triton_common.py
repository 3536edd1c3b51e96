"""Launcher checks shared by the Triton kernels of this package.

Every launcher validates its arguments here before it launches, and raises
ValueError naming the argument, so a bad call fails in Python rather than as an
illegal memory access. Under ``TRITON_INTERPRET=1`` (how the tests run on a CPU)
``triton.jit`` returns an interpreted function and CPU tensors are accepted;
otherwise every tensor must be on one CUDA device.

The in-kernel reductions below (vsum, vmax, vmin, vcumsum) stand in for tl.sum,
tl.max, tl.min, tl.cumsum, which triton.language defines as @jit functions: those are
decorated when triton is first imported, so if anything imported triton before
TRITON_INTERPRET was set they are compiled-mode functions the interpreter cannot
call. Ours are decorated with the kernels and work either way; compiled, they are
the same tl.reduce / tl.associative_scan the library versions lower to.

Programmatic dependent launch (PDL, Hopper and later): a decode step is a chain
of ~300 small dependent kernels inside one CUDA graph, and each boundary costs a
launch gap plus a ramp. Launched with PDL, a kernel's programs may be scheduled
while the previous kernel still runs; ``pdl_enter(PDL)``, the first statement of
every per-layer kernel, waits there until the previous kernel has completed and
its writes are visible (griddepcontrol.wait), then lets the next kernel launch
(griddepcontrol.launch_dependents). A kernel reads and writes nothing before
pdl_enter, so ordering is the stream's: kernel N+1 waits for N, which waited for
N-1. ``launch_options()`` gives the launch keyword; PDL is on where the device
and the Triton build support it, unless ``set_pdl(False)`` (benchmarks compare).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

_pdl_choice: bool | None = None     # None: decided per device by pdl_supported()


def set_pdl(on: bool | None) -> None:
    """Force PDL on or off for launches from now on (None: back to automatic).
    Graphs captured before keep what they captured."""
    global _pdl_choice
    _pdl_choice = on


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Hopper or later, and a Triton whose CUDA launcher takes launch_pdl."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def launch_options(kernel: object, device: torch.device) -> dict:
    """Keyword arguments for a launch of kernel: the PDL constexpr, and launch_pdl
    only where it is on (a Triton without that option never sees it)."""
    if interpreted(kernel):
        return {"PDL": False}
    on = pdl_supported(device) and _pdl_choice is not False
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def interpreted(kernel: object) -> bool:
    """True when this jitted kernel runs in Triton's interpreter."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_devices(kernel: object, where: str, **tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, which is CUDA unless the kernel is interpreted."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        raise ValueError(f"{where}: tensors on different devices: {devices}")
    if first.type != "cuda" and not interpreted(kernel):
        raise ValueError(f"{where}: tensors must be on a CUDA device (got {first}); "
                         "CPU tensors run only under TRITON_INTERPRET=1")
    return first


def check_dtype(where: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{where}: {name} must be one of {[str(d) for d in allowed]}, got {t.dtype}")


def check_shape(where: str, name: str, t: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """shape entries of None match any size."""
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    if not ok:
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{where}: {name} must have shape {want}, got {tuple(t.shape)}")


def check_unit_last(where: str, name: str, t: torch.Tensor) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{where}: {name} must be contiguous in its last dim, strides {t.stride()}")


def check_paged(where: str, name: str, cache: torch.Tensor, page_dim: int) -> None:
    """Pages and slots of a cache flatten into one slot index: a page's stride is
    block_size times a slot's stride, and head_dim is unit-stride."""
    bs = cache.shape[page_dim + 1]
    if cache.stride(page_dim) != bs * cache.stride(page_dim + 1):
        raise ValueError(f"{where}: {name} pages must be dense in slots "
                         f"(stride {cache.stride()} for shape {tuple(cache.shape)})")
    check_unit_last(where, name, cache)


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _minimum(a, b):
    return tl.minimum(a, b)


@triton.jit
def vsum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _add)


@triton.jit
def vmax(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _maximum)


@triton.jit
def vmin(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _minimum)


@triton.jit
def vcumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, _add)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel, then let the next one launch (no-op without PDL)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


def log_compiles(log) -> None:
    """From now on, log every Triton kernel specialization this process compiles (or
    loads from triton's disk cache): called after a warm-up, each line is a step that
    waited on a compile, and names the shape the warm-up missed."""
    try:
        from triton import knobs
    except ImportError:          # a triton without knobs: nothing to hook
        return

    def hook(*, repr: str, compile: dict, **_) -> bool:
        log.info("Triton compile while serving: %s constants %s", " ".join(repr.split())[:1500],
                 compile.get("constants"))
        return False             # True would skip the compile

    knobs.runtime.jit_cache_hook = hook
