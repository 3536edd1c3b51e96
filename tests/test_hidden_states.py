"""A drafter that names target layers receives, once per committed token, exactly
the target's hidden states at those layers (checked against transformers)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import pytest
import torch
from transformers import Qwen3ForCausalLM

from treespec.common.wire import codec
from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.grpc_server import start_server
from treespec.common.spec.messages import DrafterInfo
from treespec.common.spec.tree import PRESETS, TreeBatch
from treespec.common.wire.convert import drafter_info_to_pb
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

LAYERS = (0, 1)
ENV = PRESETS["chain4"]


class RecordingDrafter(pb_grpc.DrafterServicer):
    """Keeps every token and hidden row it is sent; proposes the target's own next
    tokens when it can (from a replay list), so some steps accept."""

    def __init__(self, replay: list[int], prompt_len: int) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.replay, self.prompt_len = replay, prompt_len

    async def GetInfo(self, request, context):
        return drafter_info_to_pb(DrafterInfo(ENV, 96, "recording", LAYERS))

    async def Speculate(self, request_iterator, context):
        async for req in request_iterator:
            ids = []
            for u in req.sequences:
                if u.full:
                    self.tokens[u.seq_id], self.rows[u.seq_id] = [], []
                self.tokens[u.seq_id] += list(u.new_tokens)
                self.rows[u.seq_id].append(codec.decode(u.hidden_states))
                ids.append(u.seq_id)
            trees = TreeBatch.padding(len(ids), ENV.num_nodes)
            tokens, parents = trees.tokens, trees.parents
            for r, s in enumerate(ids):
                done = len(self.tokens[s]) - self.prompt_len
                nxt = self.replay[done:done + ENV.depth]
                for i, t in enumerate(nxt):
                    tokens[r, i], parents[r, i] = t, i - 1
            yield pb.Proposal(step_id=req.step_id, seq_ids=ids, tokens=codec.encode(tokens),
                              parents=codec.encode(parents))


@asynccontextmanager
async def serving(target_dir, drafter, connect: bool = True, **cfg):
    """drafter served by a gRPC server, a verify service (in process) on it; yields the
    verify's port and engine (once connected to the draft, if connect); everything
    stopped after."""
    from treespec.verify_service import server as verify_server
    from treespec.verify_service.config import VerifyConfig
    server, port = await start_server(
        "127.0.0.1", 0, lambda s: pb_grpc.add_DrafterServicer_to_server(drafter, s),
        ["treespec.v1.Drafter"])
    vs, vport, engine = await verify_server.start(VerifyConfig(
        model=str(target_dir), draft=f"127.0.0.1:{port}", device="cpu", block_size=4,
        num_blocks=128, speculation="always", **cfg))
    try:
        for _ in range(200 if connect else 0):
            if engine.link.ready:
                break
            await asyncio.sleep(0.02)
        yield vport, engine
    finally:
        await vs.stop(0.2)
        await engine.stop()
        await engine.link.close()
        await server.stop(0.2)


@pytest.mark.parametrize("rows_a_step,catch_up", [(None, None), (5, None), (None, 1.0)])
def test_hidden_states_of_committed_tokens_travel_once(target_dir, rows_a_step, catch_up):
    """rows_a_step: cap the hidden states a request carries (DraftSync's byte budget),
    so the prompt's cross over several steps, which run plain meanwhile; catch_up: the
    draft's catch-up rate (tokens a second) as if measured, so slow that the first
    request's 9 tokens are predicted past the deadline: it is not waited for."""
    from inproc import greedy_reference
    prompt = [1, 5, 9, 13, 2, 7, 1, 5]
    ref = greedy_reference(target_dir, prompt, 20)
    rec = RecordingDrafter(ref, len(prompt))

    async def go():
        async with serving(target_dir, rec, step_deadline_ms=2000) as (vport, engine):
            if rows_a_step:
                engine.link.sync.max_hidden_bytes = rows_a_step * len(LAYERS) * 64 * 4
            if catch_up:
                engine.link.catch_up_rate = catch_up
            async with AsyncTreespecClient(f"127.0.0.1:{vport}") as c:
                out = await c.generate(prompt_ids=prompt, max_tokens=20, ignore_eos=True)
            return out, dict(engine.fallbacks)
    out, fallbacks = asyncio.run(go())
    assert out.token_ids == ref
    assert out.stats["accepted_tokens"] > 0
    # 9 rows after the prefill (8 prompt tokens and the first) at 5 a step: one plain
    # step while they cross (its request is not waited for: the next step may find the
    # draft still busy with it, and then commits a token more, so the next request may
    # have 6 rows to send and sync once more); after that a step brings at most
    # depth + 1 = 5 rows
    syncing, busy = fallbacks.pop("syncing", 0), fallbacks.pop("busy", 0)
    if rows_a_step or catch_up:
        assert 1 <= syncing <= 1 + min(busy, 1), (syncing, busy)
    else:
        assert syncing == busy == 0
    assert not fallbacks
    (sid, toks), = rec.tokens.items()
    rows = torch.cat(rec.rows[sid])                            # [len(toks), 2 * hidden]
    assert rows.shape[0] == len(toks) and toks == (prompt + ref)[:len(toks)]
    hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([toks[:-1]]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in LAYERS], dim=-1)      # states before tokens 1..L-1
    assert torch.all(rows[0] == 0)
    torch.testing.assert_close(rows[1:], want, atol=1e-4, rtol=1e-4)


