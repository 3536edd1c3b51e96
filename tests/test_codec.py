"""Tensors and Drafter messages survive the wire: common/wire/codec.py and common/wire/convert.py."""

from __future__ import annotations

import os

import pytest
import torch

from treespec.common.wire import codec, convert as wire
from treespec.common.wire.shared_buffer import SHM_DIR, SharedBuffer
from treespec.common.spec.messages import DrafterInfo, SeqUpdate, SpecRequest, SpecResponse
from treespec.common.spec.tree import PRESETS, TreeBatch, TreeEnvelope
from treespec.protos.treespec.v1 import treespec_pb2 as pb


def pb_trip(msg):
    """Serialize and parse, as the hop does."""
    return type(msg).FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.bfloat16,
                                   torch.float16])
@pytest.mark.parametrize("shape", [(3, 5), (1,), (2, 1, 4), (2, 3, 1, 5)])
def test_round_trip_keeps_values_shape_and_dtype(dtype, shape):
    g = torch.Generator().manual_seed(7)
    src = (torch.randn(shape, generator=g) * 100).to(dtype)
    msg = pb_trip(codec.encode(src))
    assert msg.dtype == codec.NAMES[dtype]
    assert list(msg.shape) == list(shape)
    assert len(msg.data) == src.numel() * src.element_size()
    out = codec.decode(msg)
    assert out.dtype == dtype and out.shape == src.shape
    assert torch.equal(out, src)


def test_zero_dim_tensor_round_trip():
    src = torch.tensor(3.5)
    out = codec.decode(codec.encode(src))
    assert out.shape == () and float(out) == 3.5


def test_bfloat16_bits_are_exact():
    src = torch.tensor([1.0, -2.5, 3.0e38, 1e-38, float("inf")], dtype=torch.bfloat16)
    out = codec.decode(pb_trip(codec.encode(src)))
    assert torch.equal(out.view(torch.int16), src.view(torch.int16))


@pytest.mark.parametrize("shape", [(0,), (4, 0), (0, 3, 2)])
def test_empty_tensors(shape):
    src = torch.empty(shape, dtype=torch.int32)
    msg = codec.encode(src)
    assert msg.data == b""
    out = codec.decode(pb_trip(msg))
    assert out.shape == src.shape and out.dtype == torch.int32


def test_non_contiguous_input_is_sent_in_logical_order():
    src = torch.arange(12, dtype=torch.int32).view(3, 4).t()
    assert torch.equal(codec.decode(codec.encode(src)), src)


def test_decoded_tensor_is_writable_and_independent_of_the_message():
    msg = codec.encode(torch.zeros(4, dtype=torch.float32))
    out = codec.decode(msg)
    out += 1
    assert torch.equal(codec.decode(msg), torch.zeros(4))


@pytest.mark.parametrize("size", [0, 11, 13])
def test_wrong_byte_count_is_a_codec_error(size):
    msg = pb.Tensor(dtype="float32", shape=[3], data=b"\0" * size)
    with pytest.raises(codec.CodecError, match="needs 12 bytes"):
        codec.decode(msg)


def test_unknown_dtype_is_a_codec_error():
    with pytest.raises(codec.CodecError, match="unknown tensor dtype 'complex64'"):
        codec.decode(pb.Tensor(dtype="complex64", shape=[1], data=b"\0" * 8))
    with pytest.raises(codec.CodecError, match="unknown tensor dtype ''"):
        codec.decode(pb.Tensor())


