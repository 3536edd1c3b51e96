"""The Triton kernels against exact answers, against kernels/reference.py, and the
tree-attention branch property.

On a CPU the kernels run in Triton's interpreter: TRITON_INTERPRET must be set
before the kernel modules are decorated, so it is set here, before they are
imported. With ``TRITON_INTERPRET=0`` on a CUDA machine the same tests run compiled.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from treespec.common.spec.accept import commit_kv
from treespec.kernels import reference as ref
from triton_interpret import DEV, HAVE_TRITON, INTERPRET, load as _load, needs_triton

pytestmark = needs_triton


if HAVE_TRITON:
    _load("treespec.kernels.triton_common")
    attn_mod = _load("treespec.kernels.triton_tree_attention")
    kv_mod = _load("treespec.kernels.triton_kv")
    accept_mod = _load("treespec.kernels.triton_accept")
    _load("treespec.kernels.triton_ancestors")
    tb = _load("treespec.kernels.triton_backend")


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def tol(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}[dtype]


def paged(num_blocks: int, block_size: int, kv_heads: int, d: int, dtype=torch.float32,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, kv_heads, d)
    return (torch.randn(shape, generator=g).to(DEV, dtype),
            torch.randn(shape, generator=g).to(DEV, dtype))


# ---------------------------------------------------------------- exact answers

def _uniform_case(ctx: int, parents: list[int], block_size: int = 2):
    """q = 0 makes attention a plain mean of the visible values."""
    t, d = len(parents), 16
    nblk = (ctx + t + block_size - 1) // block_size
    table = list(range(nblk))[::-1]                  # pages out of order
    kc = torch.zeros(nblk, block_size, 1, d, device=DEV)
    vc = torch.zeros_like(kc)
    vals = torch.arange(ctx + t, dtype=torch.float32, device=DEV) * 8.0
    for s in range(ctx + t):
        vc[table[s // block_size], s % block_size, 0, :] = vals[s]
    q = torch.zeros(t, 2, d, device=DEV)
    out = tb.paged_tree_attention(q, kc, vc, i32([table]), i32([ctx]), i32([0, t]),
                                  i32(parents), 1.0)
    return out, vals


def test_chain_exact():
    out, vals = _uniform_case(ctx=3, parents=[-1, 0, 1, 2])
    for i in range(4):
        want = vals[: 3 + i + 1].mean()
        assert torch.allclose(out[i], torch.full_like(out[i], float(want))), i


def test_two_by_two_tree_exact():
    # root r; a, b children of r; c child of a; d child of b; one padding row
    out, vals = _uniform_case(ctx=2, parents=[-1, 0, 0, 1, 2, -2])
    ctx = [0, 1]
    sees = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 2, 4]}
    for i, chunk in sees.items():
        want = vals[ctx + [2 + j for j in chunk]].mean()
        assert torch.allclose(out[i], torch.full_like(out[i], float(want))), i
    assert torch.allclose(out[5], torch.full_like(out[5], float(vals[2 + 5])))


def test_accept_chain_exact():
    # draft r -> a -> b -> c; target at [r, a, b, c] = [a, b, x, y]
    a, b, c, x, y = 11, 12, 13, 20, 21
    acc, num, bonus = tb.accept_greedy(i32([[a, b, c]]), i32([[-1, 0, 1]]),
                                       i32([[a, b, x, y]]), 3)
    assert acc.tolist() == [[0, 1, -1]] and num.tolist() == [2] and bonus.tolist() == [x]


def test_accept_two_by_two_exact():
    # root ─ a(0) ─ c(2); root ─ b(1) ─ d(3); a second "b" at node 4 loses to node 1
    a, b, c, d, z = 1, 2, 3, 4, 9
    tokens = i32([[a, b, c, d, b], [a, b, c, d, b]])
    parents = i32([[-1, -1, 0, 1, -1], [-1, -1, 0, 1, -1]])
    target = i32([[b, c, d, 7, z, 7], [z, 0, 0, 0, 0, 0]])
    acc, num, bonus = tb.accept_greedy(tokens, parents, target, 2)
    assert acc.tolist() == [[1, 3], [-1, -1]]
    assert num.tolist() == [2, 0] and bonus.tolist() == [z, z]


def test_compact_overlapping_path_exact():
    # accepted path [1, 2] after kv_len 4: slots 6 -> 5, 7 -> 6 (7 read after 6 is read)
    layers, nb, bs = 2, 3, 4
    k = torch.arange(layers * nb * bs, dtype=torch.float32, device=DEV).view(layers, nb, bs, 1, 1)
    k = k.expand(layers, nb, bs, 2, 16).contiguous()
    v = -k
    src, dst = i32([6, 7]), i32([5, 6])
    table = torch.tensor([2, 0, 1], device=DEV)
    fs, fd = table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs
    want_k = k.clone()
    tb.compact_kv(k, v, fs, fd)
    flat = want_k.view(layers, nb * bs, 2, 16)
    flat[:, fd] = flat[:, fs]
    assert torch.equal(k, want_k) and torch.equal(v, -want_k)


# -------------------------------------------------------- random, vs reference

def random_tree(n: int, g: torch.Generator, pad: int = 0) -> list[int]:
    """Node parents (-1 root) of n nodes, the last `pad` of them padding."""
    par = [-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(n - pad)]
    return par + [-2] * pad


def as_chunk(node_parents: list[int]) -> list[int]:
    """[root, nodes] chunk parents from node parents."""
    return [-1] + [p if p == -2 else p + 1 for p in node_parents]


def build_batch(chunks: list[list[int]], ctxs: list[int], block_size: int, extra_pages: int,
                g: torch.Generator):
    """Shuffled page tables covering each sequence's ctx + chunk slots."""
    need = [(c + len(p) + block_size - 1) // block_size for c, p in zip(ctxs, chunks)]
    width = max(max(need), 1) + 1
    nb = sum(need) + extra_pages
    perm = torch.randperm(nb, generator=g).tolist()
    table, at = [], 0
    for n in need:
        row = perm[at:at + n] + [perm[-1]] * (width - n)
        table.append(row)
        at += n
    cu = [0]
    for p in chunks:
        cu.append(cu[-1] + len(p))
    parents = [x for p in chunks for x in p]
    return nb, i32(table), i32(ctxs), i32(cu), i32(parents)


ATTN_CASES = [
    # dtype, q_heads, kv_heads, d, block_size, splits, block_n
    (torch.float32, 4, 2, 16, 4, None, None),
    (torch.float32, 3, 1, 32, 3, 3, 16),
    (torch.bfloat16, 4, 1, 16, 8, 2, 16),
    (torch.float16, 2, 2, 16, 5, None, 16),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,bs,splits,block_n", ATTN_CASES)
def test_attention_random_vs_reference(dtype, hq, hkv, d, bs, splits, block_n):
    g = torch.Generator().manual_seed(hq * 100 + d + bs)
    chunks = [[-1],                                   # decode
              as_chunk(random_tree(9, g, pad=2)),     # tree with padding
              list(range(-1, 10)),                    # prefill chain
              [],                                     # empty chunk
              as_chunk(random_tree(5, g))]
    ctxs = [13, 7, 0, 4, 21]
    nb, table, ctx, cu, par = build_batch(chunks, ctxs, bs, 3, g)
    kc, vc = paged(nb, bs, hkv, d, dtype, seed=bs)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(DEV, dtype)
    kw = dict(num_splits=splits, block_n=block_n)
    out = attn_mod.paged_tree_attention(q, kc, vc, table, ctx, cu, par, d ** -0.5, **kw)
    want = ref.paged_tree_attention(q, kc, vc, table, ctx, cu, par, d ** -0.5)
    torch.testing.assert_close(out.float(), want.float(), **tol(dtype))


@pytest.mark.parametrize("block_n", [16, 128])
def test_attention_long_tree_walks_several_windows(block_n):
    """A 70-query non-chain chunk crosses several bitmask windows (16 or 64 keys)."""
    g = torch.Generator().manual_seed(7)
    chunks = [as_chunk(random_tree(69, g, pad=3)), list(range(-1, 20)) + [-2, 20]]
    nb, table, ctx, cu, par = build_batch(chunks, [5, 3], 4, 0, g)
    kc, vc = paged(nb, 4, 1, 16)
    q = torch.randn(int(cu[-1]), 2, 16, generator=g).to(DEV)
    out = attn_mod.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.3,
                                        block_m=32, block_n=block_n)
    want = ref.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.3)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_attention_splits_cut_each_live_context():
    """Context spans come from each sequence's own length, not the table's width (a
    page bucket can be twice the live context): 3, 2 and 1 spans of >= 128 keys,
    then the chunk's own split, all combined as the reference says."""
    g = torch.Generator().manual_seed(13)
    chunks = [as_chunk(random_tree(6, g)), list(range(-1, 3)), [-1]]
    ctxs = [300, 140, 7]
    nb, table, ctx, cu, par = build_batch(chunks, ctxs, 16, 2, g)
    wide = torch.cat([table, table[:, -1:].expand(-1, table.shape[1])], 1).contiguous()
    kc, vc = paged(nb, 16, 1, 16)
    q = torch.randn(int(cu[-1]), 2, 16, generator=g).to(DEV)
    out = attn_mod.paged_tree_attention(q, kc, vc, wide, ctx, cu, par, 0.25, num_splits=4,
                                        block_m=16, block_n=32)
    want = ref.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.25)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_backend_default_tiling():
    g = torch.Generator().manual_seed(3)
    chunks = [as_chunk(random_tree(12, g)), as_chunk(random_tree(12, g, pad=4))]
    nb, table, ctx, cu, par = build_batch(chunks, [9, 20], 16, 2, g)
    kc, vc = paged(nb, 16, 2, 32)
    q = torch.randn(int(cu[-1]), 8, 32, generator=g).to(DEV)
    out = tb.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.2)
    want = ref.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.2)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_write_kv_vs_reference(cache_dtype):
    g = torch.Generator().manual_seed(1)
    kc, vc = paged(6, 3, 2, 16, cache_dtype)
    qkv = torch.randn(7, 5, 16, generator=g).to(DEV)
    k, v = qkv[:, 1:3], qkv[:, 3:5]                 # strided views, as from a fused qkv
    slots = torch.randperm(18, generator=g)[:7].to(DEV)
    want_k, want_v = kc.clone(), vc.clone()
    ref.write_kv(want_k, want_v, k, v, slots)
    tb.write_kv(kc, vc, k, v, slots.int())
    # compiled casts round to nearest even; the interpreter's fp32 -> bf16 truncates
    exact = cache_dtype == torch.float32 or not INTERPRET
    close = dict(atol=0, rtol=0) if exact else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(kc, want_k, **close)
    torch.testing.assert_close(vc, want_v, **close)


