"""The Triton tree attention's invariant mode (issue 53): the output of a query row at
position p is bit for bit the same as a one-row decode, among other sequences' decode
rows at several places, as the last row of a prefill chunk, and as a depth-3 tree node
whose ancestors have siblings between them, at contexts up to 300 keys and several key
chunk sizes; the default mode (the control) is shown to break at least one of these on
the same inputs. Under the interpreter (tests/triton_interpret.py); on a GPU,
bench/attention_invariance_gpu.py checks the same at the Qwen3-8B shape.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from treespec.kernels import reference as ref
from triton_interpret import DEV, HAVE_TRITON, load as _load, needs_triton

pytestmark = needs_triton

if HAVE_TRITON:
    _load("treespec.kernels.triton_common")
    attn = _load("treespec.kernels.triton_tree_attention")
    inv = _load("treespec.kernels.triton_invariant")

HQ, HKV, D, BS = 4, 1, 16, 16           # GROUP 4, as Qwen3-8B's 32 / 8
TREE = [-1, 0, 0, 2, 2, 4, 4]           # [root, x, a, y, b, z, c]: c at depth 3 via a, b
PATH = [0, 2, 4, 6]                     # root, a, b, c


def _attend(entries: list[tuple], dtype: torch.dtype, seed: int, **kw) -> list[torch.Tensor]:
    """entries: (keys, values [ctx + t, kv_heads, D] by slot, ctx, chunk parents [t],
    q [t, q_heads, D]), laid out in one shuffled paged cache and attended in one call;
    returns each entry's output rows."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-k.shape[0] // BS) for k, *_ in entries]
    pages = torch.randperm(sum(need) + 2, generator=g).tolist()
    kc = torch.randn(len(pages), BS, HKV, D, generator=g).to(DEV, dtype)
    vc = torch.randn_like(kc)
    width = max(need) + 2          # the table wider than the live pages, as a page bucket
    table = torch.full((len(entries), width), pages[-1], dtype=torch.int32)
    at = 0
    for i, (k, v, *_) in enumerate(entries):
        mine = torch.tensor(pages[at:at + need[i]])
        at += need[i]
        table[i, :need[i]] = mine
        slots = (mine.repeat_interleave(BS)[:k.shape[0]] * BS
                 + torch.arange(k.shape[0]) % BS).to(DEV)
        kc.view(-1, HKV, D)[slots] = k.to(DEV)
        vc.view(-1, HKV, D)[slots] = v.to(DEV)
    lens = [len(e[3]) for e in entries]
    cu = torch.tensor([0] + lens).cumsum(0).to(DEV, torch.int32)
    ctx = torch.tensor([e[2] for e in entries], dtype=torch.int32, device=DEV)
    par = torch.tensor([x for e in entries for x in e[3]], dtype=torch.int32, device=DEV)
    q = torch.cat([e[4] for e in entries]).to(DEV)
    out = attn.paged_tree_attention(q, kc, vc, table.to(DEV), ctx, cu, par, D ** -0.5, **kw)
    return list(out.split(lens))


def _cases(dtype: torch.dtype, positions: tuple[int, ...],
           kinds: tuple[str, ...] = ("batch", "prefill", "tree"), **kw) -> dict[str, list[bool]]:
    """For each position p: its row alone (a), among 5 decode rows (b: at places 1, 3,
    4 and 0, 2, 3), as a prefill chunk's last row (c) and as the tree node c (d): per
    case of kinds, whether each equals (a) bitwise."""
    g = torch.Generator().manual_seed(len(positions) * 1000 + positions[-1])
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)
    kv = {p: (rnd(p + 1, HKV, D), rnd(p + 1, HKV, D), rnd(1, HQ, D)) for p in positions}
    others = [(rnd(n + 1, HKV, D), rnd(n + 1, HKV, D), n, [-1], rnd(1, HQ, D))
              for n in (40, 250, 7, 131)]
    decode = {p: (k, v, p, [-1], q) for p, (k, v, q) in kv.items()}
    alone = {p: _attend([decode[p]], dtype, p, **kw)[0][0] for p in positions}
    res: dict[str, list[bool]] = {kind: [] for kind in kinds}
    targets = list(positions)
    for places in ((1, 3, 4), (0, 2, 3)) if "batch" in kinds else ():
        where, rest = dict(zip(places, targets)), iter(others)
        out = _attend([decode[where[i]] if i in where else next(rest) for i in range(5)],
                      dtype, 7, **kw)
        for i, p in zip(places, targets):
            res["batch"].append(torch.equal(out[i][0], alone[p]))
    chunks = []
    for p in positions if "prefill" in kinds else ():
        k, v, q = kv[p]
        c0 = p - 17 if p > 17 else 0
        chunks.append((k, v, c0, list(range(-1, p - c0)), torch.cat([rnd(p - c0, HQ, D), q])))
    if chunks:
        out = _attend([others[0]] + chunks, dtype, 8, **kw)
        res["prefill"] = [torch.equal(o[-1], alone[p]) for o, p in zip(out[1:], positions)]
    trees = [others[2]]
    for p in positions if "tree" in kinds else ():
        k, v, q = kv[p]
        ctx = p - 3
        tk, tv = rnd(ctx + 7, HKV, D), rnd(ctx + 7, HKV, D)
        tk[:ctx], tv[:ctx] = k[:ctx], v[:ctx]
        tk[[ctx + j for j in PATH]], tv[[ctx + j for j in PATH]] = k[ctx:], v[ctx:]
        tq = rnd(7, HQ, D)
        tq[6] = q[0]
        trees.append((tk, tv, ctx, TREE, tq))
    if trees[1:]:
        out = _attend(trees, dtype, 9, **kw)
        res["tree"] = [torch.equal(o[6], alone[p]) for o, p in zip(out[1:], positions)]
    return res


