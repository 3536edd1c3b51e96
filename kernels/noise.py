"""Counter-based noise: the hash (lowbias32) every draw keys by (seed, position, token
id), so that both services, any batch and any kernel draw the same numbers for the
same request. This is its reference; on a CUDA device with Triton,
kernels/triton_noise.py computes the same bits in one kernel (the rejection walk's
kernel hashes with its functions).
"""

from __future__ import annotations

import torch

from treespec.kernels.availability import triton_available

# treespec.kernels.reference.rejection_walk's: the uniforms of its accept tests, its bonus draws
ACCEPT_SALT = 0x2545F491
BONUS_SALT = 0x6A09E667
_M32 = 0xFFFFFFFF


def accept_uniforms(seed: torch.Tensor, position: torch.Tensor, siblings: int) -> torch.Tensor:
    """The uniforms [R, siblings] of rejection_walk's accept tests at a node whose
    children sit at position [R] of sequences seeded seed [R]."""
    return uniform_noise(seed ^ ACCEPT_SALT, position,
                         torch.arange(siblings, device=seed.device))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) of int64 tensors holding values in [0, 2^32)
    (every caller's: seeds, positions and ids are non-negative); the products wrap in
    int64 and only their low 32 bits are kept."""
    x = (x ^ (x >> 16)) * 0x7FEB352D & _M32
    x = (x ^ (x >> 15)) * 0x846CA68B & _M32
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, position: torch.Tensor, ids: torch.Tensor | int
                  ) -> torch.Tensor:
    """Uniforms [R, V] float32 in (0, 1) for rows keyed (seed [R], position [R]) int64
    and ids [V] or per row [R, V] (an int V: ids 0 .. V-1), from a hash of (seed,
    position, id).
    Counter-based: the same key gives the same number on any device, in any batch,
    for an id whatever else is drawn beside it."""
    if triton_available(seed.device):
        from treespec.kernels.triton_noise import uniform_noise as on_device
        return on_device(seed, position, ids)
    key = _mix32(_mix32(seed.long()) ^ position.long())
    if isinstance(ids, int):
        ids = torch.arange(ids, device=seed.device, dtype=torch.int64)
    return ((_mix32(key.unsqueeze(-1) ^ ids.long()) >> 8).float() + 0.5) / (1 << 24)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, ids: torch.Tensor | int
                 ) -> torch.Tensor:
    """Gumbel noise [R, V]: -log(-log(u)) of uniform_noise's u (token ids as ids)."""
    return -torch.log(-torch.log(uniform_noise(seed, position, ids)))
