"""Our Qwen3 over paged KV equals transformers.Qwen3ForCausalLM (fp32, rel err < 1e-4)
in prefill, decode and tree-verify forwards."""

from __future__ import annotations

import torch
from transformers import Qwen3ForCausalLM

from treespec.common.runtime.forward_batch import Chunk, build_forward_batch, chain_chunk
from treespec.common.runtime.kv_cache import SeqPages
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.spec.tree import node_depths
from treespec.kernels import reference as ops


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_prefill_and_decode_match_transformers(target_dir):
    ours = Qwen3Model.from_pretrained(target_dir)
    hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cache = ours.new_cache(num_blocks=32, block_size=4)
    prompts = [[1, 5, 9, 13, 2, 7, 7, 30, 31], [3, 4, 5]]  # ragged batch over pages
    seqs = [SeqPages() for _ in prompts]
    fb = build_forward_batch([chain_chunk(s, p) for s, p in zip(seqs, prompts)], cache)
    hidden, _ = ours(fb, cache, ops)
    logits = ours.logits(hidden)
    for b, p in enumerate(prompts):
        lo = int(fb.cu_q[b])
        assert rel_err(logits[lo:lo + len(p)], hf_logits(hf, p)) < 1e-4
        seqs[b].kv_len = len(p)
    # three decode steps, batched
    for step in range(3):
        nxt = [int(logits[int(fb.last[b])].argmax()) for b in range(len(prompts))]
        for b in range(len(prompts)):
            prompts[b] = prompts[b] + [nxt[b]]
        fb = build_forward_batch([Chunk(s, [t], [-1], [0]) for s, t in zip(seqs, nxt)], cache)
        logits = ours.logits(ours(fb, cache, ops)[0])
        for b, p in enumerate(prompts):
            assert rel_err(logits[b], hf_logits(hf, p)[-1]) < 1e-4
            seqs[b].kv_len += 1
    assert cache.blocks.num_used > 0


def test_tree_forward_equals_causal_forward_on_each_branch(target_dir):
    """Branch test: a node's logits equal plain causal logits over its root path."""
    ours = Qwen3Model.from_pretrained(target_dir)
    hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cache = ours.new_cache(num_blocks=32, block_size=4)
    prompt = [1, 5, 9, 13, 2, 7]
    seq = SeqPages()
    ours(build_forward_batch([chain_chunk(seq, prompt[:-1])], cache), cache, ops)
    seq.kv_len = len(prompt) - 1
    root = prompt[-1]
    tokens = [11, 12, 21, 22, 31, 40, 41]
    parents = [-1, -1, 0, 0, 2, -2, 1]  # node 5 is padding
    chunk_parents = [-1] + [p + 1 if p >= 0 else (0 if p == -1 else -2) for p in parents]
    depth = node_depths(torch.tensor([parents]))[0].tolist()
    fb = build_forward_batch([Chunk(seq, [root] + tokens, chunk_parents, [0] + depth)], cache)
    logits = ours.logits(ours(fb, cache, ops)[0])
    assert rel_err(logits[0], hf_logits(hf, prompt)[-1]) < 1e-4
    for i, p in enumerate(parents):
        if p == -2:
            continue
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        ref = hf_logits(hf, prompt + path[::-1])[-1]
        assert rel_err(logits[i + 1], ref) < 1e-4, f"node {i}"
