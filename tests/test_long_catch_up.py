"""A long sequence's catch-up on the draft: memory linear in its length, trees unchanged.

A new or resynced sequence goes through the drafter PREFILL_UNITS units a forward, and
the CPU reference takes a long chunk's attention queries in tiles (TILE_SCORES), so no
[chunk, context] scores are held at once. The 8,000-token catch-up runs in a child
process whose peak RSS (VmHWM) counts from a warmed-up engine, not from this one's
history.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treespec.common.model.paths import SHIPPED_DIR
from treespec.common.spec.tree import envelope_from
from treespec.draft_service import kv_drafter
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.eagle3_proposer import Eagle3Proposer
from treespec.draft_service.model_proposer import ModelProposer
from treespec.kernels import reference, reference_attention

DRAFT = SHIPPED_DIR / "tiny-code-draft"
HEAD = SHIPPED_DIR / "tiny-code-eagle3"
# Two forwards of PREFILL_UNITS (4096); caught up in one forward, untiled, the same
# 8,000 tokens grow the child by ~2.7 GB (134 MB as served; 145 MB at 20,000 tokens)
LONG = 8_000

CHILD = """
import json, sys
import torch
torch.set_num_threads(1)
from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.common.spec.tree import envelope_from
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.engine import DraftEngine

def peak_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

model, n = sys.argv[1], int(sys.argv[2])
eng = DraftEngine(DraftConfig(method="model", model=model, envelope=envelope_from("tree-small"),
                              device="cpu"))
toks = torch.randint(1, 6000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
eng.step(SpecRequest(step_id=1, seqs=[SeqUpdate(1, 300, toks[:300], full=True)]))
before = peak_kb()
out = eng.step(SpecRequest(step_id=2, seqs=[SeqUpdate(1, n, toks, full=True)]))
print(json.dumps({"grew_mb": (peak_kb() - before) / 1024, "resync": out.resync,
                  "root_children": int((out.trees.parents[0] == -1).sum())}))
"""


@pytest.fixture(scope="module")
def long_draft(tmp_path_factory) -> Path:
    """tiny-code-draft's weights under a config that allows 32k positions."""
    d = tmp_path_factory.mktemp("tiny-code-draft-32k")
    for f in DRAFT.iterdir():
        (d / f.name).symlink_to(f)
    (d / "config.json").unlink()
    cfg = json.loads((DRAFT / "config.json").read_text())
    cfg["max_position_embeddings"] = 32768
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_an_8000_token_catch_up_stays_within_300_mb(long_draft, tmp_path):
    proc = subprocess.run([sys.executable, "-P", "-c", CHILD, str(long_draft), str(LONG)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["resync"] == [] and got["root_children"] >= 1, got
    assert got["grew_mb"] < 300, got


def _trees(proposer, seqs: dict[int, list[int]]) -> tuple[list, list]:
    for s, toks in seqs.items():
        proposer.update(s, toks, len(toks), [], None)
    t = proposer.propose(list(seqs))
    return t.tokens.tolist(), t.parents.tolist()


@pytest.mark.parametrize("method", ["model", "eagle3"])
def test_chunked_and_tiled_catch_up_drafts_what_one_forward_does(method, monkeypatch):
    """The same trees after a catch-up in one forward and one in forwards of 64 units
    whose attention goes 16 query rows a tile."""
    def trees():
        cls, path = (ModelProposer, DRAFT) if method == "model" else (Eagle3Proposer, HEAD)
        p = cls.from_config(DraftConfig(method=method, model=str(path), device="cpu",
                                        envelope=envelope_from("tree-small"), num_blocks=256,
                                        block_size=4, target_embeddings="tiny-code"))
        g = torch.Generator().manual_seed(6)
        return _trees(p, {1: torch.randint(1, 6000, (300,), generator=g).tolist(),
                          2: torch.randint(1, 6000, (150,), generator=g).tolist()})
    whole = trees()
    monkeypatch.setattr(kv_drafter, "PREFILL_UNITS", 64)
    monkeypatch.setattr(reference_attention, "TILE_SCORES", 16 * 4 * 301)
    assert trees() == whole


def _chunks(g: torch.Generator, hq: int, hkv: int) -> tuple:
    """paged_tree_attention's arguments for a chain of 37 after 21 context slots, a tree
    of 9 with two padding nodes and a block of 16 (pages shuffled)."""
    lens, ctx, bs, d = [37, 9, 16], [21, 0, 5], 4, 16
    tree = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                for i in range(1, 9)])
    tree[[3, 7]] = reference.PAD
    parents = torch.cat([torch.arange(-1, 36), tree, torch.full((16,), reference.BLOCK)])
    need = [-(-(c + t) // bs) for c, t in zip(ctx, lens)]
    perm = torch.randperm(sum(need), generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    for b, at in enumerate(itertools.accumulate([0] + need[:-1])):
        tables[b, :need[b]] = perm[at:at + need[b]]
    kv = [torch.randn(sum(need), bs, hkv, d, generator=g) for _ in range(2)]
    return (torch.randn(sum(lens), hq, d, generator=g), *kv, tables,
            torch.tensor(ctx, dtype=torch.int32),
            torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32),
            parents.to(torch.int32), 0.25)


@pytest.mark.parametrize("hq, hkv", [(4, 2), (2, 2)])
def test_reference_attention_in_row_tiles_equals_one_piece(hq, hkv, monkeypatch):
    """Tiles of 1, 5 and 16 query rows (of the longest chunk) give the one-piece result."""
    args = _chunks(torch.Generator().manual_seed(hq), hq, hkv)
    whole = reference.paged_tree_attention(*args)
    for rows in (1, 5, 16):
        monkeypatch.setattr(reference_attention, "TILE_SCORES", rows * hq * (21 + 37))
        torch.testing.assert_close(reference.paged_tree_attention(*args), whole,
                                   atol=1e-6, rtol=1e-6)
