"""Property-based fuzzing (hypothesis, bounded in examples and time) of what both
services do with bytes a peer sends: random and mutated protobufs through each
servicer's decoding and validation, and random frames on the local socket's reader.
Whatever arrives, the outcome is an answer or the client's error (InvalidRequest,
CodecError, a protobuf DecodeError, FrameError): never another exception, and the
draft keeps no state for a refused request."""

from __future__ import annotations

import asyncio

from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec.common.wire import codec, frames, convert as wire
from treespec.common.serving.errors import InvalidRequest
from treespec.common.spec.tree import envelope_from
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.engine import DraftEngine
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.verify_service.request import check_request
from treespec.verify_service.servicer import check_fields, request_from_pb

FUZZ = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
CLIENT_ERRORS = (InvalidRequest, codec.CodecError, DecodeError, frames.FrameError)

VALID_SPEC = pb.SpeculateRequest(step_id=3, sequences=[
    pb.SequenceUpdate(seq_id=1, committed_len=4, new_tokens=[1, 2, 3, 4], full=True),
    pb.SequenceUpdate(seq_id=2, committed_len=5, new_tokens=[9], accepted_nodes=[0])],
    released=[7]).SerializeToString()
VALID_GEN = pb.GenerateRequest(prompt_ids=[1, 2, 3], max_tokens=8, stop_token_ids=[5],
                               request_id="r1").SerializeToString()


def mutated(valid: bytes):
    """valid with bytes flipped, cut, or spliced with noise."""
    return st.one_of(
        st.binary(max_size=512),
        st.tuples(st.integers(0, len(valid) - 1), st.integers(0, 255)).map(
            lambda p: valid[:p[0]] + bytes([p[1]]) + valid[p[0] + 1:]),
        st.integers(0, len(valid)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, len(valid)), st.binary(max_size=64)).map(
            lambda p: valid[:p[0]] + p[1] + valid[p[0]:]))


def _draft_engine() -> DraftEngine:
    return DraftEngine(DraftConfig(method="ngram", envelope=envelope_from("chain4"),
                                   device="cpu", max_model_len=4096))


ENGINE = _draft_engine()


@FUZZ
@given(mutated(VALID_SPEC))
def test_the_draft_answers_or_refuses_any_speculate_bytes(data):
    try:
        req = wire.spec_request_from_pb(pb.SpeculateRequest.FromString(data))
        ENGINE.step(req)
    except CLIENT_ERRORS:
        assert ENGINE.num_sequences == 0          # a refused request leaves nothing
    finally:
        ENGINE.release(list(ENGINE._seqs))


@FUZZ
@given(mutated(VALID_GEN))
def test_the_verify_answers_or_refuses_any_generate_bytes(data):
    try:
        m = pb.GenerateRequest.FromString(data)
        check_fields(m, 96, 1 << 16, None)
        check_request(request_from_pb(m, tuple(m.prompt_ids)), 96, 64)
    except CLIENT_ERRORS:
        return


@FUZZ
@given(st.binary(max_size=256))
def test_the_local_socket_reader_refuses_any_broken_frame(data):
    async def read():
        r = asyncio.StreamReader()
        r.feed_data(data)
        r.feed_eof()
        while await frames.read_frame(r) is not None:
            pass
    try:
        asyncio.run(read())
    except frames.FrameError:
        pass
