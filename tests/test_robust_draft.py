"""A broken draft never produces a wrong token: hostile proposals are dropped, a slow
draft turns steps into plain decode, a killed draft is survived and counted."""

from __future__ import annotations

import asyncio
import itertools

import torch

from treespec.common.wire import codec
from treespec.common.client import AsyncTreespecClient
from treespec.common.serving.grpc_server import start_server
from treespec.common.serving.launch import ServiceProcess, cli_command
from treespec.common.spec.tree import PRESETS
from treespec.common.wire.convert import drafter_info_to_pb
from treespec.common.spec.messages import DrafterInfo
from inproc import greedy_reference
from treespec.protos.treespec.v1 import treespec_pb2 as pb
from treespec.protos.treespec.v1 import treespec_pb2_grpc as pb_grpc

PROMPT = [1, 5, 9, 13, 2, 7, 1, 5, 9, 13]
ENV = PRESETS["tree-small"]


class HostileDrafter(pb_grpc.DrafterServicer):
    """Cycles through malformed, stale, out-of-range, slow and random-but-valid trees."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.modes = itertools.cycle(["shape", "vocab", "stale", "order", "dtype", "slow",
                                      "random", "cycle"])

    async def GetInfo(self, request, context):
        return drafter_info_to_pb(DrafterInfo(ENV, self.vocab, "hostile"))

    async def Speculate(self, request_iterator, context):
        g = torch.Generator().manual_seed(0)
        async for req in request_iterator:
            b, n = len(req.sequences), ENV.num_nodes
            mode = next(self.modes)
            tokens = torch.randint(0, self.vocab, (b, n), generator=g, dtype=torch.int32)
            parents = torch.tensor([[-1, -1, 0, 1, 2, 3, 4, 5]] * b, dtype=torch.int32)
            step, ids = req.step_id, [s.seq_id for s in req.sequences]
            if mode == "shape":
                tokens, parents = tokens[:, :3], parents[:, :3]
            elif mode == "vocab":
                tokens[:, 0] = self.vocab + 7
            elif mode == "stale":
                step -= 1
            elif mode == "order":
                ids = ids[::-1] + [999]
            elif mode == "cycle":
                parents[:, 2] = 5
            elif mode == "slow":
                await asyncio.sleep(0.3)
            msg = pb.Proposal(step_id=step, seq_ids=ids, tokens=codec.encode(tokens),
                              parents=codec.encode(parents))
            if mode == "dtype":
                msg.tokens.dtype = "float32"
            yield msg


async def _against(target_dir, drafter, deadline_ms: float, prompts: list[list[int]],
                   max_tokens: int):
    """Both outputs and the verify's fallback counts, a verify service (adaptive) in
    process against `drafter` served on loopback."""
    server, port = await start_server(
        "127.0.0.1", 0, lambda s: pb_grpc.add_DrafterServicer_to_server(drafter, s),
        ["treespec.v1.Drafter"])
    try:
        from treespec.verify_service import server as verify_server
        from treespec.verify_service.config import VerifyConfig
        vs, vport, engine = await verify_server.start(VerifyConfig(
            model=str(target_dir), draft=f"127.0.0.1:{port}", device="cpu",
            step_deadline_ms=deadline_ms, block_size=4, num_blocks=256))
        for _ in range(200):
            if engine.link.ready:
                break
            await asyncio.sleep(0.02)
        async with AsyncTreespecClient(f"127.0.0.1:{vport}") as c:
            outs = await asyncio.gather(*[c.generate(prompt_ids=p, max_tokens=max_tokens,
                                                     ignore_eos=True) for p in prompts])
        fallbacks = dict(engine.fallbacks)
        await vs.stop(0.2)
        await engine.stop()
        await engine.link.close()
        return outs, fallbacks
    finally:
        await server.stop(0.2)


def test_hostile_draft_never_changes_output(target_dir):
    outs, fallbacks = asyncio.run(_against(target_dir, HostileDrafter(96), 100,
                                           [PROMPT[i:] for i in range(3)], 30))
    for i, out in enumerate(outs):
        assert out.token_ids == greedy_reference(target_dir, PROMPT[i:], 30)
        assert out.stats["fallback_steps"] > 0
    assert fallbacks.get("invalid_proposal", 0) > 0
    assert fallbacks.get("deadline", 0) + fallbacks.get("busy", 0) > 0


class SlowDrafter(pb_grpc.DrafterServicer):
    """Valid trees, each a while after the verify's deadline."""

    async def GetInfo(self, request, context):
        return drafter_info_to_pb(DrafterInfo(ENV, 96, "slow"))

    async def Speculate(self, request_iterator, context):
        async for req in request_iterator:
            await asyncio.sleep(0.04)
            b = len(req.sequences)
            tokens = torch.ones((b, ENV.num_nodes), dtype=torch.int32)
            parents = torch.tensor([[-1, -1, 0, 1, 2, 3, 4, 5]] * b, dtype=torch.int32)
            yield pb.Proposal(step_id=req.step_id, seq_ids=[s.seq_id for s in req.sequences],
                              tokens=codec.encode(tokens), parents=codec.encode(parents))


def test_a_draft_too_slow_for_the_deadline_is_rested_not_asked_every_step(target_dir):
    """Each step that waits for a draft past its deadline commits one token for the
    wait; the controller counts such a step as a try that accepted nothing, so the
    sequence rests (plain, not asked) instead of waiting again every other step."""
    (out,), fallbacks = asyncio.run(_against(target_dir, SlowDrafter(), 30, [PROMPT], 64))
    assert out.token_ids == greedy_reference(target_dir, PROMPT, 64)
    assert 0 < fallbacks.get("deadline", 0) <= 6, fallbacks     # 10-11 asked again every time
    assert fallbacks.get("off_by_controller", 0) >= 40, fallbacks


def test_draft_killed_mid_generation(target_dir, draft_dir):
    draft = ServiceProcess("draft", cli_command("draft", "--method", "model", "--model",
                                                str(draft_dir), "--envelope", "chain4",
                                                "--port", "0", "--device", "cpu"))
    try:
        addr = draft.wait_listening(120)

        async def go():
            from treespec.verify_service import server as verify_server
            from treespec.verify_service.config import VerifyConfig
            vs, vport, engine = await verify_server.start(VerifyConfig(
                model=str(target_dir), draft=addr, device="cpu", block_size=4,
                num_blocks=512, reconnect_s=0.2))
            for _ in range(500):
                if engine.link.ready:
                    break
                await asyncio.sleep(0.02)
            async with AsyncTreespecClient(f"127.0.0.1:{vport}") as c:
                got: list[int] = []
                final = None
                async for chunk in c.generate_stream(prompt_ids=PROMPT, max_tokens=80,
                                                     ignore_eos=True):
                    got += chunk.token_ids
                    if len(got) >= 10 and draft.running:
                        draft.proc.kill()          # SIGKILL: no goodbye on the stream
                    final = chunk
            await vs.stop(0.2)
            await engine.stop()
            await engine.link.close()
            return got, final
        got, final = asyncio.run(go())
    finally:
        draft.stop(5)
    assert got == greedy_reference(target_dir, PROMPT, 80)
    assert final.stats["draft_tokens"] > 0        # it did speculate before the kill
    assert final.stats["fallback_steps"] > 0      # and fell back after it
