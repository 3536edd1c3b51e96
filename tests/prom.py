"""Reading a service's /metrics in tests (prometheus text format)."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """{(sample name, labels less model_name/proposer): value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items()
                               if k not in ("model_name", "proposer"))
            out[(s.name, labels)] = s.value
    return out


def value(m: Samples, name: str, **labels: str) -> float:
    return m[(name, frozenset(labels.items()))]


def total(m: Samples, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def wait_connected(url: str, timeout: float = 30.0) -> None:
    """Until the verify service at url reports its draft connected."""
    end = time.monotonic() + timeout
    while value(scrape(url), "treespec:draft_connected") != 1:
        assert time.monotonic() < end, "the verify service never connected to its draft"
        time.sleep(0.1)
