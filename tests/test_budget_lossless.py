"""The engine serving losslessly at every budget the speculation controller may choose:
under each mode, and under budgets cut to every depth of a tree envelope."""

from __future__ import annotations

import pytest

from treespec.verify_service.controller import Controller, Plan


class Cycling:
    """The real controller's plan with its depth overridden: 1, 2, 4, 0, 1, 2, ... (a
    test double for choices the adaptive controller makes only at some costs)."""

    def __init__(self, ctl: Controller) -> None:
        self.n = 0
        self.plan_real, self.depths = ctl.plan, []

    def plan(self, info, seq_ids, rows, b):
        p = self.plan_real(info, seq_ids, rows, b)
        d = (1, 2, info.envelope.depth, 0)[self.n % 4]
        self.n += 1
        self.depths.append(d)
        if d == 0:
            return Plan(0, [], list(rows))
        return Plan(d, list(rows), [], p.expected, p.cost_s)


PROMPTS = [[1, 5, 9, 13, 2, 7, 1, 5, 9, 13, 2, 7, 1, 5], [3, 4, 5, 6]]


@pytest.mark.parametrize("speculation", ["adaptive", "off", "cut"])
def test_every_budget_is_lossless_greedy_and_seeded(target_dir, speculation):
    """The lossless suite's property under each mode, and under budgets cut to every
    depth of a tree envelope (tree-small, the draft = the target: deep accepts): greedy
    output equals plain greedy, a coupled seeded sample equals the same seed's sample
    without speculation."""
    import asyncio

    from treespec.common.client import AsyncTreespecClient
    from inproc import greedy_reference, services

    async def go(spec: bool):
        mode = "off" if not spec else "adaptive" if speculation == "adaptive" else \
            "always" if speculation == "cut" else speculation
        async with services(target_dir, "model", target_dir, "tree-small",
                            speculation=mode) as h:
            if speculation == "cut" and spec:
                cyc = Cycling(h["engine"].controller)
                h["engine"].controller.plan = cyc.plan
            async with AsyncTreespecClient(h["addr"]) as c:
                greedy = await asyncio.gather(*[c.generate(prompt_ids=p, max_tokens=16,
                                                           ignore_eos=True) for p in PROMPTS])
                sampled = await c.generate(prompt_ids=PROMPTS[0], max_tokens=16,
                                           ignore_eos=True, temperature=0.8, seed=11)
            assert h["engine"].kv_pages_used == 0
            if speculation == "cut" and spec:     # the draft expanded those levels only
                families = {k[0] for k in h["draft_engine"].proposer.graphs.buckets.graphs}
                assert {("step", 1), ("step", 2), "step"} <= families, families
            return greedy, sampled, (cyc.depths if speculation == "cut" and spec else None)

    greedy, sampled, depths = asyncio.run(go(True))
    for p, out in zip(PROMPTS, greedy):
        assert out.token_ids == greedy_reference(target_dir, p, 16)
    if speculation == "cut":
        assert {1, 2, 4, 0} <= set(depths)
        assert sum(o.stats["accepted_tokens"] for o in greedy) > 0
    _, plain_sample, _ = asyncio.run(go(False))
    assert sampled.token_ids == plain_sample.token_ids