def test_compact_kv_vs_reference():
    g = torch.Generator().manual_seed(2)
    layers, nb, bs, b, depth = 3, 20, 4, 4, 5
    k = torch.randn(layers, nb, bs, 2, 16, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(layers, nb, bs, 2, 16, generator=g).to(DEV, torch.bfloat16)
    # per sequence an accepted path of increasing node indices after kv_len
    acc = torch.full((b, depth), -1, dtype=torch.int32)
    num = torch.randint(0, depth + 1, (b,), generator=g, dtype=torch.int32)
    for i in range(b):
        acc[i, :num[i]] = torch.sort(torch.randperm(8, generator=g)[:num[i]]).values.int()
    kv_lens = i32([0, 3, 5, 2])
    table = torch.randperm(nb, generator=g)[:16].view(b, 4).to(DEV, torch.int32)
    want = SimpleNamespace(k=k.clone(), v=v.clone(), block_size=bs)
    commit_kv(want, ref, acc.to(DEV), num.to(DEV), kv_lens, table)
    got = SimpleNamespace(k=k, v=v, block_size=bs)
    commit_kv(got, tb, acc.to(DEV), num.to(DEV), kv_lens, table)
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_accept_greedy_vs_reference():
    g = torch.Generator().manual_seed(4)
    b, n, vocab = 6, 13, 4                          # tiny vocab: many matches, ties
    parents = torch.tensor([random_tree(n, g, pad=int(i % 3)) for i in range(b)],
                           dtype=torch.int32)
    tokens = torch.randint(0, vocab, (b, n), generator=g, dtype=torch.int32)
    target = torch.randint(0, vocab, (b, n + 1), generator=g)
    for depth in (0, 3, n):
        got = tb.accept_greedy(tokens.to(DEV), parents.to(DEV), target.to(DEV), depth)
        want = ref.accept_greedy(tokens.to(DEV), parents.to(DEV), target.to(DEV), depth)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and torch.equal(x, y), depth


# ---------------------------------------------------------------- branch test

def test_each_node_equals_causal_attention_over_its_root_path():
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs, ctx = 4, 2, 16, 4, 6
    node_par = random_tree(10, g)
    parents = as_chunk(node_par)
    nb, table, ctxs, cu, par = build_batch([parents], [ctx], bs, 1, g)
    kc, vc = paged(nb, bs, hkv, d, seed=9)
    q = torch.randn(len(parents), hq, d, generator=g).to(DEV)
    out = attn_mod.paged_tree_attention(q, kc, vc, table, ctxs, cu, par, d ** -0.5, block_n=16)
    slots = ref.gather_slots(table[0], 0, ctx + len(parents), bs)
    k = kc.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 1)
    v = vc.view(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 1)
    for i in range(len(parents)):
        path, j = [], i                              # root path of chunk query i
        while j >= 0:
            path.append(j)
            j = parents[j]
        keys = list(range(ctx)) + [ctx + j for j in reversed(path)]
        # the node as the last query of a causal sequence over its path
        o = torch.nn.functional.scaled_dot_product_attention(
            q[i].unsqueeze(1), k[keys].transpose(0, 1), v[keys].transpose(0, 1),
            scale=d ** -0.5)
        torch.testing.assert_close(out[i], o.squeeze(1), atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- launcher checks

def test_launchers_reject_bad_arguments():
    kc, vc = paged(4, 4, 2, 16)
    q = torch.randn(3, 4, 16, device=DEV)
    args = (i32([[0, 1]]), i32([2]), i32([0, 3]), i32([-1, 0, 1]))
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        tb.paged_tree_attention(torch.randn(3, 3, 16, device=DEV), kc, vc, *args, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        tb.paged_tree_attention(q.half(), kc, vc, *args, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        kc12, vc12 = paged(4, 4, 2, 12)
        tb.paged_tree_attention(torch.randn(3, 4, 12, device=DEV), kc12, vc12, *args, 1.0)
    with pytest.raises(ValueError, match="chunk_parents"):
        tb.paged_tree_attention(q, kc, vc, *args[:3], i32([-1, 0]), 1.0)
    with pytest.raises(ValueError, match="cu_q"):
        tb.paged_tree_attention(q, kc, vc, args[0], args[1], i32([0, 1, 3]), args[3], 1.0)
    with pytest.raises(ValueError, match="pages must be dense"):
        tb.paged_tree_attention(q, kc[:, :2], vc[:, :2], *args, 1.0)
    with pytest.raises(ValueError, match="ancestors"):
        tb.paged_tree_attention(q, kc, vc, *args, 1.0, torch.zeros(1, 1, dtype=torch.int32,
                                                                   device=DEV))
    with pytest.raises(ValueError, match="chunk_parents"):
        tb.tree_ancestors(torch.zeros(2, 3, device=DEV))
    with pytest.raises(ValueError, match="target_ids"):
        tb.accept_greedy(i32([[1, 2]]), i32([[-1, 0]]), i32([[1, 2]]), 2)
    with pytest.raises(ValueError, match="differ"):
        tb.compact_kv(kc.unsqueeze(0), vc.unsqueeze(0), i32([1, 2]), i32([0]))
    with pytest.raises(ValueError, match="k must have shape"):
        tb.write_kv(kc, vc, torch.randn(2, 2, 8, device=DEV), torch.randn(2, 2, 16, device=DEV),
                    i32([0, 1]))


def test_backend_exports_the_dispatch_names_with_reference_signatures():
    import inspect
    from treespec.kernels.dispatch import KERNEL_NAMES
    for name in KERNEL_NAMES:
        ours, theirs = inspect.signature(getattr(tb, name)), inspect.signature(getattr(ref, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    assert math.isclose(attn_mod.LOG2E, 1 / math.log(2))
