"""/metrics on both services: the vLLM-named counters equal what `treespec generate
--json` reports, through real CLI processes; and exact counts for a hand-made step."""

from __future__ import annotations

import re

import pytest

import services
from treespec.common.serving.launch import cli_command
from parallel_services import free_port, running
from prom import scrape, total, value, wait_connected
from treespec.common.spec.tree import envelope_from
from treespec.verify_service.metrics import VerifyMetrics
from treespec.verify_service.observer import StepRecord, hop_parts

METRICS_LINE = re.compile(r"metrics on (http://\S+/metrics)")
PROMPTS = [[5, 17, 23, 42, 8, 17, 23, 42, 8, 17, 23], [3, 4, 5, 6, 7]]
MAX_TOKENS = 16


def metrics_url(svc) -> str:
    m = METRICS_LINE.search(svc.output())
    assert m, f"{svc.name} logged no metrics line:\n{svc.output(20)}"
    return m.group(1)


@pytest.fixture(scope="module")
def stack(target_dir):
    dport = free_port()
    draft = cli_command("draft", "--method", "model", "--model", str(target_dir), "--envelope",
                        "tree-small", "--port", str(dport), "--device", "cpu",
                        "--metrics-port", "0")
    verify = cli_command("verify", "--model", str(target_dir), "--draft", f"127.0.0.1:{dport}",
                         "--port", "0", "--device", "cpu", "--metrics-port", "0",
                         "--step-deadline-ms", "5000", "--reconnect-s", "0.2",
                         "--num-blocks", "256", "--block-size", "4", "--speculation", "always")
    with running([("draft", draft, None), ("verify", verify, None)]) as pair:
        pair[1].wait_listening(1)
        assert services.run_cli("health", "--addr", pair[1].addr).returncode == 0
        wait_connected(metrics_url(pair[1]))
        yield pair