def test_a_request_that_never_speculates_keeps_no_hidden_states(target_dir):
    """Beside a speculating request, a no_speculation one is never sent to the draft
    and holds no captured rows on the verify service; both outputs are exact."""
    from inproc import greedy_reference
    prompts = [[1, 5, 9, 13, 2, 7, 1, 5], [2, 6, 10, 14, 3, 8, 2, 6]]
    refs = [greedy_reference(target_dir, p, 12) for p in prompts]
    rec = RecordingDrafter(refs[0], len(prompts[0]))

    async def go():
        async with serving(target_dir, rec, step_deadline_ms=2000) as (vport, engine):
            async with AsyncTreespecClient(f"127.0.0.1:{vport}") as c:
                held = []

                async def plain():
                    ids = []
                    async for chunk in c.generate_stream(prompt_ids=prompts[1], max_tokens=12,
                                                         ignore_eos=True, no_speculation=True):
                        held.extend(s.hidden is not None for s in engine.running
                                    if not s.speculative)
                        ids += chunk.token_ids
                    return ids
                spec, ids = await asyncio.gather(
                    c.generate(prompt_ids=prompts[0], max_tokens=12, ignore_eos=True), plain())
            return spec, ids, held
    spec, ids, held = asyncio.run(go())
    assert spec.token_ids == refs[0] and ids == refs[1]
    assert spec.stats["accepted_tokens"] > 0
    assert held and not any(held), "the plain request kept captured rows"
    assert len(rec.tokens) == 1, "the draft heard of the plain request"


def test_hidden_buffer_appends_in_amortized_place():
    from treespec.common.runtime.row_buffer import RowBuffer
    first = torch.arange(6.0).view(3, 2)
    buf = RowBuffer(first)
    grown = []
    for step in range(20):
        rows = torch.full((1 + step % 3, 2), float(step))
        before = buf._buf.data_ptr()
        buf.append(rows)
        grown.append(buf._buf.data_ptr() != before)
        first = torch.cat([first, rows])
        assert torch.equal(buf.rows, first)
    assert sum(grown) <= 6, "the buffer should double, not copy every step"


def test_hidden_buffer_truncates_guessed_rows():
    """A lookahead's guessed rows are taken back: waiting or landed, the rows after n go,
    the next append lands after row n, and a borrowed tensor is never written."""
    from treespec.common.runtime.row_buffer import RowBuffer
    prompt = torch.zeros(3, 2)
    buf = RowBuffer(prompt)
    buf.append(torch.ones(2, 2))              # guessed, waiting
    buf.truncate(3)
    buf.append(torch.full((1, 2), 2.0))
    assert torch.equal(buf.rows, torch.cat([torch.zeros(3, 2), torch.full((1, 2), 2.0)]))
    buf.append(torch.ones(2, 2))              # guessed, landed by a read
    assert buf.rows.shape[0] == 6
    buf.truncate(2)
    buf.append(torch.full((1, 2), 3.0))
    assert torch.equal(buf.rows, torch.tensor([[0.0, 0.0], [0.0, 0.0], [3.0, 3.0]]))
    assert torch.equal(prompt, torch.zeros(3, 2))


