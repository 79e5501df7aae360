"""/metrics in the Prometheus text format (version 0.0.4), written by hand: a few gauges,
counters and one histogram do not need a client library."""

from __future__ import annotations

from kvlm.engine.metrics import TTFT_BUCKETS

# (name, type, help, key): key in AsyncEngine.metrics() (Engine.snapshot() and more).
_SERIES = [
    ("requests_running", "gauge", "Sequences holding cache blocks.", "running"),
    ("requests_waiting", "gauge", "Sequences queued for admission.", "waiting"),
    ("kv_blocks_used", "gauge", "KV cache blocks referenced by sequences.", "blocks_used"),
    ("kv_blocks_free", "gauge", "KV cache blocks free, cached ones included.", "blocks_free"),
    ("kv_blocks_total", "gauge", "KV cache blocks in the pool.", "blocks_total"),
    ("kv_blocks_pinned", "gauge",
     "KV cache blocks held for stored responses and cache_control marks (in used).",
     "blocks_pinned"),
    ("prefix_cache_queries_total", "counter", "Prompt tokens looked up.", "prefix_queries"),
    ("prefix_cache_hits_total", "counter", "Prompt tokens served from cache.", "prefix_hits"),
    ("prefix_cache_hit_rate", "gauge", "Prefix cache hits over queries.", "prefix_hit_rate"),
    ("prefix_cache_evictions_total", "counter", "Cached blocks reused.", "prefix_evictions"),
    ("prefix_cache_window_lookups_total", "counter",
     "Hybrid-model admissions whose global layers' blocks matched.", "prefix_window_lookups"),
    ("prefix_cache_window_cut_total", "counter", "Of those, hits cut short: the windowed "
     "layers' blocks before the hit had been reused, or the conv layers' rows at its end "
     "were not held.", "prefix_window_cut"),
    ("prefix_cache_window_cut_tokens_total", "counter",
     "Prompt tokens recomputed by hits cut short.", "prefix_window_cut_tokens"),
    ("preemptions_total", "counter", "Sequences preempted (recomputed).", "preemptions"),
    ("requests_total", "counter", "Requests accepted.", "requests_added"),
    ("requests_finished_total", "counter", "Requests finished.", "requests_finished"),
    ("requests_aborted_total", "counter", "Requests aborted.", "aborted"),
    ("engine_errors_total", "counter", "Engine steps that raised.", "errors"),
    ("engine_steps_total", "counter", "Engine steps run.", "steps"),
    ("engine_step_seconds_total", "counter", "Time in engine steps.", "step_seconds"),
    ("engine_step_seconds_max", "gauge", "The longest engine step.", "step_seconds_max"),
    ("engine_fused_rows_total", "counter", "Decode rows run by the fused C step.",
     "fused_rows"),
    ("prompt_tokens_computed_total", "counter", "Prompt tokens computed.", "prefill_tokens"),
    ("generation_tokens_total", "counter", "Tokens generated.", "generated_tokens"),
    ("requests_held", "gauge", "Requests accepted and not finished.", "requests_held"),
    ("generation_tokens_per_second", "gauge", "Tokens per second, last 10 s.", "tokens_per_s"),
    ("spec_draft_tokens_total", "counter", "Tokens proposed (speculative).", "spec_drafted"),
    ("spec_accepted_tokens_total", "counter", "Proposed tokens accepted.", "spec_accepted"),
    ("spec_acceptance_rate", "gauge", "Accepted over proposed tokens.", "spec_acceptance"),
    ("spec_tokens_per_forward", "gauge",
     "Tokens a sequence gained per verifying forward.", "spec_tokens_per_forward"),
]  # fmt: skip


def render_metrics(values: dict) -> str:
    """/metrics from AsyncEngine.metrics(): the engine's snapshot and the requests held."""
    lines: list[str] = []
    for name, kind, help_, key in _SERIES:
        lines += [*_head(f"kvlm_{name}", kind, help_), f"kvlm_{name} {values[key]:g}"]

    lines += _group_lines(values["kv_groups"])
    lines += _tier_lines(values["tiers"], values["tier_dropped_writes"])

    name = "kvlm_time_to_first_token_seconds"
    lines += _head(name, "histogram", "Time from arrival to first token.")
    for bound, count in zip(TTFT_BUCKETS, values["ttft_counts"], strict=True):
        lines.append(f'{name}_bucket{{le="{bound:g}"}} {count}')
    lines.append(f'{name}_bucket{{le="+Inf"}} {values["ttft_count"]}')
    lines.append(f"{name}_sum {values['ttft_sum']:g}")
    lines.append(f"{name}_count {values['ttft_count']}")
    return "\n".join(lines) + "\n"


