"""kernels/noise.py's hash on the device (Triton): the integers of a row's key and of
each id's uniform in one kernel, where the reference takes ~30 elementwise kernels.
Every operation is exact in int64 and float32, so the uniforms are bit for bit the
reference's; the rejection walk's kernel hashes with the same two functions."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treespec.kernels.triton_common import INDEX_DTYPES, check_devices, check_dtype, check_shape


@triton.jit
def mix32(x):
    """treespec.kernels.noise._mix32 on int64 values below 2^32."""
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def uniform(key, ids):
    """treespec.kernels.noise.uniform_noise of ids under a row's key (mix32(mix32(seed) ^ pos))."""
    return ((mix32(key ^ ids) >> 8).to(tl.float32) + 0.5) / 16777216.0


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, ids_ptr, out_ptr, v, ids_row_stride,
                    IDS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < v
    key = mix32(mix32(tl.load(seed_ptr + r).to(tl.int64)) ^ tl.load(pos_ptr + r).to(tl.int64))
    if IDS:
        ids = tl.load(ids_ptr + r * ids_row_stride + cols, mask=inside, other=0).to(tl.int64)
    else:
        ids = cols.to(tl.int64)
    tl.store(out_ptr + r * v + cols, uniform(key, ids), mask=inside)


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, ids: torch.Tensor | int
                  ) -> torch.Tensor:
    """See treespec.kernels.noise.uniform_noise."""
    where = "uniform_noise"
    r = seed.shape[0]
    check_shape(where, "seed", seed, (r,))
    check_shape(where, "position", position, (r,))
    tensors = {"seed": seed, "position": position}
    if isinstance(ids, torch.Tensor):
        tensors["ids"] = ids
        v = ids.shape[-1]
        check_shape(where, "ids", ids, (r, v) if ids.dim() == 2 else (v,))
        ids = ids.contiguous()
    else:
        v = ids
    for name, x in tensors.items():
        check_dtype(where, name, x, INDEX_DTYPES)
    check_devices(_uniform_kernel, where, **tensors)
    out = torch.empty(r, v, dtype=torch.float32, device=seed.device)
    if r and v:
        block = min(1024, triton.next_power_of_2(v))
        given = isinstance(ids, torch.Tensor)
        _uniform_kernel[(r, triton.cdiv(v, block))](
            seed.contiguous(), position.contiguous(), ids if given else seed, out, v,
            v if given and ids.dim() == 2 else 0, IDS=given, BLOCK=block, num_warps=4)
    return out