def test_hidden_rows_wait_as_views_until_read():
    """A step appends to every sequence; nobody reads while the controller runs plain,
    so appends must not copy (the b32 plain steps of EAGLE-3 and DFlash paid ~0.8 ms
    for a copy per row), and must land exactly once read or FLUSH_AT of them wait."""
    from treespec.common.runtime import row_buffer
    buf = row_buffer.RowBuffer(torch.zeros(2, 3))
    parts = [torch.full((1 + i % 2, 3), float(i)) for i in range(row_buffer.FLUSH_AT - 1)]
    for p in parts:
        buf.append(p)
    assert buf._landed == 2 and not buf._owned, "appends copied before anyone read them"
    assert torch.equal(buf.rows, torch.cat([torch.zeros(2, 3), *parts]))
    for _ in range(row_buffer.FLUSH_AT):
        buf.append(torch.full((1, 3), -1.0))
    assert buf._landed == buf.len, "FLUSH_AT appends waited unlanded"
    assert buf.rows.shape[0] == buf.len and torch.all(buf.rows[-row_buffer.FLUSH_AT:] == -1)



def test_a_step_reads_its_new_rows_without_landing_them():
    """A drafter's step reads the units its update brought (the last append): they are
    read as they are, with no copy a sequence; any other span lands and is exact."""
    from treespec.common.runtime.row_buffer import RowBuffer
    buf, want = RowBuffer(torch.zeros(2, 3)), torch.zeros(2, 3)
    for step in range(6):
        new = torch.full((1 + step % 3, 3), float(step))
        buf.append(new)
        want = torch.cat([want, new])
        assert buf.span(buf.len - new.shape[0], buf.len) is new
    assert buf._landed == 2, "reading the newest rows landed them"
    assert torch.equal(buf.span(1, buf.len - 1), want[1:-1])
    assert buf._landed == buf.len and torch.equal(buf.span(3, buf.len), want[3:])

class WrongProjection(RecordingDrafter):
    """Announces a projection to 5 columns, then streams one of 3 rows."""

    async def GetInfo(self, request, context):
        return drafter_info_to_pb(DrafterInfo(ENV, 96, "recording", LAYERS,
                                              projected_width=5))

    async def GetProjection(self, request, context):
        yield codec.encode(torch.zeros(3, len(LAYERS) * 64))


def test_a_draft_whose_projection_disagrees_is_not_used(target_dir, caplog):
    """Its connect fails with one line naming the mismatch; requests decode plain
    (no draft reached), the output plain decode's."""
    from inproc import greedy_reference
    prompt = [1, 5, 9, 13, 2, 7, 1, 5]
    ref = greedy_reference(target_dir, prompt, 8)
    rec = WrongProjection(ref, len(prompt))

    async def go():
        async with serving(target_dir, rec, False, reconnect_s=0.1) as (vport, engine):
            await asyncio.sleep(0.5)                   # several connect attempts
            async with AsyncTreespecClient(f"127.0.0.1:{vport}") as c:
                out = await c.generate(prompt_ids=prompt, max_tokens=8, ignore_eos=True)
            return out, engine.link.ready
    with caplog.at_level("WARNING", logger="treespec.verify.draft_link"):
        out, ready = asyncio.run(go())
    assert out.token_ids == ref and not ready and rec.tokens == {}
    lines = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(lines) == 1 and "projection to 5 columns but sent (3, 128)" in lines[0], lines


def test_rows_land_outside_inference_mode_after_a_read_inside_it():
    """A drafter reads (and so lands and grows) its rows inside its step's inference
    mode, but appends arrive in update(), outside it: the FLUSH_AT-th append then
    wrote into an inference tensor and failed the request (H100, EAGLE-3 and DFlash
    shadow at b32: 'Inplace update to inference tensor outside InferenceMode')."""
    from treespec.common.runtime.row_buffer import FLUSH_AT, RowBuffer
    buf, want = RowBuffer(torch.zeros(64, 3)), [torch.zeros(64, 3)]   # a prompt's rows
    with torch.inference_mode():
        buf.append(torch.ones(1, 3))
        want.append(torch.ones(1, 3))
        assert buf.rows.shape[0] == 65        # landed, grown to 128 rows in inference mode
    for i in range(2 * FLUSH_AT):
        rows = torch.full((1, 3), float(i))
        buf.append(rows)
        want.append(rows)
    assert torch.equal(buf.rows, torch.cat(want))
