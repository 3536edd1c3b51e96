"""protobuf <-> common types for the Drafter hop; both servicers use these."""

from __future__ import annotations

import torch

from treespec.common.wire import codec
from treespec.common.spec.sampling import SamplingParams
from treespec.common.wire.shared_buffer import SharedBuffer
from treespec.common.spec.messages import (DrafterInfo, Lookahead, SeqUpdate, SpecRequest,
                                           SpecResponse)
from treespec.common.spec.tree import TreeBatch, TreeEnvelope
from treespec.protos.treespec.v1 import treespec_pb2 as pb


def envelope_to_pb(e: TreeEnvelope) -> pb.TreeEnvelope:
    return pb.TreeEnvelope(name=e.name, depth=e.depth, topk=e.topk, num_nodes=e.num_nodes)


def envelope_from_pb(m: pb.TreeEnvelope) -> TreeEnvelope:
    return TreeEnvelope(depth=m.depth, topk=m.topk, num_nodes=m.num_nodes, name=m.name or "custom")


def drafter_info_to_pb(i: DrafterInfo) -> pb.DrafterInfo:
    return pb.DrafterInfo(envelope=envelope_to_pb(i.envelope), vocab_size=i.vocab_size,
                          proposer=i.proposer, target_hidden_layers=list(i.target_hidden_layers),
                          model=i.model, max_model_len=i.max_model_len,
                          projected_width=i.projected_width, lookahead=i.lookahead,
                          prefix_block_size=i.prefix_block_size)


def drafter_info_from_pb(m: pb.DrafterInfo) -> DrafterInfo:
    return DrafterInfo(envelope=envelope_from_pb(m.envelope), vocab_size=m.vocab_size,
                       proposer=m.proposer, target_hidden_layers=tuple(m.target_hidden_layers),
                       model=m.model, max_model_len=m.max_model_len,
                       projected_width=m.projected_width, lookahead=m.lookahead,
                       prefix_block_size=m.prefix_block_size)


def spec_request_to_pb(r: SpecRequest, shared: SharedBuffer | None = None
                       ) -> pb.SpeculateRequest:
    """shared: the connection's shared buffer, for hidden states placed in it."""
    m = pb.SpeculateRequest(step_id=r.step_id, released=r.released,
                            trace_context=r.trace_context, max_depth=r.max_depth)
    add = m.sequences.add        # built in place: no per-sequence message copy
    for u in r.seqs:
        s = add(seq_id=u.seq_id, committed_len=u.committed_len, new_tokens=u.new_tokens,
                full=u.full, accepted_nodes=u.accepted_nodes,
                accepted_step_id=u.accepted_step_id, lookahead_hit=u.lookahead_hit,
                lookahead=u.lookahead, cached_len=u.cached_len)
        if u.hidden is not None:
            s.hidden_states.CopyFrom(codec.encode(u.hidden, shared))
        if u.sampling is not None:
            p = u.sampling
            s.sampling.CopyFrom(pb.SamplingParams(temperature=p.temperature, top_k=p.top_k,
                                                  top_p=p.top_p, min_p=p.min_p, seed=p.seed))
            s.rejection_sampling = u.rejection
    return m


def spec_request_from_pb(m: pb.SpeculateRequest, shared: SharedBuffer | None = None
                         ) -> SpecRequest:
    seqs = [SeqUpdate(seq_id=u.seq_id, committed_len=u.committed_len,
                      new_tokens=list(u.new_tokens), full=u.full,
                      accepted_nodes=list(u.accepted_nodes),
                      accepted_step_id=u.accepted_step_id,
                      hidden=codec.decode(u.hidden_states, shared=shared)
                      if u.HasField("hidden_states") else None,
                      sampling=_sampling(u.sampling) if u.HasField("sampling") else None,
                      rejection=u.rejection_sampling, lookahead_hit=u.lookahead_hit,
                      lookahead=u.lookahead, cached_len=u.cached_len)
            for u in m.sequences]
    return SpecRequest(step_id=m.step_id, seqs=seqs, released=list(m.released),
                       trace_context=dict(m.trace_context), max_depth=m.max_depth)


def _sampling(m: pb.SamplingParams) -> SamplingParams:
    """A resolved SamplingParams (InvalidRequest naming a field out of range)."""
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=m.top_p,
                          min_p=m.min_p, seed=m.seed)


def response_to_pb(r: SpecResponse) -> pb.Proposal:
    t = r.trees
    m = pb.Proposal(step_id=r.step_id, seq_ids=r.seq_ids,
                    tokens=codec.encode(t.tokens.to(torch.int32)),
                    parents=codec.encode(t.parents.to(torch.int32)), resync=r.resync,
                    lost_prefix=r.lost_prefix)
    if t.q_ids is not None:
        m.q_ids.CopyFrom(codec.encode(t.q_ids.to(torch.int32)))
        m.q_probs.CopyFrom(codec.encode(t.q_probs.to(torch.float32)))
    return m


def lookahead_to_pb(r: Lookahead) -> pb.Proposal:
    m = pb.Proposal(step_id=r.step_id, seq_ids=r.seq_ids, lookahead=True,
                    tokens=codec.encode(r.trees.tokens.to(torch.int32)),
                    parents=codec.encode(r.trees.parents.to(torch.int32)))
    m.lookahead_keys.CopyFrom(codec.encode(r.keys.to(torch.int32)))
    return m


def lookahead_from_pb(m: pb.Proposal, per_seq: int) -> Lookahead:
    """Raises codec.CodecError on tensors that are not int32 of [len(seq_ids) * per_seq,
    ...] rows."""
    tokens = codec.decode(m.tokens, expect_dtype=torch.int32)
    parents = codec.decode(m.parents, expect_dtype=torch.int32)
    keys = codec.decode(m.lookahead_keys, expect_dtype=torch.int32)
    rows = len(m.seq_ids) * per_seq
    if tokens.dim() != 2 or tokens.shape != parents.shape or tokens.shape[0] != rows \
            or keys.dim() != 2 or keys.shape[0] != rows:
        raise codec.CodecError(f"lookahead of {len(m.seq_ids)} sequences x {per_seq} "
                               f"candidates with tensors {tuple(tokens.shape)}, "
                               f"{tuple(parents.shape)}, {tuple(keys.shape)}")
    return Lookahead(m.step_id, list(m.seq_ids), TreeBatch(tokens, parents), keys)


def response_from_pb(m: pb.Proposal) -> SpecResponse:
    """Raises codec.CodecError on tensors that are not int32 of matching shape."""
    tokens = codec.decode(m.tokens, expect_dtype=torch.int32)
    parents = codec.decode(m.parents, expect_dtype=torch.int32)
    trees = TreeBatch(tokens, parents)
    if m.HasField("q_ids"):
        trees.q_ids = codec.decode(m.q_ids, expect_dtype=torch.int32)
        trees.q_probs = codec.decode(m.q_probs, expect_dtype=torch.float32)
    return SpecResponse(step_id=m.step_id, seq_ids=list(m.seq_ids), trees=trees,
                        resync=list(m.resync), lost_prefix=list(m.lost_prefix))