def test_wrong_expected_dtype_is_a_codec_error():
    msg = codec.encode(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(codec.CodecError, match="expected a int32 tensor, got int64"):
        codec.decode(msg, expect_dtype=torch.int32)


def test_negative_shape_is_a_codec_error():
    with pytest.raises(codec.CodecError, match="negative"):
        codec.decode(pb.Tensor(dtype="int32", shape=[-1], data=b""))


def test_unencodable_dtype_is_a_codec_error():
    with pytest.raises(codec.CodecError, match="cannot travel"):
        codec.encode(torch.zeros(2, dtype=torch.bool))


def test_codec_error_is_a_value_error():
    assert issubclass(codec.CodecError, ValueError)


def test_spec_request_round_trip():
    hidden = torch.randn(2, 6).to(torch.bfloat16)
    req = SpecRequest(step_id=41, seqs=[
        SeqUpdate(seq_id=7, committed_len=12, new_tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
                  full=True),
        SeqUpdate(seq_id=2**63 + 5, committed_len=30, new_tokens=[5, 6], accepted_nodes=[0, 2],
                  accepted_step_id=40, hidden=hidden),
    ], released=[3, 9])
    out = wire.spec_request_from_pb(pb_trip(wire.spec_request_to_pb(req)))
    assert out.step_id == 41 and out.released == [3, 9]
    a, b = out.seqs
    assert (a.seq_id, a.committed_len, a.full, a.accepted_nodes, a.hidden) == (7, 12, True, [], None)
    assert a.new_tokens == list(range(1, 13))
    assert (b.seq_id, b.committed_len, b.new_tokens) == (2**63 + 5, 30, [5, 6])
    assert (b.accepted_nodes, b.accepted_step_id, b.full) == ([0, 2], 40, False)
    assert b.hidden is not None and b.hidden.dtype == torch.bfloat16
    assert torch.equal(b.hidden, hidden)


def test_tree_batch_round_trip_casts_to_int32():
    tokens = torch.tensor([[11, 12, 21, 22], [5, 0, 0, 0]], dtype=torch.int64)
    parents = torch.tensor([[-1, -1, 0, 1], [-1, -2, -2, -2]], dtype=torch.int64)
    tb = SpecResponse(step_id=3, seq_ids=[7, 8], trees=TreeBatch(tokens, parents), resync=[8])
    msg = pb_trip(wire.response_to_pb(tb))
    assert msg.tokens.dtype == "int32" and list(msg.tokens.shape) == [2, 4]
    out = wire.response_from_pb(msg)
    assert (out.step_id, out.seq_ids, out.resync) == (3, [7, 8], [8])
    out = out.trees
    assert out.tokens.dtype == torch.int32 and out.parents.dtype == torch.int32
    assert torch.equal(out.tokens, tokens.int()) and torch.equal(out.parents, parents.int())


def test_tree_batch_with_wrong_dtype_is_refused():
    msg = wire.response_to_pb(SpecResponse(step_id=1, seq_ids=[1], trees=TreeBatch(
        tokens=torch.zeros(1, 4), parents=torch.full((1, 4), -1))))
    msg.tokens.CopyFrom(codec.encode(torch.zeros(1, 4, dtype=torch.float32)))
    with pytest.raises(codec.CodecError, match="int32"):
        wire.response_from_pb(msg)


@pytest.mark.parametrize("envelope", [*PRESETS.values(), TreeEnvelope(3, 2, 5)])
def test_drafter_info_round_trip(envelope):
    info = DrafterInfo(envelope=envelope, vocab_size=151936, proposer="eagle3",
                       target_hidden_layers=(2, 17, 33), model="/ckpt/eagle3")
    assert wire.drafter_info_from_pb(pb_trip(wire.drafter_info_to_pb(info))) == info


def test_drafter_info_defaults_round_trip():
    info = DrafterInfo(envelope=PRESETS["chain4"], vocab_size=96, proposer="ngram")
    out = wire.drafter_info_from_pb(pb_trip(wire.drafter_info_to_pb(info)))
    assert out == info and out.target_hidden_layers == () and out.model == ""


@pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm here")
def test_hidden_states_cross_in_the_shared_buffer_as_offsets():
    """The same-host carrier: the verify places a step's states in the draft's buffer
    and sends offsets; the draft reads the same values from its own mapping. A
    shared tensor on a connection without a buffer, or outside it, is refused."""
    draft_side = SharedBuffer.create(1 << 16)
    verify_side = SharedBuffer.attach(draft_side.path, pin=False)
    try:
        rows = torch.randn(7, 24).to(torch.bfloat16)
        a, b = verify_side.place(rows).split([3, 4])
        req = SpecRequest(5, [SeqUpdate(1, 3, [1, 2, 3], full=True, hidden=a),
                              SeqUpdate(2, 9, [4, 5, 6, 7], hidden=b)])
        msg = pb_trip(wire.spec_request_to_pb(req, verify_side))
        assert [u.hidden_states.shared_offset for u in msg.sequences] == [0, 3 * 24 * 2]
        assert all(not u.hidden_states.data for u in msg.sequences)
        got = wire.spec_request_from_pb(msg, draft_side)
        assert torch.equal(torch.cat([u.hidden for u in got.seqs]), rows)
        assert torch.equal(codec.decode(codec.encode(rows)), rows)   # elsewhere: bytes
        with pytest.raises(codec.CodecError, match="without one"):
            wire.spec_request_from_pb(msg)
        far = pb.Tensor(dtype="bfloat16", shape=[2, 24], shared_offset=(1 << 16) - 32)
        with pytest.raises(codec.CodecError, match="outside"):
            codec.decode(far, shared=draft_side)
    finally:
        draft_side.unlink()
        verify_side.close()
        draft_side.close()
    assert not os.path.exists(draft_side.path)
