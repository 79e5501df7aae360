"""/metrics of a cluster: every replica's Prometheus text summed into one, series by series.

Each replica writes kvlm.server.metrics' text; the ingress adds it up without knowing the
names, so series added later (labelled ones too, `kvlm_kv_tier_hits_total{tier="disk"}`)
aggregate with no change here. A series is its full name with its labels; the sum is
right for counters, for a histogram's buckets, sum and count, and for gauges that count
things (blocks, requests, tokens per second). It is wrong for a ratio: those are computed
again from their summed parts (RATIOS), or averaged where the parts are not exported
(MEANS), and for a maximum: the largest is taken (MAXES). Then the cluster's own series:
the replicas that answered, and the requests the router sent to each replica (by its Ray
Serve replica id).
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

# a ratio gauge -> its (numerator, denominator) counters
RATIOS = {
    "kvlm_prefix_cache_hit_rate": ("kvlm_prefix_cache_hits_total",
                                   "kvlm_prefix_cache_queries_total"),
    "kvlm_spec_acceptance_rate": ("kvlm_spec_accepted_tokens_total",
                                  "kvlm_spec_draft_tokens_total"),
}  # fmt: skip
MEANS = {"kvlm_spec_tokens_per_forward"}  # per verifying forward: the parts are not exported
MAXES = {"kvlm_engine_step_seconds_max"}  # the longest step of any replica


@dataclass(slots=True)
class RoutedCounts:
    """Requests routed per replica id, written on the router's loop, read by the ingress."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _counts: Counter[str] = field(default_factory=Counter)

    def add(self, replica: str) -> None:
        with self._lock:
            self._counts[replica] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


ROUTED = RoutedCounts()  # kvlm.cluster.router counts, the ingress reads


@dataclass(slots=True)
class _Family:
    help: str = ""
    kind: str = "untyped"
    samples: dict[str, float] = field(default_factory=dict)  # series -> value


def aggregate(texts: list[str], routed: Mapping[str, int]) -> str:
    """One Prometheus text from the replicas' (`texts`, one each) and the routed counts."""
    families: dict[str, _Family] = {}
    for text in texts:
        _add(families, text)
    values = {s: v for f in families.values() for s, v in f.samples.items()}
    for name, (num, den) in RATIOS.items():
        if name in families and den in values:
            families[name].samples[name] = values[num] / values[den] if values[den] else 0.0
    for name in MEANS & families.keys():
        families[name].samples = {s: v / len(texts) for s, v in families[name].samples.items()}
    families["kvlm_replicas"] = _Family("Replicas that answered this scrape.", "gauge",
                                        {"kvlm_replicas": len(texts)})  # fmt: skip
    routed_name = "kvlm_cluster_requests_routed_total"
    families[routed_name] = _Family(
        "Requests the router sent to each replica.", "counter",
        {f'{routed_name}{{replica="{r}"}}': n for r, n in sorted(routed.items())},
    )  # fmt: skip
    return _render(families)


def _add(families: dict[str, _Family], text: str) -> None:
    current: _Family | None = None
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, word, name, *rest = line.split(" ", 3)
            current = families.setdefault(name, _Family())
            if word == "HELP":
                current.help = rest[0] if rest else ""
            else:
                current.kind = rest[0] if rest else "untyped"
        elif line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            if current is None:  # a sample with no HELP/TYPE: its own family
                current = families.setdefault(series.split("{", 1)[0], _Family())
            was, v = current.samples.get(series), float(value)
            if was is not None:
                v = max(was, v) if series in MAXES else was + v
            current.samples[series] = v


def _render(families: dict[str, _Family]) -> str:
    lines: list[str] = []
    for name, family in families.items():
        lines += [f"# HELP {name} {family.help}", f"# TYPE {name} {family.kind}"]
        lines += [f"{series} {_number(v)}" for series, v in family.samples.items()]
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """Exact: an integer as one (1234567, not 1.23457e+06), NaN and infinities as
    Prometheus spells them."""
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() else repr(value)
