"""The Speculate stream on the draft's local Unix socket (common/wire/frames.py).

Real services, real sockets: the verify service takes the socket when the draft
advertises one it can reach, and gRPC otherwise; output is the same greedy output
on either carrier; a malformed message over the socket gets the same
INVALID_ARGUMENT the gRPC stream gives and the draft keeps serving; a socket that
answers with another instance id is refused."""

from __future__ import annotations

import asyncio
import os
import struct

import grpc
import pytest

from treespec.common.wire import frames, convert as wire
from treespec.common.client import AsyncTreespecClient
from treespec.common.spec.messages import SeqUpdate
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.server import start
from inproc import greedy_reference, services
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from test_draft_servicer import ENV, full, req

PROMPT = [1, 5, 9, 13, 2, 7, 1, 5, 9, 13, 2]
MAX_TOKENS = 16


@pytest.mark.parametrize("draft_socket, local_socket, carrier", [
    ("auto", "auto", "unix socket"),
    ("auto", "path", "unix socket"),
    ("auto", None, "unix socket"),                  # both defaults
    ("off", "auto", "grpc"),
    ("auto", "off", "grpc"),
])
def test_carrier_choice_is_lossless(target_dir, tmp_path, draft_socket, local_socket, carrier):
    if local_socket == "path":
        local_socket = str(tmp_path / "draft.sock")
    draft_kw = {}
    if local_socket is not None:
        draft_kw["local_socket"] = local_socket

    async def go():
        # steps polled from the loop, as on a GPU
        async with services(target_dir, "model", target_dir, "chain4",
                            draft_kw=draft_kw, draft_socket=draft_socket, busy_poll="on") as h:
            assert h["engine"].link.carrier == carrier
            async with AsyncTreespecClient(h["addr"]) as c:
                out = await c.generate(prompt_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
            return out, h["engine"].kv_pages_used

    out, used = asyncio.run(go())
    assert out.token_ids == greedy_reference(target_dir, PROMPT, MAX_TOKENS)
    assert out.stats["fallback_steps"] == 0 and out.stats["accepted_tokens"] > 0
    assert used == 0
    if local_socket and local_socket.endswith(".sock"):
        assert not os.path.exists(local_socket)     # removed when the draft stopped


def _serve(cfg: DraftConfig, body) -> None:
    async def main():
        server, port, engine = await start(cfg)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                info = await pb_grpc.DrafterStub(ch).GetInfo(pb.DrafterInfoRequest())
                await body(info)
        finally:
            await server.stop(None)
    asyncio.run(main())


async def _open(info: pb.DrafterInfo) -> frames.FrameStream:
    return await frames.FrameStream.open(info.local_socket, info.instance_id,
                                         pb.Proposal.FromString)


async def _raw(info: pb.DrafterInfo, data: bytes) -> tuple[str, str]:
    """Send raw bytes after the hello; the error frame's (code, message)."""
    reader, writer = await asyncio.open_unix_connection(frames.os_address(info.local_socket))
    try:
        assert (await frames.read_frame(reader))[0] == frames.HELLO
        writer.write(data)
        while (frame := await frames.read_frame(reader)) is not None:
            if frame[0] == frames.ERROR:
                code, _, message = frame[1].decode().partition("\n")
                return code, message
        raise AssertionError("the stream ended without an error frame")
    finally:
        writer.close()


def _frame(msg: pb.SpeculateRequest) -> bytes:
    return b"".join(frames.pack(frames.MESSAGE, msg.SerializeToString()))


@pytest.mark.parametrize("data, message", [
    (_frame(req(5, [full(1, [1])])) + _frame(req(3, [SeqUpdate(1, 2, [2])])),
     "step_id 3 after 5"),
    (_frame(req(1, [SeqUpdate(1, committed_len=-1, new_tokens=[])])), "committed_len -1 < 1"),
    (b"".join(frames.pack(frames.MESSAGE, b"\xff\xff\xff")), "undecodable SpeculateRequest"),
    (struct.pack("<IB", 0, 9), "unknown frame kind 9"),
    (struct.pack("<IB", frames.MAX_FRAME_BYTES + 1, frames.MESSAGE), "exceeds"),
    (b"".join(frames.pack(frames.HELLO, b"x")), "expected a SpeculateRequest frame"),
])
def test_malformed_frames_end_the_stream_with_invalid_argument(data, message):
    async def body(info):
        code, details = await _raw(info, data)
        assert code == "INVALID_ARGUMENT" and message in details
        s = await _open(info)                       # the draft still serves a new stream
        try:
            await s.write(req(100, [full(7, [4, 4])]))
            assert (await anext(aiter(s))).step_id == 100
        finally:
            s.cancel()

    _serve(DraftConfig(method="ngram", envelope=ENV, local_socket="auto"), body)


async def _proposals(carrier: str, steps: list[pb.SpeculateRequest]) -> list:
    """Each step's proposal from a fresh draft, by gRPC or the socket."""
    cfg = DraftConfig(method="ngram", envelope=ENV,
                      local_socket="off" if carrier == "grpc" else "auto")
    server, port, _ = await start(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DrafterStub(ch)
            info = await stub.GetInfo(pb.DrafterInfoRequest())
            assert info.instance_id and bool(info.local_socket) == (carrier != "grpc")
            if carrier == "grpc":
                return [wire.response_from_pb(p) async for p in stub.Speculate(_iter(steps))]
            s = await frames.FrameStream.open(info.local_socket, info.instance_id,
                                              pb.Proposal.FromString)
            replies = aiter(s)
            try:
                out = []
                for m in steps:
                    await s.write(m)
                    out.append(wire.response_from_pb(await anext(replies)))
                return out
            finally:
                s.cancel()
    finally:
        await server.stop(None)


async def _iter(msgs):
    for m in msgs:
        yield m


def test_the_stream_over_the_socket_matches_grpc():
    """The same steps on two fresh drafts, one per carrier, give the same proposals."""
    steps = [req(1, [full(1, [1, 2, 3, 1, 2]), full(2, [9])]),
             req(2, [SeqUpdate(1, 7, [3, 1]), SeqUpdate(2, 2, [9])]),
             req(3, [SeqUpdate(2, 9, [9])], released=[1])]
    by_socket = asyncio.run(_proposals("socket", steps))
    by_grpc = asyncio.run(_proposals("grpc", steps))
    assert len(by_socket) == len(by_grpc) == 3
    for a, b in zip(by_socket, by_grpc):
        assert (a.step_id, a.seq_ids, a.resync) == (b.step_id, b.seq_ids, b.resync)
        assert a.trees.tokens.tolist() == b.trees.tokens.tolist()
        assert a.trees.parents.tolist() == b.trees.parents.tolist()


def test_a_socket_of_another_instance_is_refused():
    async def body(info):
        with pytest.raises(frames.FrameError, match="another draft instance"):
            await frames.FrameStream.open(info.local_socket, "not-" + info.instance_id,
                                          pb.Proposal.FromString)

    _serve(DraftConfig(method="ngram", envelope=ENV, local_socket="auto"), body)


def test_bad_local_socket_flag_is_refused():
    with pytest.raises(ValueError, match="--local-socket"):
        DraftConfig(method="ngram", envelope=ENV, local_socket="@")