def test_metrics_equal_generate_json_stats(stack):
    draft, verify = stack
    vurl, durl = metrics_url(verify), metrics_url(draft)
    before = scrape(vurl)
    assert total(before, "vllm:spec_decode_num_draft_tokens_total") == 0
    outs = [services.generate_json(verify.addr, p, MAX_TOKENS, "--ignore-eos") for p in PROMPTS]
    stats = {k: sum(o["stats"][k] for o in outs) for k in outs[0]["stats"]}
    v, d = scrape(vurl), scrape(durl)

    assert stats["accepted_tokens"] > 0
    assert value(v, "vllm:spec_decode_num_draft_tokens_total") == stats["draft_tokens"]
    assert value(v, "vllm:spec_decode_num_accepted_tokens_total") == stats["accepted_tokens"]
    drafts = stats["steps"] - stats["fallback_steps"]
    assert value(v, "vllm:spec_decode_num_drafts_total") == drafts
    per_pos = [value(v, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
               for p in range(envelope_from("tree-small").depth)]
    assert sum(per_pos) == stats["accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True), "a deeper position needs the shallower"
    assert value(v, "treespec:spec_decode_accepted_length_count") == drafts
    assert value(v, "treespec:spec_decode_accepted_length_sum") == stats["accepted_tokens"]
    assert total(v, "treespec:spec_decode_fallback_steps_total") == stats["fallback_steps"]
    assert value(v, "treespec:sequence_steps_total") == stats["steps"]
    assert value(v, "vllm:generation_tokens_total") == stats["completion_tokens"]
    assert value(v, "vllm:prompt_tokens_total") == stats["prompt_tokens"]
    assert value(v, "vllm:request_success_total", finished_reason="length") == len(PROMPTS)
    assert value(v, "vllm:num_requests_running") == value(v, "vllm:num_requests_waiting") == 0
    assert value(v, "treespec:kv_pages_used") == 0
    assert value(v, "treespec:kv_pages_free") > 0
    assert value(v, "treespec:draft_connected") == 1
    assert value(v, "treespec:draft_hop_seconds_count") >= drafts
    # each answered hop by part: send + wait + read = the hop, and the draft's stamps
    # split the wait into its wire legs and the draft's own time
    part = {p: value(v, "treespec:draft_hop_part_seconds_sum", part=p)
            for p in ("send", "wait", "read", "to_draft", "draft", "to_verify")}
    assert value(v, "treespec:draft_hop_part_seconds_count", part="wait") == drafts
    # (a hop that got no answer, e.g. a resync step's all-padding rows, has no parts)
    assert 0 < part["send"] + part["wait"] + part["read"] <= \
        value(v, "treespec:draft_hop_seconds_sum") * (1 + 1e-9)
    assert part["to_draft"] + part["draft"] + part["to_verify"] == pytest.approx(
        part["wait"], rel=1e-6)
    assert part["draft"] > 0
    assert value(v, "treespec:verify_forward_seconds_count") == \
        value(v, "treespec:step_seconds_count") > 0

    # the draft proposed what the target was offered (every proposal was in time)
    assert stats["fallback_steps"] == 0
    assert value(d, "treespec:draft_proposed_tokens_total") == stats["draft_tokens"]
    assert value(d, "treespec:draft_trees_total") == drafts
    assert value(d, "treespec:draft_steps_total") == value(v, "treespec:draft_hop_seconds_count")
    assert value(d, "treespec:draft_propose_seconds_count") > 0
    assert value(d, "treespec:kv_pages_used") >= 0 and value(d, "treespec:draft_sequences") >= 0


def test_hop_parts_split_the_wait_only_with_consistent_stamps():
    assert hop_parts(0, 10, None) == {}
    assert hop_parts(0, 10, (1, 8, 0, 0)) == {"send": 1, "wait": 7, "read": 2}
    assert hop_parts(0, 10, (1, 8, 3, 6)) == {"send": 1, "wait": 7, "read": 2,
                                             "to_draft": 2, "draft": 3, "to_verify": 2}
    # clocks apart (another host): a negative leg drops all three
    assert set(hop_parts(0, 10, (5, 8, 3, 6))) == {"send", "wait", "read"}


def test_metrics_for_a_hand_made_step():
    env = envelope_from("chain4")
    m = VerifyMetrics("tiny")
    rec = StepRecord(step_id=3, batch=2, seq_ids=[7, 9], request_ids=["a", "b"],
                     drafted=[4, 0], depth=[2, 0], accepted=[2, 0], committed=[3, 1],
                     fallback=[None, "empty_tree"], reason=None, envelope=env,
                     t_start=0, t_drafted=2_000_000, t_verified=5_000_000, t_end=6_000_000,
                     hop_parts=hop_parts(0, 2_000_000, (100_000, 1_600_000, 300_000,
                                                        1_200_000)), rest_floor=170, budget=2)
    m.step_finished(rec)
    got = m.registry.get_sample_value
    lab = {"model_name": "tiny"}
    assert got("vllm:spec_decode_num_drafts_total", lab) == 1
    assert got("vllm:spec_decode_num_draft_tokens_total", lab) == 4
    assert got("vllm:spec_decode_num_accepted_tokens_total", lab) == 2
    assert [got("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                {**lab, "position": str(p)}) for p in range(env.depth)] == [1, 1, 0, 0]
    assert got("treespec:spec_decode_fallback_steps_total", {**lab, "reason": "empty_tree"}) == 1
    assert got("vllm:generation_tokens_total", lab) == 4
    assert got("treespec:draft_hop_seconds_sum", lab) == pytest.approx(0.002)
    parts = {p: got("treespec:draft_hop_part_seconds_sum", {**lab, "part": p})
             for p in ("send", "wait", "read", "to_draft", "draft", "to_verify")}
    assert parts == pytest.approx({"send": 1e-4, "wait": 1.5e-3, "read": 4e-4,
                                   "to_draft": 2e-4, "draft": 9e-4, "to_verify": 4e-4})
    assert got("treespec:verify_forward_seconds_sum", lab) == pytest.approx(0.003)
    assert got("treespec:step_seconds_sum", lab) == pytest.approx(0.006)
    assert got("treespec:spec_budget_seconds_total", {**lab, "budget": "2"}) == pytest.approx(0.006)
    assert got("treespec:spec_rest_floor_steps", lab) == 170
    # every server has a registry of its own: a second one starts from zero
    assert VerifyMetrics("tiny").registry.get_sample_value(
        "vllm:spec_decode_num_drafts_total", lab) == 0
