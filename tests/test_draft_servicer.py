"""The Drafter service through a real grpc.aio server on 127.0.0.1, port 0."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from treespec.common.wire import convert as wire
from treespec.common.spec.messages import SeqUpdate, SpecRequest
from treespec.common.spec.tree import PAD, envelope_from, validate_tree
from treespec.draft_service.config import DraftConfig
from treespec.draft_service.server import SERVICE_NAME, start
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
ENV = envelope_from("tree-small")


def serve(cfg: DraftConfig, body) -> None:
    async def main():
        server, port, engine = await start(cfg)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await body(ch, engine)
        finally:
            await server.stop(None)
    asyncio.run(main())


async def stream(stub, msgs: list[pb.SpeculateRequest]) -> list[pb.Proposal]:
    async def gen():
        for m in msgs:
            yield m
    return [p async for p in stub.Speculate(gen())]


def req(step: int, seqs: list[SeqUpdate], released: list[int] = ()) -> pb.SpeculateRequest:
    return wire.spec_request_to_pb(SpecRequest(step_id=step, seqs=seqs, released=list(released)))


def proposal(msg: pb.Proposal) -> SimpleNamespace:
    """A Proposal's fields, its trees' tensors among them."""
    r = wire.response_from_pb(msg)
    return SimpleNamespace(step_id=r.step_id, seq_ids=r.seq_ids, resync=r.resync,
                           tokens=r.trees.tokens, parents=r.trees.parents)


def full(seq_id: int, tokens: list[int]) -> SeqUpdate:
    return SeqUpdate(seq_id, committed_len=len(tokens), new_tokens=list(tokens), full=True)


def test_info_stream_health_reflection():
    async def body(ch, engine):
        stub = pb_grpc.DrafterStub(ch)
        info = wire.drafter_info_from_pb(await stub.GetInfo(pb.DrafterInfoRequest()))
        assert info.envelope == ENV and info.proposer == "ngram"

        out = await stream(stub, [
            req(1, [full(1, [1, 2, 3, 1, 2]), full(2, [9])]),
            req(2, [SeqUpdate(1, 7, [3, 1]), SeqUpdate(2, 2, [9])]),
            req(3, [SeqUpdate(2, 9, [9]), SeqUpdate(1, 8, [2])]),        # 2: wrong length
            req(4, [full(2, [9, 9, 9])], released=[1]),
        ])
        trees = [proposal(p) for p in out]
        assert [t.step_id for t in trees] == [1, 2, 3, 4]
        assert [t.seq_ids for t in trees] == [[1, 2], [1, 2], [2, 1], [2]]
        assert [t.resync for t in trees] == [[], [], [2], []]
        for t in trees:
            assert validate_tree(t.tokens, t.parents, ENV.num_nodes, 96) is None
        assert trees[0].tokens[0, :2].tolist() == [3, 1]     # 1 2 -> 3 1 2
        assert (trees[2].parents[0] == PAD).all()
        assert engine.num_sequences == 1

        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            r = await h.Check(health_pb2.HealthCheckRequest(service=name))
            assert r.status == health_pb2.HealthCheckResponse.SERVING

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE_NAME)
        replies = [r async for r in reflection_pb2_grpc.ServerReflectionStub(ch)
                   .ServerReflectionInfo(ask())]
        assert SERVICE_NAME in [s.name for s in replies[0].list_services_response.service]
        assert replies[1].file_descriptor_response.file_descriptor_proto

    serve(DraftConfig(method="ngram", envelope=ENV), body)


@pytest.mark.parametrize("msgs, message", [
    ([req(1, [SeqUpdate(1, committed_len=-1, new_tokens=[])])], "committed_len -1 < 1"),
    ([req(5, [full(1, [1])]), req(5, [SeqUpdate(1, 2, [2])])], "step_id 5 after 5"),
    ([req(5, [full(1, [1])]), req(3, [SeqUpdate(1, 2, [2])])], "step_id 3 after 5"),
    ([req(1, [full(1, [1]), full(1, [1])])], "twice"),
    ([pb.SpeculateRequest(step_id=1, sequences=[pb.SequenceUpdate(
        seq_id=1, committed_len=1, new_tokens=[1], full=True,
        hidden_states=pb.Tensor(dtype="float32", shape=[1, 4], data=b"\0" * 3))])], "bytes"),
])
def test_malformed_requests_end_the_stream_with_invalid_argument(msgs, message):
    async def body(ch, engine):
        stub = pb_grpc.DrafterStub(ch)
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for p in stub.Speculate(_iter(msgs)):
                got.append(p.step_id)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()
        assert len(got) == len(msgs) - 1
        # the service is still fine for a new stream
        out = await stream(stub, [req(100, [full(7, [4, 4])])])
        assert out[0].step_id == 100

    serve(DraftConfig(method="ngram", envelope=ENV), body)


async def _iter(msgs):
    for m in msgs:
        yield m


def test_model_method_over_grpc(draft_dir):
    cfg = DraftConfig(method="model", model=str(draft_dir), envelope=ENV, device="cpu",
                      kernels="reference", num_blocks=64, block_size=4)

    async def body(ch, engine):
        stub = pb_grpc.DrafterStub(ch)
        info = await stub.GetInfo(pb.DrafterInfoRequest())
        assert info.vocab_size == 96 and info.proposer == "model"
        first = proposal((await stream(stub, [req(1, [full(1, [1, 2, 3])])]))[0])
        node0 = int(first.tokens[0, 0])
        # a second stream continues the same engine state
        out = await stream(stub, [req(2, [SeqUpdate(1, 5, [node0, 8], accepted_nodes=[0],
                                                     accepted_step_id=1)])])
        t = proposal(out[0])
        assert t.resync == [] and validate_tree(t.tokens, t.parents, ENV.num_nodes, 96) is None
        assert (t.parents != PAD).all()

    serve(cfg, body)


RUN_SCRIPT = textwrap.dedent("""
    from treespec.common.spec.tree import envelope_from
    from treespec.draft_service.config import DraftConfig
    from treespec.draft_service.server import run
    run(DraftConfig(method="ngram", envelope=envelope_from("chain4"), port=0))
