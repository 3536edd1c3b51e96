"""The Speculate stream on the draft's local Unix socket (common/frames.py).

Real services, real sockets: the verify service takes the socket when the draft
advertises one it can reach, and gRPC otherwise; output is the same greedy output
on either carrier; a malformed message over the socket gets the same
INVALID_ARGUMENT the gRPC stream gives and the draft keeps serving; a socket that
answers with another instance id is refused."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import grpc
import pytest

from common import frames, wire
from common.client import AsyncTreespecClient
from common.spec_types import SeqUpdate
from draft_service.config import DraftConfig
from draft_service.server import start
from inproc import greedy_reference, services
from protos.treespec.v1 import treespec_pb2 as pb
from protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from test_draft_servicer import ENV, full, req

PROMPT = [1, 5, 9, 13, 2, 7, 1, 5, 9, 13, 2]
MAX_TOKENS = 16


@pytest.mark.parametrize("draft_socket, local_socket, carrier, draft_busy", [
    ("socket", "auto", "unix socket", "auto"),
    ("socket", "path", "unix socket", "auto"),
    ("off", "auto", "grpc", "auto"),
    ("auto", "off", "grpc", "auto"),
    ("auto", None, "unix socket + mailbox", "on"),   # both defaults (the verify busy polls)
    ("mailbox", "auto", "unix socket + mailbox", "auto"),   # the draft woken by frames
    ("mailbox", "auto", "unix socket + mailbox", "on"),     # the draft polls the mailbox
    ("mailbox", "off", "grpc", "auto"),
])
def test_carrier_choice_is_lossless(target_dir, tmp_path, draft_socket, local_socket, carrier,
                                    draft_busy):
    if local_socket == "path":
        local_socket = str(tmp_path / "draft.sock")
    draft_kw = {"busy_poll": draft_busy}
    if local_socket is not None:
        draft_kw["local_socket"] = local_socket
    before = _shm_files()

    async def go():
        # fixed steps, polled from the loop, as on a GPU
        async with services(target_dir, "model", target_dir, "chain4",
                            draft_kw=draft_kw, draft_socket=draft_socket,
                            step_mode="fixed", busy_poll="on") as h:
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
    assert _shm_files() <= before                   # no mailbox file left behind


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


async def _proposals(carrier: str, steps: list[pb.SpeculateRequest], draft_busy: str = "auto",
                     waiting: bool = False) -> list:
    """Each step's proposal from a fresh draft, by gRPC, the socket or its mailbox
    (waiting: this side says it polls, so answers come back through the mailbox too)."""
    cfg = DraftConfig(method="ngram", envelope=ENV, busy_poll=draft_busy,
                      local_socket="off" if carrier == "grpc" else "auto")
    server, port, _ = await start(cfg)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.DrafterStub(ch)
            info = await stub.GetInfo(pb.DrafterInfoRequest())
            assert info.instance_id and bool(info.local_socket) == (carrier != "grpc")
            if carrier == "grpc":
                return [wire.tree_batch_from_pb(p) async for p in stub.Speculate(_iter(steps))]
            s = await frames.FrameStream.open(info.local_socket, info.instance_id,
                                              pb.Proposal.FromString,
                                              mailbox=carrier == "mailbox")
            s.waiting(waiting)
            replies = aiter(s)
            framed = None                # a read of the next framed answer, when waiting
            try:
                out = []
                for m in steps:
                    await s.write(m)
                    if waiting:          # as DraftLink does: the mailbox, or a frame
                        framed = framed or asyncio.ensure_future(anext(replies))
                        async with asyncio.timeout(5):
                            while (got := s.poll()) is None and not framed.done():
                                await asyncio.sleep(0)
                        if got is None:
                            got, framed = framed.result(), None
                    else:
                        got = await anext(replies)
                    out.append(wire.tree_batch_from_pb(got))
                if s.mailbox is not None:           # what travelled through it, each way
                    out.append((s.mailbox._sent[0], s.mailbox._seen[1]))
                return out
            finally:
                if framed is not None:
                    framed.cancel()
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
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()


def test_a_socket_of_another_instance_is_refused():
    async def body(info):
        with pytest.raises(frames.FrameError, match="another draft instance"):
            await frames.FrameStream.open(info.local_socket, "not-" + info.instance_id,
                                          pb.Proposal.FromString)

    _serve(DraftConfig(method="ngram", envelope=ENV, local_socket="auto"), body)


def test_bad_local_socket_flag_is_refused():
    with pytest.raises(ValueError, match="--local-socket"):
        DraftConfig(method="ngram", envelope=ENV, local_socket="@")


def test_a_refused_mailbox_leaves_the_socket(target_dir, monkeypatch):
    """A draft that cannot make a mailbox (no /dev/shm in its container) ends that
    connection; the verify service reconnects on the socket alone, not on gRPC."""
    from common.mailbox import Mailbox

    def no_shm(*args, **kwargs):
        raise OSError("no /dev/shm here")
    monkeypatch.setattr(Mailbox, "create", no_shm)

    async def go():
        async with services(target_dir, "model", target_dir, "chain4",
                            draft_kw={"busy_poll": "on"}, step_mode="fixed",
                            busy_poll="on") as h:
            carrier = h["engine"].link.carrier
            async with AsyncTreespecClient(h["addr"]) as c:
                out = await c.generate(prompt_ids=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True)
            return carrier, out
    carrier, out = asyncio.run(go())
    assert carrier == "unix socket"
    assert out.token_ids == greedy_reference(target_dir, PROMPT, MAX_TOKENS)


def _shm_files() -> set:
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if "treespec" in p.name} if shm.exists() else set()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
@pytest.mark.parametrize("draft_busy, waiting", [("off", False), ("off", True), ("on", True)])
def test_the_stream_through_the_mailbox_matches_grpc(monkeypatch, draft_busy, waiting):
    """Requests through the mailbox (woken by a frame when the draft does not spin),
    answers through it while this side waits polling, else as frames; a message
    larger than its slot (the first full sync here) takes the socket. Same proposals
    as gRPC, and no shared-memory file is left behind."""
    import common.mailbox
    monkeypatch.setattr(common.mailbox, "SLOT_BYTES", 200)
    steps = [req(1, [full(1, [1, 2, 3] * 100 + [1, 2, 5, 6, 7, 1, 2]), full(2, [9])]),
             req(2, [SeqUpdate(1, 308, [3]), SeqUpdate(2, 2, [9])]),
             req(3, [SeqUpdate(2, 3, [9])], released=[1]),
             req(4, [SeqUpdate(2, 4, [9])])]
    before = _shm_files()
    *by_mailbox, (requests, answers) = asyncio.run(_proposals("mailbox", steps, draft_busy,
                                                               waiting))
    by_grpc = asyncio.run(_proposals("grpc", steps))
    assert len(by_mailbox) == len(by_grpc) == 4
    # all but the 300-token first sync went through the mailbox, answers too when waiting
    assert requests == 3 and answers == (4 if waiting else 0)
    for a, b in zip(by_mailbox, by_grpc):
        assert (a.step_id, a.seq_ids, a.resync) == (b.step_id, b.seq_ids, b.resync)
        assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert _shm_files() <= before
