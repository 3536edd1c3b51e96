"""common/serving/grpc_server.py: error mapping, health, reflection, and a real process's stop."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from treespec.common.wire import codec
from treespec.common.serving.errors import InvalidRequest, Unavailable
from treespec.common.serving.grpc_server import start_server
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
DRAFTER = "treespec.v1.Drafter"


class Faulty(pb_grpc.DrafterServicer):
    """GetInfo raises what its model name asks for; Speculate echoes, then raises."""

    def __init__(self) -> None:
        self.raise_next: Exception | None = None

    async def GetInfo(self, request, context):
        if self.raise_next is not None:
            raise self.raise_next
        return pb.DrafterInfo(proposer="fake")

    async def Speculate(self, request_iterator, context):
        async for req in request_iterator:
            if req.step_id == 99:
                raise InvalidRequest("step 99 is cursed")
            yield pb.Proposal(step_id=req.step_id)


async def _with_server(body, reflect: bool = True) -> None:
    servicer = Faulty()
    server, port = await start_server(
        "127.0.0.1", 0, lambda s: pb_grpc.add_DrafterServicer_to_server(servicer, s), [DRAFTER],
        reflect=reflect)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await body(ch, servicer)
    finally:
        await server.stop(None)


def test_errors_map_to_status_codes():
    async def body(ch, servicer):
        stub = pb_grpc.DrafterStub(ch)
        assert (await stub.GetInfo(pb.DrafterInfoRequest())).proposer == "fake"
        cases = [(InvalidRequest("bad seq 3"), grpc.StatusCode.INVALID_ARGUMENT, "bad seq 3"),
                 (codec.CodecError("bad dtype"), grpc.StatusCode.INVALID_ARGUMENT, "bad dtype"),
                 (Unavailable("no pages"), grpc.StatusCode.UNAVAILABLE, "no pages"),
                 (RuntimeError("boom"), grpc.StatusCode.INTERNAL, "RuntimeError: boom")]
        for exc, code, details in cases:
            servicer.raise_next = exc
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetInfo(pb.DrafterInfoRequest())
            assert err.value.code() == code
            assert err.value.details() == details

        held = asyncio.Event()

        async def reqs():
            for step in (1, 2, 99):
                yield pb.SpeculateRequest(step_id=step)
            # Hold the stream open: grpc.aio turns a client write that races the server's
            # status into INTERNAL ("Internal error from Core"), hiding the real code.
            await held.wait()

        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for p in stub.Speculate(reqs()):
                got.append(p.step_id)
        held.set()
        assert got == [1, 2]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cursed" in err.value.details()

    asyncio.run(_with_server(body))


def test_health_and_reflection():
    async def body(ch, servicer):
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", DRAFTER):
            r = await h.Check(health_pb2.HealthCheckRequest(service=name))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.Check(health_pb2.HealthCheckRequest(service="nope.Service"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        watch = h.Watch(health_pb2.HealthCheckRequest(service=DRAFTER))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()

        refl = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        names = [s.name async for r in refl.ServerReflectionInfo(ask())
                 for s in r.list_services_response.service]
        assert DRAFTER in names
        assert "grpc.health.v1.Health" in names
        assert "grpc.reflection.v1alpha.ServerReflection" in names

    asyncio.run(_with_server(body))


def test_undecodable_messages_are_invalid_argument():
    """Bytes that are no protobuf of the method's type: INVALID_ARGUMENT naming the
    method, for a unary call and inside a stream (not a deserializer traceback)."""
    async def body(ch, servicer):
        garbage = b"\xff\xff\xff\xff"
        info = ch.unary_unary(f"/{DRAFTER}/GetInfo")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await info(garbage)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undecodable GetInfo request" in err.value.details()

        async def frames():
            yield pb.SpeculateRequest(step_id=1).SerializeToString()
            yield garbage

        speculate = ch.stream_stream(f"/{DRAFTER}/Speculate")
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for raw in speculate(frames()):
                got.append(pb.Proposal.FromString(raw).step_id)
        assert got == [1] and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "undecodable Speculate request" in err.value.details()

    asyncio.run(_with_server(body))


def test_reflection_is_off_where_asked_and_by_default_off_loopback():
    async def body(ch, servicer):
        async def ask():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        with pytest.raises(grpc.aio.AioRpcError) as err:
            [r async for r in reflection_pb2_grpc.ServerReflectionStub(ch)
             .ServerReflectionInfo(ask())]
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED

    asyncio.run(_with_server(body, reflect=False))
    from treespec.common.serving.config import ServiceConfig
    assert ServiceConfig(host="127.0.0.1").reflect and ServiceConfig(host="::1").reflect
    assert not ServiceConfig(host="0.0.0.0").reflect
    assert not ServiceConfig(host="10.1.2.3").reflect
    assert ServiceConfig(host="0.0.0.0", reflection="on").reflect
    assert not ServiceConfig(host="127.0.0.1", reflection="off").reflect


SERVE_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from treespec.common.serving.grpc_server import run_server, start_server
    from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

    async def start():
        return await start_server("127.0.0.1", 0,
            lambda s: pb_grpc.add_DrafterServicer_to_server(pb_grpc.DrafterServicer(), s),
            ["treespec.v1.Drafter"])

    async def on_stop():
        print("on_stop ran", flush=True)

    run_server(start, "127.0.0.1", on_stop=on_stop, grace_s=1.0)
    print("stopped", flush=True)
""")


def test_run_server_prints_address_first_and_stops_gracefully():
    proc = subprocess.Popen([sys.executable, "-P", "-c", SERVE_SCRIPT], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().strip()
        assert first.startswith("listening on 127.0.0.1:"), first
        port = int(first.rsplit(":", 1)[1])

        async def check():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
                assert r.status == health_pb2.HealthCheckResponse.SERVING

        asyncio.run(check())
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.split() == ["on_stop", "ran", "stopped"]
