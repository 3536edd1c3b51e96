"""The GPU benchmark's whole path, at a tiny shape on the CPU: every section runs,
every key the issue names is written, and the replay instrument does what it is
for (controlled acceptance, output equal to plain decode). A broken bench found
here costs nothing; found on the H200 it costs device minutes. And `treespec
bench-accept` as users run it, on the shipped tiny-code pair (its TRAINING.json names
the held-out files): both services as child processes, every row identical to plain
greedy, the table and the JSON rows consistent."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from treespec.common.serving.launch import child_env

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--target-shape", "tiny", "--draft-shape", "tiny", "--device", "cpu"]


def bench_argv(name: str, d: Path) -> tuple[list[str], dict[str, str] | None]:
    """The command of each run (and its environment, None: this one), writing d/out.json."""
    out = str(d / "out.json")
    script = [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--out", out, *TINY,
              "--work", str(d / "work")]
    if name == "h200":
        # 3 timed steps at each verify shape, not the GPU run's 30 (the section's path,
        # not its figures: a CPU step at this shape's 152k vocabulary is ~0.15 s)
        return script + ["--ctx", "32", "--max-tokens", "16", "--batches", "1,2",
                         "--nodes", "0,4", "--verify-iters", "3", "--ab-grpc",
                         "--lookahead-hit-rates", "1", "--emulated-draft-ms", "25"], None
    if name == "drafters":
        # the verify's deadline as the in-process tests have it (tests/inproc.py): with
        # the other runs beside it, a CPU step can pass the served 100 ms default
        return script + ["--ctx", "24", "--max-tokens", "9", "--batches", "1",
                         "--configs", "eagle3:chain4", "--modes", "random,shadow,shadowraw",
                         "--pairs", "1",
                         "--verify-args=--speculation always --step-deadline-ms 5000"], None
    assert name == "bench-accept"
    # one method (every row's services start the same way, whatever the method: the
    # n-gram rows cost two more service pairs and proved nothing more of the bench)
    return [sys.executable, str(ROOT / "bench" / "bench_accept.py"), "--methods", "model",
            "--envelopes", "chain4,2x2x3", "--files", "2", "--prompt-tokens", "48",
            "--max-tokens", "16", "--device", "cpu", "--json", out], child_env()


@pytest.fixture(scope="module")
def benches(tmp_path_factory):
    """The three runs, started together (each spends most of its time starting services,
    seconds of importing torch each); by name, a function that waits for that run and
    gives its JSON and its standard output."""
    runs = {}
    for name in ("h200", "drafters", "bench-accept"):
        d = tmp_path_factory.mktemp(name)
        argv, env = bench_argv(name, d)
        with open(d / "stdout", "w") as out, open(d / "stderr", "w") as err:
            runs[name] = (d, subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL,
                                              start_new_session=True))

    def result(name: str) -> tuple[dict, str]:
        d, proc = runs[name]
        code = proc.wait(timeout=300)
        stdout = (d / "stdout").read_text()
        assert code == 0, stdout[-3000:] + (d / "stderr").read_text()[-3000:]
        return json.loads((d / "out.json").read_text()), stdout
    result.dirs = {name: d for name, (d, _) in runs.items()}
    try:
        yield result
    finally:
        for _, proc in runs.values():    # a run's services too, were it cut short
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def service_logs(d: Path, lines: int = 30) -> str:
    """The last lines each service of a run logged (nanobind's exit noise left out)."""
    out = []
    for log in sorted((d / "work").glob("*.log")):
        kept = [x for x in log.read_text(errors="replace").splitlines()
                if x.strip() and "leaked" not in x and not x.startswith((" - ", "nanobind"))]
        out.append(f"--- {log.name}\n" + "\n".join(kept[-lines:]))
    return "\n".join(out)


def test_h200_bench_runs_end_to_end_at_a_tiny_shape(benches):
    r, _ = benches("h200")
    assert r["errors"] == {}
    for key in ("plain_tok_s", "hf_tok_s", "floor_tok_s", "verify_ms", "oracle4_tok_s",
                "hop_share", "batch_tok_s"):
        assert key in r, key
    assert set(r["verify_ms"]["1"]) == {"0", "4"} and set(r["batch_tok_s"]) == {"1", "2"}
    e2e = r["e2e"]
    assert e2e["alone_equals_batch"]     # batch 1's prompt, twice at batch 2: the same tokens
    for b in (1, 2):
        assert e2e[f"reject_b{b}"]["tokens_per_step"] == 1.0       # every draft was wrong
        assert e2e[f"replay_b{b}"]["lossless"] and e2e[f"reject_b{b}"]["lossless"]
        # 3 correct tokens of 4 drafted: every step commits 4 but the last (16 = 1 + 4+4+4+3)
        assert e2e[f"replay_b{b}"]["tokens_per_step"] == 15 / 4
        assert e2e[f"replay_b{b}"]["step_ms"] > e2e[f"replay_b{b}"]["verify_ms"] > 0
    assert 0 < r["hop_share"] < 1
    hop = e2e["replay_b1"]      # the hop by part: send + wait + read, wait by its legs
    assert hop["hop_send_ms"] + hop["hop_wait_ms"] + hop["hop_read_ms"] <= hop["hop_ms"] * 1.001
    tail = hop["hop_over_ms"]            # shares of hops over 1 .. 32 ms: falling
    bounds = ["1", "2", "4", "8", "16", "32"]
    assert list(tail) == bounds and 1 >= tail["1"] and tail["32"] >= 0
    assert all(tail[x] >= tail[y] for x, y in zip(bounds, bounds[1:]))
    assert abs(hop["hop_to_draft_ms"] + hop["hop_draft_ms"] + hop["hop_to_verify_ms"]
               - hop["hop_wait_ms"]) < 1e-6 and hop["hop_draft_ms"] > 0
    assert e2e["replay_b1_grpc"]["lossless"] and r["hop_share_grpc"] > 0
    # the replay's lookahead at a set hit rate of 1: every candidate tried is the outcome
    la = e2e["replay_la1_b1"]
    assert la["lossless"] and la["lookahead_hits"] > 0 and "lookahead_misses" not in la
    # the emulated remote draft: each draft answer takes its 25 ms, lookahead or not
    for key in ("replay_em_b1", "replay_em_la1_b1"):
        assert e2e[key]["lossless"] and e2e[key]["hop_draft_ms"] >= 25, key
    assert e2e["replay_em_la1_b1"]["lookahead_hits"] > 0
    # batch 1's figures are the median of three timed runs, all with the same output
    for key in ("plain_b1", "replay_b1", "replay_b1_grpc"):
        runs = e2e[key]["tok_s_runs"]
        assert len(runs) == 3 and e2e[key]["tok_s"] == sorted(runs)[1], key
    assert e2e["replay_b1"]["runs_agree"]
    assert e2e["replay_b1"]["carrier"] == "unix socket"
    assert e2e["replay_b1_grpc"]["carrier"] == "grpc"
    assert r["oracle4_decode_ratio"] > 0 and e2e["replay_b1"]["decode_tok_s"] > 0
    assert e2e["model_b1"]["fallback_steps"] == 0 and "error" not in e2e["model_b1"]


def test_drafters_bench_runs_end_to_end_at_a_tiny_shape(benches):
    """bench/drafters.py: a real proposer (the EAGLE-3 head of the target's shape, with
    the target's embeddings) at random weights and under the shadow replay, beside
    plain decode in the same verify service."""
    r, _ = benches("drafters")
    assert r["errors"] == {} and r["plain"]["1"]["tok_s"] > 0
    again = r["plain_again"]["1"]         # plain decode before and after the rows
    assert again["lossless"] and again["tok_s"] > 0
    for rows in r["rows"].values():
        assert rows["1"]["over_plain"] == pytest.approx(
            2 * rows["1"]["tok_s"] / (r["plain"]["1"]["tok_s"] + again["tok_s"]))
        assert rows["1"]["over_plain_paired"] > 0      # a turn of plain and the row
        assert rows["1"]["paired_turns"] == [rows["1"]["over_plain_paired"]]
        plain = rows["1"]["paired_plain"][0]      # that turn's plain run, draft attached
        assert plain["tok_s"] > 0 and plain["step_ms"] >= plain["verify_ms"] > 0
        assert list(plain["verify_over_ms"]) == list(plain["step_over_ms"]) == [
            "16", "32", "64", "128"]
        assert 0 <= plain["step_over_ms"]["128"] <= plain["step_over_ms"]["16"] <= 1
    rand, shadow = r["rows"]["eagle3:chain4:random"]["1"], r["rows"]["eagle3:chain4:shadow"]["1"]
    raw = r["rows"]["eagle3:chain4:shadowraw"]["1"]
    assert rand["lossless"] and shadow["lossless"] and raw["lossless"]
    # the verify sends the head's fc of the 3 layers' states: a third of the bytes a
    # token (per step it varies with how the rows' catch-ups fell: steps are timed;
    # tests/test_serving_load.py bounds the bytes a token)
    assert raw["hidden_bytes_per_step"] > 1.5 * shadow["hidden_bytes_per_step"] > 0
    assert not rand["fallbacks"]
    # 9 = the prefill's token and 2 steps of 4
    assert shadow["tokens_per_step"] == 4.0, (shadow, service_logs(benches.dirs["drafters"]))
    assert shadow["hop_draft_ms"] > 0 and rand["hop_draft_ms"] > 0
    assert shadow["hop_over_ms"]["1"] >= shadow["hop_over_ms"]["32"]  # the heavy hops' share
    assert list(shadow["budget_steps"]) == ["4"]      # `always`: every step the envelope's depth
    assert shadow["budget_step_ms"]["4"] == pytest.approx(shadow["step_ms"])   # so its time too
    for x in (rand, shadow):     # the draft's own metrics: its propose within its engine's step
        assert 0 < x["draft_propose_ms"] <= x["draft_engine_ms"]
    sys.path.insert(0, str(ROOT / "bench"))        # two runs merged: plain over both runs'
    from merge_runs import merge, table             # passes, each row over its own run's
    m = merge([r, {**r, "rows": {f"{k}'": v for k, v in r["rows"].items()}}])
    both = (r["plain"]["1"]["tok_s"] + again["tok_s"]) / 2
    assert m["plain"]["1"]["tok_s"] == pytest.approx(both)
    assert len(m["rows"]) == 2 * len(r["rows"])
    assert (f"| eagle3:chain4:random' | {rand['over_plain']:.3f} / "
            f"{rand['over_plain_paired']:.3f} / {min(rand['paired_turns']):.3f} |") in table(m)


def test_bench_accept_rows_are_lossless(benches):
    rows, stdout = benches("bench-accept")
    assert [(r["proposer"], r["envelope"]) for r in rows] == [
        ("model", "chain4"), ("model", "2x2x3")]
    for r in rows:            # a custom envelope (2x2x3: 2 deep, 2 children, 3 nodes) too
        depth = 4 if r["envelope"] == "chain4" else 2
        assert r["identical"] and 1.0 <= r["tokens_per_step"] <= 1 + depth
        assert len(r["accept_by_depth"]) == depth
        assert all(a >= b for a, b in zip(r["accept_by_depth"], r["accept_by_depth"][1:]))
    assert rows[0]["tokens_per_step"] > 1.5          # the trained draft does accept
    assert "| model | chain4 |" in stdout


def test_replay_finds_a_prompt_that_arrives_in_parts():
    """A prompt whose hidden states cross over several steps reaches the draft in
    parts (a full update of a prefix, then the rest): the replay still finds it."""
    sys.path.insert(0, str(ROOT / "bench"))
    from replay import ReplayProposer
    prompt, cont = list(range(10, 30)), [7, 8, 9, 6, 5]
    rp = ReplayProposer([{"prompt": prompt, "continuation": cont}], depth=4, corrupt=0.0,
                        vocab=100)
    rp.update(1, prompt[:8], 8, [], None)
    assert rp.propose([1]).tokens[0].tolist() == [0, 0, 0, 0]     # nothing known yet
    rp.update(1, prompt, 12, [], None)
    rp.update(1, prompt + cont[:1], 1, [], None)
    assert rp.propose([1]).tokens[0].tolist() == cont[1:5]


def test_pyspy_top_reads_each_process_under_its_own_command(tmp_path):
    """bench/pyspy_top.py: a child's stacks nest under its parent's process frame; each
    is counted for the innermost process, the project's frames inclusive and self."""
    sys.path.insert(0, str(ROOT / "bench"))
    from pyspy_top import parse
    raw = tmp_path / "pyspy.txt"
    raw.write_text(
        'process 1:"bench";process 2:"verify";run (verify_service/server.py:3);'
        'finish (verify_service/verifier.py:9);clone (torch/x.py:1) 30\n'
        'process 1:"bench";process 2:"verify";run (verify_service/server.py:3) 10\n'
        'process 1:"bench";main (bench/drafters.py:5) 7\n')
    got = parse(str(raw))
    n, incl, own = got['process 2:"verify"']
    assert n == 40 and incl["run (verify_service/server.py)"] == 40
    assert incl["finish (verify_service/verifier.py)"] == own[
        "finish (verify_service/verifier.py)"] == 30
    assert got['process 1:"bench"'][0] == 7 and not got['process 1:"bench"'][1]


def test_drafters_plot_names_the_run_s_prompt_length(monkeypatch, tmp_path):
    """bench/drafters.py's plot says the prompts are --ctx tokens long (here 24), through a
    stand-in matplotlib that records what the axes are given."""
    import types
    import drafters
    given: list[str] = []

    class Axes:
        def __getattr__(self, name):
            return lambda *args, **kw: given.extend(str(x) for x in args)
    pyplot = types.SimpleNamespace(subplots=lambda **kw: (
        types.SimpleNamespace(savefig=lambda *a, **kw: None), Axes()))
    mpl = types.ModuleType("matplotlib")
    mpl.use, mpl.pyplot = (lambda backend: None), pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    drafters.plot({"target": "tiny", "date": "today", "ctx": 24, "rows": {},
                   "plain": {"1": {"tok_s": 5.0}}}, tmp_path / "plot.png")
    labels = " ".join(given)
    assert "24-token prompts" in labels and "1024" not in labels, labels


def test_drafters_shadow_lookahead_mode_sets_the_hit_rate(tmp_path):
    """Mode shadow+laK@H starts the shadow replay with the drafter's --lookahead K and
    the instrument's hit rate H; without @H the replay keeps its default."""
    sys.path.insert(0, str(ROOT / "bench"))
    import drafters
    argv = drafters.draft_argv("eagle3", "chain4", "shadow+la1@0.15", 1, tmp_path, tmp_path,
                               "cpu", tmp_path / "c.json", 64)
    assert argv[argv.index("--hit-rate") + 1] == "0.15"
    assert argv[argv.index("--lookahead") + 1] == "1"
    plain = drafters.draft_argv("eagle3", "chain4", "shadow+la1", 1, tmp_path, tmp_path,
                                "cpu", tmp_path / "c.json", 64)
    assert "--hit-rate" not in plain and "--lookahead" in plain


def test_lookahead_quality_bench_scores_a_hit_s_tree(tmp_path):
    """bench/lookahead_quality.py keys every lookahead by the step's true outcome: every
    step after a sequence's first hits, the output is plain greedy's, and the draft
    model's hit trees (its KV holds the true tokens) accept what trees drafted when asked
    do."""
    out = tmp_path / "q.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "lookahead_quality.py"), "--out",
                    str(out), "--configs", "model:chain4", "--prompts", "2",
                    "--prompt-tokens", "64", "--max-tokens", "24"],
                   check=True, env=child_env(), timeout=300, cwd=ROOT)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["identical"] and row["hits"] >= row["steps"] - 2 > 0
    assert row["ratio"] == 1.0
