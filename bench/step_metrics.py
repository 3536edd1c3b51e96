"""The verify service's per-step histograms, read off its /metrics between two marks:
mean milliseconds per engine step of the step, the hop (and its parts) and the
target forward, for the end-to-end bench (bench/e2e_bench.py)."""

from __future__ import annotations

import re
import urllib.request

from treespec.common.serving.launch import ServiceProcess
from treespec.verify_service.observer import HOP_PARTS

HOP_PART = "treespec:draft_hop_part_seconds"     # labelled {part}: verify's hop_parts
STEP_PARTS = {"step": "treespec:step_seconds", "hop": "treespec:draft_hop_seconds",
              **{f"hop_{p}": f"{HOP_PART}|{p}" for p in HOP_PARTS},
              "verify": "treespec:verify_forward_seconds",
              "prefill": "treespec:prefill_seconds"}     # per admission, not per step
# histograms read by bucket (cumulative counts by bound): the step's, the hop's, the
# forward's, and the controller's depth per step (how many steps it ran plain and at each
# budget)
BUCKETED = {"step_le": STEP_PARTS["step"], "hop_le": STEP_PARTS["hop"],
            "verify_le": STEP_PARTS["verify"],
            "budget_le": "treespec:spec_budget_depth"}
BUDGET_S = "treespec:spec_budget_seconds_total"          # labelled {budget}: whole steps' time
LOOKAHEAD = ("lookahead_hits", "lookahead_misses")       # counters: sequence-steps


def metrics_url(svc: ServiceProcess) -> str | None:
    """The service's /metrics address, from its `metrics on URL` log line."""
    m = re.search(r"metrics on (http://\S+/metrics)", svc.output())
    return m.group(1) if m else None


def step_sums(url: str | None) -> dict:
    """(sum seconds, count) of the verify service's per-step histograms, by STEP_PARTS
    key, and under each BUCKETED key that histogram's cumulative counts by bound."""
    if url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    got: dict[str, float] = {}
    les: dict[str, dict[float, float]] = {k: {} for k in BUCKETED}
    budget_s: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == BUDGET_S:
                budget_s[smp.labels["budget"]] = smp.value
            part = smp.labels.get("part")
            name = smp.name if part is None else f"{smp.name}|{part}"
            got[name] = got.get(name, 0.0) + smp.value
            for k, hist in BUCKETED.items():
                if smp.name == hist + "_bucket":
                    le = float(smp.labels["le"])
                    les[k][le] = les[k].get(le, 0.0) + smp.value

    def series(name: str, suffix: str) -> float:        # "metric|part" -> "metric_sum|part"
        base, _, part = name.partition("|")
        return got.get(base + suffix + (f"|{part}" if part else ""), 0.0)

    return {**{k: (series(n, "_sum"), series(n, "_count")) for k, n in STEP_PARTS.items()},
            **les, "budget_s": budget_s,
            **{k: got.get(f"treespec:{k}_total", 0.0) for k in LOOKAHEAD}}


def step_breakdown(before: dict, after: dict) -> dict[str, float]:
    """Mean ms per engine step of each part over the timed run, and the rest
    (engine, servicer and streaming work around the hop and the forward)."""
    out: dict[str, float] = {}
    for k in STEP_PARTS:                 # prefill_ms: per admission (one per timed batch)
        if k in before and k in after and after[k][1] > before[k][1]:
            out[k + "_ms"] = 1000 * (after[k][0] - before[k][0]) / (after[k][1] - before[k][1])
    if "step_ms" in out:
        out["rest_ms"] = out["step_ms"] - out.get("hop_ms", 0.0) - out.get("verify_ms", 0.0)
    for k in LOOKAHEAD:
        if after.get(k, 0.0) > before.get(k, 0.0):
            out[k] = after[k] - before.get(k, 0.0)
    # the tails: the share of whole steps longer than 16 .. 128 ms (a row's plain steps
    # dearer than plain decode's on every step, or a few stalls), of hops longer than
    # 1 .. 32 ms (a mean of 0.8 ms can be every hop near it, or a few stalls over a fast
    # majority; at b32 a mean of 9 ms, every hop near it or a few that carried prompts'
    # hidden states), and of forwards longer than 16 .. 128 ms (whether a row's forward
    # is slower than plain's on every step or on a few)
    long = (0.016, 0.032, 0.064, 0.128)
    for key, les in (("step", long), ("hop", (0.001, 0.002, 0.004, 0.008, 0.016, 0.032)),
                     ("verify", long)):
        b, a = before.get(key + "_le", {}), after.get(key + "_le", {})
        n = a.get(float("inf"), 0.0) - b.get(float("inf"), 0.0)
        if n > 0:
            out[key + "_over_ms"] = {f"{le * 1000:g}": round(1 - (a[le] - b.get(le, 0.0)) / n, 4)
                                     for le in les if le in a}
    # steps at each depth the controller chose (0: plain): whether it settled or switched
    b, a = before.get("budget_le", {}), after.get("budget_le", {})
    below = 0.0
    for le in sorted(x for x in a if x != float("inf")):
        n = a[le] - b.get(le, 0.0)
        if n > below:
            out.setdefault("budget_steps", {})[f"{le:g}"] = n - below
        below = n
    # and a step's mean ms at each: what each budget cost where the controller chose it
    b, a = before.get("budget_s", {}), after.get("budget_s", {})
    for d, n in out.get("budget_steps", {}).items():
        if d in a:
            out.setdefault("budget_step_ms", {})[d] = 1000 * (a[d] - b.get(d, 0.0)) / n
    return out


def fallback_counts(url: str | None) -> dict[str, float]:
    """The verify service's plain-decode sequence-steps so far, by reason."""
    if url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {smp.labels["reason"]: smp.value for fam in text_string_to_metric_families(text)
            for smp in fam.samples
            if smp.name == "treespec:spec_decode_fallback_steps_total"}


def totals(url: str | None, names: tuple[str, ...]) -> dict[str, float]:
    """Each named sample's value summed over its labels (counters: name + "_total")."""
    if url is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(names, 0.0)
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name in out:
                out[smp.name] += smp.value
    return out
