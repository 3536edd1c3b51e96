"""Chunked prefill: a long prompt is prefilled --prefill-tokens at a time, between decode
steps, so it neither freezes the other streams nor holds a whole prompt's attention in
memory, and the tokens are those of a prefill in one forward.

Real `treespec verify` processes (plain decode, no draft) on a copy of tiny-code whose
config allows 32k positions (same weights).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

import services
from treespec.common.client import TreespecClient
from treespec.common.model.paths import resolve_model
from treespec.common.model.qwen3 import Qwen3Model
from treespec.common.runtime.kv_cache import SeqPages
from treespec.kernels import reference
from treespec.verify_service.verifier import Verifier, VerifyBatch

# A chunk's cost grows with the context before it (here, chunks of 64 at up to 4,000
# tokens: the stream's largest gap ~0.43 s, the service ~40 MB larger); prefilled in one
# forward the same prompt stalls the stream ~13 s and grows the service by ~175 MB
LONG = 4_000
CHUNK = 64


@pytest.fixture(scope="module")
def long_target(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-code-32k")
    src = resolve_model("tiny-code")
    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, d / f.name)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 32768
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 4000, (n,), generator=g).tolist()


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def stream_during_a_long_prefill(target: Path, prefill_tokens: int, long: int = LONG
                                 ) -> tuple[list[float], float, list[int]]:
    """A stream decoding while a `long`-token prompt is prefilled, --prefill-tokens at a
    time: the gaps between the stream's tokens while the long prompt was in, the
    service's peak RSS growth (MB) over that time, and the long prompt's tokens. The
    stream is cut once the long prompt is done (it must still be running then)."""
    with services.at_once(services.verify_argv(target, "--prefill-tokens", str(prefill_tokens),
                                               "--max-model-len", "32768")) as (verify,):
        with TreespecClient(verify.addr) as client:
            client.wait_ready(60)
            client.generate(prompt_ids=_prompt(16, 1), max_tokens=4)        # warm
            before = _peak_rss_mb(verify.proc.pid)
            stamps: list[float] = []
            started, stop = threading.Event(), threading.Event()

            def stream() -> None:
                for _ in client.generate_stream(prompt_ids=_prompt(32, 2), max_tokens=20_000,
                                                ignore_eos=True, no_speculation=True):
                    stamps.append(time.monotonic())
                    started.set()
                    if stop.is_set():
                        break

            t = threading.Thread(target=stream)
            t.start()
            assert started.wait(60)
            t_long = time.monotonic()
            long_out = client.generate(prompt_ids=_prompt(long, 3), max_tokens=4,
                                       ignore_eos=True)
            t_done = time.monotonic()
            assert t.is_alive(), "the stream ended before the long prompt was done"
            stop.set()
            t.join(120)
        peak = _peak_rss_mb(verify.proc.pid)
    during = [b - a for a, b in zip(stamps, stamps[1:]) if t_long <= b <= t_done]
    return during, peak - before, long_out.token_ids


def test_a_long_prompt_neither_stalls_a_stream_nor_grows_memory(long_target):
    during, grew_mb, long_out = stream_during_a_long_prefill(long_target, CHUNK)
    assert during, "the stream produced nothing while the long prompt was prefilled"
    assert max(during) < 1.0, max(during)
    assert grew_mb < 100, grew_mb
    assert len(long_out) == 4


def test_chunked_prefill_gives_the_tokens_of_one_forward(long_target):
    """The first tokens after a prompt prefilled in chunks of 512 (two, and a partial
    third) equal those after a prefill in one forward (the Verifier directly, unchunked,
    as the reference)."""
    prompt = _prompt(1100, 4)
    model = Qwen3Model.from_pretrained(long_target)
    ver = Verifier(model, model.new_cache(256, 16), reference, capture=False)
    pages = SeqPages()
    (first,), _ = ver.prefill([pages], [prompt])
    with services.at_once(services.verify_argv(long_target, "--prefill-tokens", "512",
                                               "--max-model-len", "32768")) as (verify,):
        with TreespecClient(verify.addr) as client:
            client.wait_ready(60)
            out = client.generate(prompt_ids=prompt, max_tokens=8, ignore_eos=True,
                                  no_speculation=True)
    assert out.token_ids[0] == first
    reference_out = [first]
    for _ in range(7):
        res = ver.step(VerifyBatch([pages], [reference_out[-1]]))
        reference_out.append(res.bonus[0])
    assert out.token_ids == reference_out
