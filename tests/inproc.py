"""Both services as real grpc.aio servers inside the test's own event loop (port 0)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from treespec.common.spec.tree import envelope_from
from treespec.draft_service.config import DraftConfig
from treespec.verify_service.config import VerifyConfig

_hf_cache: dict[str, Qwen3ForCausalLM] = {}


def greedy_reference(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy decode (no EOS stop): the ground truth."""
    key = str(model_dir)
    if key not in _hf_cache:
        _hf_cache[key] = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = _hf_cache[key].generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# Tests assert that every proposal arrived (fallback_steps == 0); a 2-core CI box under
# load can take longer than the served 100 ms default for a CPU EAGLE-3 tree, so the
# in-process pair waits longer unless a test sets its own deadline to exercise it.
TEST_DEADLINE_MS = 5000.0


@contextlib.asynccontextmanager
async def services(target: Path, method: str | None = None, draft_model: Path | None = None,
                   envelope: str = "chain4", draft_kw: dict | None = None,
                   **verify_kw) -> AsyncIterator[dict]:
    """Start a draft (unless method is None) and a verify service; yields their handles.
    The verify speculates on every step (speculation="always") unless told otherwise:
    these tests are about the speculative path, which the adaptive controller leaves
    on the CPU, where a draft step costs more than it buys (tests/test_controller.py)."""
    from treespec.draft_service import server as draft_server
    from treespec.verify_service import server as verify_server

    handles: dict = {}
    draft = None
    if method is not None:
        dcfg = DraftConfig(method=method, envelope=envelope_from(envelope),
                           model=str(draft_model) if draft_model else None, device="cpu",
                           **(draft_kw or {}))
        draft, dport, handles["draft_engine"] = await draft_server.start(dcfg)
        handles["draft_addr"] = f"127.0.0.1:{dport}"
        handles["draft_server"] = draft
    verify_kw.setdefault("speculation", "always")
    vcfg = VerifyConfig(model=str(target), draft=handles.get("draft_addr"), device="cpu",
                        num_blocks=verify_kw.pop("num_blocks", 512), block_size=4,
                        reconnect_s=0.2,
                        step_deadline_ms=verify_kw.pop("step_deadline_ms", TEST_DEADLINE_MS),
                        **verify_kw)
    verify, vport, engine = await verify_server.start(vcfg)
    handles.update(addr=f"127.0.0.1:{vport}", engine=engine)
    try:
        if engine.link is not None:
            for _ in range(200):
                if engine.link.ready:
                    break
                await asyncio.sleep(0.02)
        yield handles
    finally:
        await verify.stop(0.5)
        await engine.stop()
        if engine.link is not None:
            await engine.link.close()
        if draft is not None:
            await draft.stop(0.5)