# (name, type, help, TierStats field): one series per tier, labelled tier="disk" etc.
_TIER_SERIES = [
    ("kv_tier_hits_total", "counter", "Blocks loaded from the tier.", "hits"),
    ("kv_tier_misses_total", "counter", "Blocks asked of the tier and not there.", "misses"),
    ("kv_tier_refused_total", "counter", "Records that did not verify.", "refused"),
    ("kv_tier_read_bytes_total", "counter", "Bytes read from the tier.", "bytes_read"),
    ("kv_tier_written_bytes_total", "counter", "Bytes written to the tier.", "bytes_written"),
    ("kv_tier_writes_total", "counter", "Blocks written to the tier.", "writes"),
    ("kv_tier_errors_total", "counter", "Tier calls that failed (down, full, slow).", "errors"),
    ("kv_tier_timeouts_total", "counter", "Lookups past the tier's deadline.", "timeouts"),
    ("kv_tier_up", "gauge", "1 while the tier answers, 0 while it is skipped.", "up"),
]

_TIER_LATENCY = [
    ("kv_tier_read_seconds", "Time per lookup of the tier (a request's blocks).",
     "read_seconds", "reads"),
    ("kv_tier_write_seconds", "Time per block written to the tier.", "write_seconds", "writes"),
]  # fmt: skip


# (name, help, key of kvlm.cache.view.layer_groups): one series per layer group, labelled
# group="0" and window="none" (every layer, or the ones that see everything) or the window
_GROUP_SERIES = [
    ("kv_group_blocks_used", "KV blocks of the layer group referenced by sequences.", "used"),
    ("kv_group_blocks_total", "KV blocks of the layer group's pool.", "num_blocks"),
    ("kv_group_bytes_used", "Bytes of the layer group's blocks in use.", "used_bytes"),
    ("kv_group_bytes_total", "Bytes of the layer group's pool.", "total_bytes"),
]


# a state group's (kvlm.cache.slots: conv rows, a DeltaNet's state), beside those
_STATE_SERIES = [
    ("kv_group_end_states", "Block ends whose state the layer group holds for prefix hits "
     "(conv rows, gated DeltaNet snapshots).", "blocks_with_rows"),
]  # fmt: skip


def _group_lines(groups: list[dict]) -> list[str]:
    lines: list[str] = []
    states = [g for g in groups if "blocks_with_rows" in g]
    for series, which in ((_GROUP_SERIES, groups), (_STATE_SERIES, states)):
        for name, help_, key in series:
            if not which:
                continue
            lines += _head(f"kvlm_{name}", "gauge", help_)
            for g in which:
                window = "none" if g["window"] is None else g["window"]
                labels = f'group="{g["group"]}",window="{window}",layers="{len(g["layers"])}"'
                lines.append(f"kvlm_{name}{{{labels}}} {g[key]:g}")
    return lines


def _tier_lines(tiers: dict[str, dict] | None, dropped: int) -> list[str]:
    """Each tier's series, labelled by name: `tiers` maps a tier to its TierStats' fields."""
    if tiers is None:
        return []
    lines: list[str] = []
    for name, kind, help_, key in _TIER_SERIES:
        lines += _head(f"kvlm_{name}", kind, help_)
        for tier, stats in tiers.items():
            lines.append(f'kvlm_{name}{{tier="{tier}"}} {float(stats[key]):g}')
    for name, help_, total, count in _TIER_LATENCY:
        lines += _head(f"kvlm_{name}", "summary", help_)
        for tier, stats in tiers.items():
            lines.append(f'kvlm_{name}_sum{{tier="{tier}"}} {stats[total]:g}')
            lines.append(f'kvlm_{name}_count{{tier="{tier}"}} {stats[count]}')
    name = "kvlm_kv_tier_dropped_writes_total"
    lines += _head(name, "counter", "Block writes dropped: the writer's queue was full.")
    return [*lines, f"{name} {dropped}"]


def _head(name: str, kind: str, help_: str) -> list[str]:
    """A series' HELP and TYPE lines."""
    return [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
