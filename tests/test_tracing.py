"""Traces through two real gRPC servers in-process: one trace per Generate request
holds the spans of both services in parent/child order, and the per-step accept
attributes add up to the client's stats."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from treespec.common.serving import telemetry
from treespec.common.client import AsyncTreespecClient, build_request
from treespec.common.spec.tree import envelope_from
from treespec.draft_service import server as draft_server
from treespec.draft_service.config import DraftConfig
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc
from treespec.verify_service import server as verify_server
from treespec.verify_service.config import VerifyConfig
from treespec.verify_service.observer import NullObserver

PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5, 9, 13], [3, 4, 5, 6], [10, 20, 30, 40, 10, 20]]
MAX_TOKENS = 12
TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
TRACEPARENT = f"00-{TRACE_ID:032x}-b7ad6b7169203331-01"


def _provider(name: str):
    provider = telemetry.new_provider(name)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@contextlib.asynccontextmanager
async def traced_services(target, method, draft_model, envelope):
    dprov, dexp = _provider(telemetry.DRAFT_SERVICE_NAME)
    vprov, vexp = _provider(telemetry.VERIFY_SERVICE_NAME)
    dcfg = DraftConfig(method=method, envelope=envelope_from(envelope),
                       model=str(draft_model) if draft_model else None, device="cpu")
    draft, dport, _ = await draft_server.start(dcfg, tracer_provider=dprov)
    vcfg = VerifyConfig(model=str(target), draft=f"127.0.0.1:{dport}", device="cpu",
                        num_blocks=256, block_size=4, reconnect_s=0.2, step_deadline_ms=5000,
                        speculation="always")
    verify, vport, engine = await verify_server.start(vcfg, tracer_provider=vprov)
    try:
        for _ in range(200):
            if engine.link.ready:
                break
            await asyncio.sleep(0.02)
        yield f"127.0.0.1:{vport}", vexp, dexp
    finally:
        await verify.stop(0.5)
        await engine.stop()
        await engine.link.close()
        await draft.stop(0.5)
        dprov.shutdown()
        vprov.shutdown()


async def _generate_with_traceparent(addr: str, prompt: list[int]) -> dict:
    """A raw call carrying W3C `traceparent` metadata, as an instrumented client would."""
    async with grpc.aio.insecure_channel(addr) as ch:
        call = pb_grpc.GenerationStub(ch).Generate(
            build_request(prompt_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True),
            metadata=(("traceparent", TRACEPARENT),))
        last = None
        async for m in call:
            last = m
    return {k: getattr(last.stats, k) for k in ("steps", "draft_tokens", "accepted_tokens",
                                               "fallback_steps", "completion_tokens")}


async def _run(target, method, draft_model, envelope):
    async with traced_services(target, method, draft_model, envelope) as (addr, vexp, dexp):
        first = await _generate_with_traceparent(addr, PROMPTS[0])
        async with AsyncTreespecClient(addr) as c:
            alone = await c.generate(prompt_ids=PROMPTS[1], max_tokens=MAX_TOKENS,
                                     ignore_eos=True)
            together = await asyncio.gather(*[
                c.generate(prompt_ids=p, max_tokens=MAX_TOKENS, ignore_eos=True)
                for p in PROMPTS])
    return ([first, alone.stats, *[o.stats for o in together]],
            vexp.get_finished_spans(), dexp.get_finished_spans())


def _by_id(spans):
    return {s.context.span_id: s for s in spans}


def _children(spans, parent, name=None):
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id
            and (name is None or s.name == name)]


@pytest.fixture(scope="module")
def traced(target_dir):
    return asyncio.run(_run(target_dir, "model", target_dir, "tree-small"))


def test_one_trace_per_request_spans_both_services(traced):
    stats, vspans, dspans = traced
    requests = [s for s in vspans if s.name == "treespec.v1.Generation/Generate"]
    assert len(requests) == len(stats)
    assert all(s.kind == SpanKind.SERVER for s in requests)
    assert {s.resource.attributes["service.name"] for s in vspans} == {"treespec-verify"}
    assert {s.resource.attributes["service.name"] for s in dspans} == {"treespec-draft"}
    # the first call sent a traceparent: its request span continues that trace
    assert requests[0].context.trace_id == TRACE_ID
    assert requests[0].parent.span_id == 0xB7AD6B7169203331
    assert len({s.context.trace_id for s in requests}) == len(requests)

    drafts = _by_id(dspans)
    for req in requests[:2]:      # run alone: every step of theirs is in their own trace
        tid = req.context.trace_id
        steps = _children(vspans, req, "treespec.step")
        assert steps and len(_children(vspans, req, "treespec.prefill")) == 1
        joined = 0
        for step in steps:
            assert step.context.trace_id == tid
            assert step.start_time >= req.start_time and step.end_time <= req.end_time
            kids = {s.name for s in _children(vspans, step)}
            assert {"treespec.verify", "treespec.accept"} <= kids
            for hop in _children(vspans, step, "treespec.draft"):
                assert hop.kind == SpanKind.CLIENT
                remote = [s for s in drafts.values() if s.parent is not None
                          and s.parent.span_id == hop.context.span_id]
                assert len(remote) == 1 and remote[0].name == "treespec.draft.step"
                assert remote[0].context.trace_id == tid
                assert remote[0].attributes["treespec.step_id"] == step.attributes["treespec.step_id"]
                assert [s.name for s in _children(dspans, remote[0])] == ["treespec.draft.propose"]
                # what the draft proposed for this sequence is what the target was offered
                row = list(remote[0].attributes["treespec.seq_ids"]).index(
                    req.attributes["treespec.seq_id"])
                assert remote[0].attributes["treespec.proposed_tokens"][row] == \
                    step.attributes["treespec.drafted_tokens"][0]
                joined += 1
        assert joined == len(steps), "every step asked the draft"
        env = steps[0].attributes
        e = envelope_from("tree-small")
        assert (env["treespec.envelope"], env["treespec.envelope.depth"],
                env["treespec.envelope.num_nodes"]) == (e.name, e.depth, e.num_nodes)


def test_step_attributes_add_up_to_client_stats(traced):
    stats, vspans, _ = traced
    requests = [s for s in vspans if s.name == "treespec.v1.Generation/Generate"]
    steps = [s for s in vspans if s.name == "treespec.step"]
    assert len(requests) == len(stats)
    batched = 0
    for req, st in zip(requests, stats):
        seq_id = req.attributes["treespec.seq_id"]
        rid = req.context.span_id
        mine = [s for s in steps if s.parent.span_id == rid
                or any(link.context.span_id == rid for link in s.links)]
        batched += sum(s.parent.span_id != rid for s in mine)
        rows = [(s.attributes, list(s.attributes["treespec.seq_ids"]).index(seq_id))
                for s in mine]
        assert len(rows) == st["steps"]
        assert sum(a["treespec.drafted_tokens"][i] for a, i in rows) == st["draft_tokens"]
        assert sum(a["treespec.accepted_tokens"][i] for a, i in rows) == st["accepted_tokens"]
        assert sum(a["treespec.fallback"][i] != "" for a, i in rows) == st["fallback_steps"]
        assert sum(a["treespec.committed_tokens"][i] for a, i in rows) == \
            st["completion_tokens"] - 1
        assert all(a["treespec.accepted_depth"][i] >= a["treespec.accepted_tokens"][i]
                   for a, i in rows)
        assert req.attributes["treespec.stats.accepted_tokens"] == st["accepted_tokens"]
        assert req.attributes["treespec.finish_reason"] == "length"
    assert batched > 0, "the concurrent requests shared steps (linked, not parented)"
    assert sum(st["accepted_tokens"] for st in stats) > 0


def test_tracing_is_off_unless_configured(target_dir, monkeypatch):
    for var in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert telemetry.tracer_provider_from_env("x") is None
    engine, _ = verify_server.build_engine(VerifyConfig(model=str(target_dir), device="cpu",
                                                        num_blocks=8, block_size=4))
    assert isinstance(engine.observer, NullObserver)

    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}
    assert telemetry.tracing_configured(on)
    assert telemetry.tracing_configured({"OTEL_TRACES_EXPORTER": "console"})
    assert not telemetry.tracing_configured({**on, "OTEL_TRACES_EXPORTER": "none"})
    assert not telemetry.tracing_configured({**on, "OTEL_SDK_DISABLED": "true"})
    assert not telemetry.tracing_configured({})


def test_service_name_defaults_and_env_override(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert telemetry.new_provider("treespec-draft").resource.attributes["service.name"] \
        == "treespec-draft"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "draft-gpu0")
    assert telemetry.new_provider("treespec-draft").resource.attributes["service.name"] \
        == "draft-gpu0"