@pytest.mark.parametrize("dtype,split_keys,positions", [
    (torch.float32, 64, (66, 130, 257)),     # a tree's ancestors across chunk boundaries
    (torch.float32, 256, (5, 300)),
    (torch.bfloat16, 128, (257, 300)),
])
def test_a_row_is_the_same_alone_in_a_batch_in_a_prefill_and_in_a_tree(dtype, split_keys,
                                                                       positions):
    res = _cases(dtype, positions, invariant=True, split_keys=split_keys)
    n = len(positions)
    assert res == {"batch": [True] * 2 * n, "prefill": [True] * n, "tree": [True] * n}, res


def test_the_default_mode_is_not_invariant():
    """Control, same construction: the default mode plans its context split from the
    batch and reads a tree's chunk keys by chunk index; its tree node's row moves (so
    does the prefill chunk's last row, at 10 x this test's time)."""
    assert _cases(torch.float32, (130,), ("tree",)) == {"tree": [False]}


def _random_batch(dtype: torch.dtype, g: torch.Generator, kv_heads: int = 2):
    """Decode, a padded tree, a prefill chain, an empty chunk, a tree, BLOCK rows; GROUP 4."""
    from test_triton_kernels import as_chunk, build_batch, paged, random_tree
    chunks = [[-1], as_chunk(random_tree(9, g, pad=2)), list(range(-1, 10)), [],
              as_chunk(random_tree(5, g)), [-1, -3, -3, -2]]
    nb, table, ctx, cu, par = build_batch(chunks, [70, 7, 0, 4, 140, 20], 8, 3, g)
    kc, vc = paged(nb, 8, kv_heads, D, dtype, seed=1)
    q = torch.randn(int(cu[-1]), 4 * kv_heads, D, generator=g).to(DEV, dtype)
    return q, kc, vc, table, ctx, cu, par


@pytest.mark.parametrize("dtype,tol,kv_heads", [(torch.float32, 2e-5, 2),
                                                (torch.bfloat16, 2e-2, 1)])
def test_invariant_mode_matches_the_reference_and_its_split_changes_no_bit(dtype, tol,
                                                                           kv_heads):
    """One program per key chunk (partials folded by a second kernel) and one program
    folding them all in registers: the same bits; both the reference's values."""
    args = _random_batch(dtype, torch.Generator().manual_seed(3), kv_heads)
    want = ref.paged_tree_attention(*args, 0.25)
    one = attn.paged_tree_attention(*args, 0.25, invariant=True, split=False, split_keys=64)
    per_chunk = attn.paged_tree_attention(*args, 0.25, invariant=True, split=True,
                                          split_keys=64)
    assert torch.equal(one, per_chunk)
    torch.testing.assert_close(one.float(), want.float(), atol=tol, rtol=tol)


def test_the_invariant_backend_runs_the_invariant_attention(monkeypatch):
    seen = []
    real = attn.paged_tree_attention
    monkeypatch.setattr(inv, "_paged_tree_attention",
                        lambda *a, **k: seen.append(k) or real(*a, **k))
    q, kc, vc, table, ctx, cu, par = _random_batch(torch.float32,
                                                   torch.Generator().manual_seed(4))
    inv.paged_tree_attention(q[:1], kc, vc, table[:1], ctx[:1], cu[:2], par[:1], 0.25)
    assert seen == [{"invariant": True}]
    sig = [list(inspect.signature(f).parameters)
           for f in (inv.paged_tree_attention, ref.paged_tree_attention)]
    assert sig[0] == sig[1]


def test_refuses_a_chunk_size_off_the_tile():
    q, kc, vc, table, ctx, cu, par = _random_batch(torch.float32,
                                                   torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match="split_keys"):
        attn.paged_tree_attention(q, kc, vc, table, ctx, cu, par, 0.25, invariant=True,
                                  split_keys=96)
