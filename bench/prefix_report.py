"""How `tandem bench prefix` shows its figures: the table rows, the title, the plot."""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.bench.prefix_workload import LABELS, POLICIES


def table_rows(figures: dict[str, Any]) -> list[tuple[str, Any, str]]:
    names = ["routed_ttft_ratio", "hit_ttft_ratio", "no_share_overhead"]
    for stem in ("routed", "load_only", "no_share_routed", "no_share_load_only"):
        names += [f"{stem}_{key}" for key in ("ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms", "hit_rate")]
        names += [f"{stem}_same_group_rounds" if stem.startswith("no_share") else f"{stem}_groups_per_prefix"]
        names += [f"{stem}_num_failed"]
    names += ["hit_ttft_ms", "cold_ttft_ms", "hit_pair_min_cached_tokens", "cache_tokens_per_group",
              "load_average_1m", "load_average_1m_end", "wall_s"]
    return [(n, figures[n], "ms" if n.endswith("_ms") else "s" if n.endswith("_s") else "")
            for n in names if n in figures]


def title(figures: dict[str, Any]) -> str:
    return (f"tandem bench prefix: {figures['num_groups']} groups, {figures['num_prefixes']} prefixes of "
            f"{figures['prefix_len']} + {figures['suffix_len']} own tokens, {figures['num_requests']} requests "
            f"at {figures['request_rate']:g} req/s, median of {figures['repeats']} repeats")


def plot_prefix(path: str, figures: dict[str, Any]) -> None:
    """TTFT CDF per policy on both workloads (repeats pooled), and the cold/hit pair medians."""
    from tandem.bench.report import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (workload, stem) in zip(axes[:2], (("shared", ""), ("no-share", "no_share_")), strict=True):
        for policy, color in zip(POLICIES, ("tab:blue", "tab:orange"), strict=True):
            samples = figures[f"{stem}{LABELS[policy]}_ttft_samples_ms"]
            fraction = np.arange(1, len(samples) + 1) / max(1, len(samples))
            ax.step(samples, fraction, where="post", color=color, label=f"routing {policy!r} (p50 "
                    f"{figures[f'{stem}{LABELS[policy]}_ttft_p50_ms']:.0f} ms)")
        ratio = figures["routed_ttft_ratio"] if not stem else 1 + figures["no_share_overhead"]
        ax.set_title(f"{workload} workload, all repeats: TTFT CDF (p50 prefix / load {ratio:.2f})", fontsize=10)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xlim(left=0)
        ax.legend(fontsize=8, loc="lower right")
    ax = axes[2]
    bars = ax.bar(["cold prefill", "prefix cached"], [figures["cold_ttft_ms"], figures["hit_ttft_ms"]],
                  color=["tab:gray", "tab:green"])
    for bar in bars:
        ax.annotate(f"{bar.get_height():.0f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_title(f"one request alone: hit / cold = {figures['hit_ttft_ratio']:.2f}", fontsize=10)
    ax.set_ylabel("TTFT (ms, median of pairs)")
    fig.suptitle(title(figures), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
