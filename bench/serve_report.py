"""How `tandem bench serve` shows its figures: a table per load level, and PNG plots."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tandem.bench.load_generator import METRICS, PERCENTILES

TARGET_SERVER_VS_OFFLINE = 0.9

_COLUMNS = [("req/s", "request_throughput"), ("out tok/s", "output_tok_s"), ("goodput", "goodput_req_s"),
            ("fail", "num_failed")] + [(f"{m.upper()} p{p}", f"{m}_p{p}_ms") for m in METRICS for p in (50, 99)]


def print_serve_table(figures: dict[str, Any], file: Any = None) -> None:
    levels = [k for k in figures["load_levels"].split(",")]
    if "compare_concurrency" in figures and f"conc{figures['compare_concurrency']}" not in levels:
        levels.append(f"conc{figures['compare_concurrency']}")
    header = ["level"] + [name for name, _ in _COLUMNS]
    rows = [[lv] + [_fmt(figures.get(f"{lv}_{suffix}")) for _, suffix in _COLUMNS] for lv in levels]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    whole = "; answered whole, so TTFT is E2E" if figures.get("stream") is False else ""
    slo = f"TTFT <= {figures['slo_ttft_ms']:g} ms and TPOT <= {figures['slo_tpot_ms']:g} ms"
    lines = [f"tandem bench serve: {figures.get('url', '')}  ({figures['num_requests']} requests{whole}; latencies "
             f"in ms; goodput = req/s with {slo})"]
    for row in [header] + rows:
        lines.append("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    if "server_vs_offline_throughput" in figures:
        ratio = figures["server_vs_offline_throughput"]
        verdict = "PASS" if ratio >= TARGET_SERVER_VS_OFFLINE else "FAIL"
        lines.append(f"server_vs_offline_throughput {ratio:.3f} (server {figures['server_output_tok_s']:.1f} vs "
                     f"offline {figures['offline_output_tok_s']:.1f} out tok/s at {figures['compare_concurrency']} "
                     f"in flight; target >= {TARGET_SERVER_VS_OFFLINE}: {verdict})")
    print("\n".join(lines), file=file, flush=True)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return "nan" if math.isnan(value) else f"{value:.1f}"


def plot_serve(path: str, figures: dict[str, Any]) -> None:
    """Latency percentiles and throughput per load level (drawn from the figures alone)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = figures["load_levels"].split(",")
    x = np.arange(len(levels))
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for ax, metric in zip(axes[:3], ("ttft", "tpot", "itl"), strict=True):
        for p, style in zip(PERCENTILES, ("o-", "s--", "^:"), strict=True):
            ax.plot(x, [figures[f"{lv}_{metric}_p{p}_ms"] for lv in levels], style, label=f"p{p}")
        slo = figures.get(f"slo_{metric}_ms")
        if slo is not None:
            ax.axhline(slo, color="red", linewidth=0.8, label="SLO")
        ax.set_title(f"{metric.upper()} (ms)")
        ax.set_xticks(x, levels)
        ax.legend(fontsize=8)
    ax = axes[3]
    ax.plot(x, [figures[f"{lv}_output_tok_s"] for lv in levels], "o-", label="output tok/s")
    if "offline_output_tok_s" in figures:
        in_flight = figures["compare_concurrency"]
        ax.axhline(figures["server_output_tok_s"], color="tab:blue", linestyle="--",
                   label=f"server, {in_flight} in flight")
        ax.axhline(figures["offline_output_tok_s"], color="gray", linestyle="--",
                   label=f"offline engine, {in_flight} in flight")
    ax.set_title("throughput")
    ax.set_xticks(x, levels)
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(x, [figures[f"{lv}_goodput_req_s"] for lv in levels], "s:", color="tab:green", label="goodput req/s")
    twin.set_ylabel("goodput (req/s)")
    twin.set_ylim(bottom=0)
    ax.legend(loc="lower left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    title = f"tandem bench serve: {figures['num_requests']} requests"
    if "server_vs_offline_throughput" in figures:
        title += f"; server / offline throughput {figures['server_vs_offline_throughput']:.2f}"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line -----------------------------------------------------------------------------------
