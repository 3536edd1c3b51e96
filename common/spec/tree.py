"""Fixed-envelope token trees.

A *tree* hangs `num_nodes` draft nodes off the *root*, the last committed token
(whose KV is not yet written). Node i has a draft token ``tokens[i]`` and a parent
``parents[i]``: -1 is the root, j >= 0 is node j (always j < i, so nodes are in
topological order), and -2 marks padding that attention and acceptance ignore.

Example, ``tree-small``-like, N = 4::

    root ─ a(0) ─ c(2)          tokens  = [a, b, c, d]
         └ b(1) ─ d(3)          parents = [-1, -1, 0, 1]

The *envelope* (depth, topk, num_nodes) is server configuration agreed at
handshake: every proposal is a ``TreeBatch`` of shape [B, num_nodes], so verify
and draft forwards can be captured once per batch bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from treespec.kernels.reference import PAD

ROOT = -1


@dataclass(frozen=True)
class TreeEnvelope:
    depth: int
    topk: int
    num_nodes: int
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.num_nodes < 1:
            raise ValueError(f"envelope needs depth, topk, num_nodes >= 1, got {self}")
        if self.topk == 1 and self.num_nodes != self.depth:
            raise ValueError(f"a chain (topk=1) has num_nodes == depth, got {self}")
        if self.num_nodes < self.depth:
            raise ValueError(f"num_nodes {self.num_nodes} < depth {self.depth}")
        if self.num_nodes > self.max_nodes:
            raise ValueError(
                f"num_nodes {self.num_nodes} exceeds what depth {self.depth} x topk "
                f"{self.topk} expansion can produce ({self.max_nodes})")
        if self.num_nodes > 64:
            raise ValueError("num_nodes is at most 64 (the tree mask is one 64-bit word)")

    @property
    def max_nodes(self) -> int:
        """Candidates an expansion produces: topk at depth 1, topk^2 per later level."""
        return self.topk + (self.depth - 1) * self.topk * self.topk


PRESETS: dict[str, TreeEnvelope] = {
    "chain4": TreeEnvelope(depth=4, topk=1, num_nodes=4, name="chain4"),
    "tree-small": TreeEnvelope(depth=4, topk=2, num_nodes=8, name="tree-small"),
    "tree-wide": TreeEnvelope(depth=5, topk=4, num_nodes=31, name="tree-wide"),
    # a DFlash block of 8 / 16 drafts 7 / 15 positions in one forward: their chain, and
    # (a DFlash drafter's default) the best of each position's top 4 in as many nodes
    "block8": TreeEnvelope(depth=7, topk=1, num_nodes=7, name="block8"),
    "block16": TreeEnvelope(depth=15, topk=1, num_nodes=15, name="block16"),
    "block8-tree": TreeEnvelope(depth=7, topk=4, num_nodes=7, name="block8-tree"),
    "block16-tree": TreeEnvelope(depth=15, topk=4, num_nodes=15, name="block16-tree"),
}


@dataclass
class TreeBatch:
    """One tree per sequence of a batch, rows in the batch's order: what a proposer
    returns, what crosses the hop, what the verify step takes.

    tokens, parents: [B, N] int32 on the host (parents: ROOT, an earlier node or PAD;
    a padding node's token is 0). q_ids, q_probs: [B, N, K] the distribution each
    node's token was drawn from, sparse over K ids (the sampling issue fills them);
    None means every node was chosen deterministically (a one-hot q).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    q_ids: torch.Tensor | None = None
    q_probs: torch.Tensor | None = None

    @classmethod
    def padding(cls, batch: int, num_nodes: int) -> TreeBatch:
        """All-padding rows: no node to verify."""
        return cls(torch.zeros(batch, num_nodes, dtype=torch.int32),
                   torch.full((batch, num_nodes), PAD, dtype=torch.int32))

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def scatter(self, rows: list[int], batch: int) -> TreeBatch:
        """These trees as rows ``rows`` of a batch of ``batch`` rows, the others all
        padding. Returns self when it already is that batch."""
        if rows == list(range(batch)):
            return self
        out = TreeBatch.padding(batch, self.tokens.shape[1])
        for f in fields(self):
            mine = getattr(self, f.name)
            if mine is None:
                continue
            if getattr(out, f.name) is None:
                setattr(out, f.name, mine.new_zeros((batch, *mine.shape[1:])))
            if rows:
                getattr(out, f.name)[rows] = mine
        return out

    def take(self, rows: list[int]) -> TreeBatch:
        """These rows' trees, in this order."""
        return TreeBatch(*(None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                           for f in fields(self)))

    def pruned(self, depth: int) -> TreeBatch:
        """These trees with the nodes deeper than depth made padding (indices kept)."""
        deep = node_depths(self.parents) > depth

        def fill(x: torch.Tensor | None, value: int = 0) -> torch.Tensor | None:
            return None if x is None else x.masked_fill(
                deep.view(*deep.shape, *[1] * (x.dim() - 2)), value)

        return TreeBatch(fill(self.tokens), fill(self.parents, PAD), fill(self.q_ids),
                         fill(self.q_probs))

    def num_valid(self) -> list[int]:
        """Non-padding nodes per row."""
        return (self.parents != PAD).sum(1).tolist()


def budget_depths(env: TreeEnvelope) -> tuple[int, ...]:
    """The budgets' depths, deepest first: the envelope's and its halvings (at most 4)."""
    out: list[int] = []
    d = env.depth
    while d >= 1 and len(out) < 4:
        out.append(d)
        d //= 2
    return tuple(out)


def budget_nodes(env: TreeEnvelope, depth: int) -> int:
    """The nodes of env's trees cut to depth (num_nodes at its own): env's nodes per
    level kept (num_nodes x depth / env.depth, rounded up), so that a shallower budget
    verifies fewer rows, as a chain's does, and no more than depth levels produce."""
    return min(env.num_nodes, env.topk + (depth - 1) * env.topk * env.topk,
               -(-env.num_nodes * depth // env.depth))


def shallower(env: TreeEnvelope, depth: int) -> TreeEnvelope:
    """env cut to depth: its trees' nodes at depths <= depth (env itself at its own)."""
    if depth >= env.depth:
        return env
    return TreeEnvelope(depth, env.topk, budget_nodes(env, depth), f"{env.name}@{depth}")


def cut_depth(trees: TreeBatch, depth: int, width: int) -> tuple[TreeBatch, np.ndarray | None]:
    """trees cut to their nodes at depths <= depth, at most width of them (the first
    in node order: a parent comes before its child, so none loses its parent), packed
    into [B, width]; with each kept node's index in trees ([B, width], -1 past them),
    or None when nothing was cut (trees itself returned)."""
    b, n = trees.parents.shape
    if width == n and depth >= n:       # no tree of n nodes is deeper than n: nothing to cut
        return trees, None
    d = node_depths(trees.parents).numpy()
    keep = (trees.parents.numpy() != PAD) & (d <= depth)
    keep &= np.cumsum(keep, 1) <= width
    if width == n and keep.sum() == (d > 0).sum():
        return trees, None
    pos = np.cumsum(keep, 1) - 1
    r, c = np.nonzero(keep)
    index = np.full((b, width), -1, dtype=np.int64)
    index[r, pos[r, c]] = c
    par = trees.parents.numpy()[r, c]
    parents = np.full((b, width), PAD, dtype=np.int32)
    parents[r, pos[r, c]] = np.where(par >= 0, pos[r, np.clip(par, 0, None)], par)
    src = torch.from_numpy(np.clip(index, 0, None))

    def take(x: torch.Tensor | None, fill: int = 0) -> torch.Tensor | None:
        if x is None:
            return None
        g = torch.gather(x, 1, src.view(b, width, *[1] * (x.dim() - 2)).expand(
            b, width, *x.shape[2:]))
        return g.masked_fill(torch.from_numpy(index < 0).view(b, width, *[1] * (x.dim() - 2)),
                             fill)

    return TreeBatch(take(trees.tokens), torch.from_numpy(parents), take(trees.q_ids),
                     take(trees.q_probs)), index


def envelope_from(name: str | None = None, depth: int | None = None,
                  topk: int | None = None, num_nodes: int | None = None) -> TreeEnvelope:
    """A preset by name, or a custom envelope from all three numbers."""
    if name is not None:
        if any(v is not None for v in (depth, topk, num_nodes)):
            raise ValueError("give an envelope name or depth/topk/nodes, not both")
        if name not in PRESETS:
            raise ValueError(f"unknown envelope {name!r}; presets: {sorted(PRESETS)}")
        return PRESETS[name]
    if depth is None and topk is None and num_nodes is None:
        return PRESETS["chain4"]
    if depth is None or topk is None or num_nodes is None:
        raise ValueError("a custom envelope needs depth, topk and nodes")
    return TreeEnvelope(depth=depth, topk=topk, num_nodes=num_nodes)


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node (root children = 1); padding gets 0.

    parents: [B, N] int -> [B, N] int32, on any device with no host sync. List
    ranking by pointer jumping: each round adds the depth gathered so far at the
    current ancestor and jumps to that ancestor's ancestor, so after r rounds a node
    has counted min(depth, 2**r) nodes of its path and ceil(log2 N) rounds suffice
    (seven small kernels a round inside a CUDA graph).
    """
    n = parents.shape[-1]
    p = parents.long()
    depth = (p != PAD).to(torch.int32)
    anc = torch.where(p >= 0, p, -1)
    for _ in range(max(0, n - 1).bit_length()):
        live = anc >= 0
        safe = anc.clamp(min=0)
        depth = torch.where(live, depth + torch.gather(depth, -1, safe), depth)
        anc = torch.where(live, torch.gather(anc, -1, safe), anc)
    return depth


MAX_Q = 64      # the most entries a node's sparse q may have


def validate_tree(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: int,
                  vocab_size: int, q_ids: torch.Tensor | None = None,
                  q_probs: torch.Tensor | None = None) -> str | None:
    """Why a proposed tree is unusable, or None if it is well formed.

    tokens, parents: [B, N] int32 on the host; q_ids, q_probs [B, N, Q] when sent.
    Checks shape, parent order (a parent comes before its child and is not padding),
    token range and, for q, its shape, ids and probabilities (finite, >= 0). When a
    batch has several flaws, the message names the first kind in that order.
    """
    if tokens.dim() != 2 or tokens.shape != parents.shape or tokens.shape[1] != num_nodes:
        return f"tree tensors must be [B, {num_nodes}], got {tuple(tokens.shape)} / {tuple(parents.shape)}"
    if q_ids is not None:
        if (q_ids.dim() != 3 or q_ids.shape != q_probs.shape
                or q_ids.shape[:2] != tokens.shape or not 1 <= q_ids.shape[2] <= MAX_Q):
            return (f"q tensors must be [B, {num_nodes}, Q <= {MAX_Q}], got "
                    f"{tuple(q_ids.shape)} / {tuple(q_probs.shape)}")
        if ((q_ids < 0) | (q_ids >= vocab_size)).any():
            return f"a q id is outside the vocabulary [0, {vocab_size})"
        if not (torch.isfinite(q_probs) & (q_probs >= 0)).all():
            return "a q probability is negative or not finite"
    p, t = parents.cpu().numpy(), tokens.cpu().numpy()
    bad_parent = (p < PAD) | (p >= np.arange(num_nodes))
    up = p[np.arange(p.shape[0])[:, None], np.clip(p, 0, max(num_nodes - 1, 0))]
    off_pad = (p >= 0) & (up == PAD)
    bad_token = (p != PAD) & ((t < 0) | (t >= vocab_size))
    if not (bad_parent | off_pad | bad_token).any():    # the usual case: one test
        return None
    if bad_parent.any():
        return "a parent index must be -2, -1 or an earlier node"
    if off_pad.any():
        return "a node hangs off a padding node"
    return f"a draft token is outside the vocabulary [0, {vocab_size})"


def verify_chunk_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward chunk [root, node 0 .. N-1] of a batch of trees.

    parents [B, N] -> (chunk_parents [B, N + 1], depths [B, N + 1]) where chunk
    index 0 is the root (parent -1, depth 0) and node i sits at chunk index i + 1
    (parent p + 1, or 0 under the root; padding stays -2). depths are position
    offsets from the root. See kernels/reference.py for the chunk layout.
    """
    b, dev = parents.shape[0], parents.device
    p = parents.to(torch.int32)
    nodes = torch.where(p == PAD, PAD, p + 1)            # a root child's parent: 0
    root = torch.full((b, 1), ROOT, dtype=torch.int32, device=dev)
    zero = torch.zeros((b, 1), dtype=torch.int32, device=dev)
    return torch.cat([root, nodes], 1), torch.cat([zero, node_depths(parents)], 1)