""")


@pytest.mark.parametrize("method", ["ngram", "model"])
def test_light_proposers_step_on_the_event_loop_others_on_the_worker(method, draft_dir):
    """The n-gram proposer's step (host work of microseconds) runs on the server's
    event-loop thread; a model's runs on the engine's worker thread."""
    import threading

    cfg = DraftConfig(method=method, model=str(draft_dir) if method == "model" else None,
                      envelope=ENV, device="cpu")
    threads: list[str] = []

    async def body(ch, engine):
        propose = engine.proposer.propose

        def spy(seq_ids, sampling=None):
            threads.append(threading.current_thread().name)
            return propose(seq_ids, sampling)
        engine.proposer.propose = spy
        loop_thread = threading.current_thread().name
        got = await stream(pb_grpc.DrafterStub(ch), [req(1, [full(1, [1, 2, 3, 1, 2])])])
        assert len(got) == 1 and threads
        on_loop = all(t == loop_thread for t in threads)
        assert on_loop == (method == "ngram"), (threads, loop_thread)
    serve(cfg, body)


def test_run_serves_until_sigterm():
    proc = subprocess.Popen([sys.executable, "-P", "-c", RUN_SCRIPT], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.readline().strip()
        assert first.startswith("listening on 127.0.0.1:"), first
        port = int(first.rsplit(":", 1)[1])

        async def check():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                info = await pb_grpc.DrafterStub(ch).GetInfo(pb.DrafterInfoRequest())
                assert info.envelope.name == "chain4"

        asyncio.run(check())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err


def test_a_warm_up_ping_is_answered_empty_and_touches_no_state():
    """An empty SpeculateRequest is a ping (see the proto): an empty Proposal under the
    same step id, no engine step; the steps around it are served as usual."""
    async def body(ch, engine):
        stub = pb_grpc.DrafterStub(ch)
        out = await stream(stub, [req(1, [full(1, [1, 2, 3, 1, 2])]),
                                  pb.SpeculateRequest(step_id=2), req(3, [SeqUpdate(1, 6, [3])])])
        ping = out[1]
        assert [p.step_id for p in out] == [1, 2, 3]
        assert not ping.seq_ids and not ping.HasField("tokens") and not ping.HasField("parents")
        assert ping.sent_unix_ns >= ping.received_unix_ns > 0
        last = proposal(out[2])
        assert last.resync == [] and last.tokens[0, 0].item() == 1       # 1 2 3 1 2 3 -> 1
        assert engine.num_sequences == 1
    serve(DraftConfig(method="ngram", envelope=ENV), body)
