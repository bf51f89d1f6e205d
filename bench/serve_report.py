"""How `tandem bench serve` shows its figures: a table per load level, and PNG plots."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tandem.bench.load_generator import METRICS, PERCENTILES

TARGET_SERVER_VS_OFFLINE = 0.9

_SERVED_PATH_LEVELS = ("single_stream", "stall_off", "stall_on")  # bench/serve_figures.py's
_COLUMNS = [("req/s", "request_throughput"), ("out tok/s", "output_tok_s"), ("goodput", "goodput_req_s"),
            ("fail", "num_failed")] + [(f"{m.upper()} p{p}", f"{m}_p{p}_ms") for m in METRICS for p in (50, 99)]


def print_serve_table(figures: dict[str, Any], file: Any = None) -> None:
    levels = [k for k in figures["load_levels"].split(",")]
    if "compare_concurrency" in figures and f"conc{figures['compare_concurrency']}" not in levels:
        levels.append(f"conc{figures['compare_concurrency']}")
    levels += [key for key in _SERVED_PATH_LEVELS if f"{key}_num_failed" in figures]
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
    lines += served_path_lines(figures)
    print("\n".join(lines), file=file, flush=True)


def served_path_lines(figures: dict[str, Any]) -> list[str]:
    """One line per figure of the served path (bench/serve_figures.py) the run measured."""
    lines = []
    if "server_cpu_us_per_token" in figures:
        lines.append(f"server_cpu_us_per_token {figures['server_cpu_us_per_token']:.1f} (server process tree: "
                     f"{figures['server_cpu_s']:.2f} CPU s, {figures['server_cpu_cores']:.2f} cores on average, "
                     f"{figures['server_num_processes']} processes, at {figures['compare_concurrency']} in flight)")
    if "single_stream_itl_ratio" in figures:
        step = figures["simulated_step_base_ms"] + figures["simulated_step_per_seq_ms"]
        lines.append(f"single_stream_itl_ratio {figures['single_stream_itl_ratio']:.3f} (ITL p50 "
                     f"{figures['single_stream_itl_p50_ms']:.2f} ms, one stream at a time, over the simulated "
                     f"step of one sequence, {step:g} ms)")
    if "stall_itl_p99_ratio" in figures:
        overlap = "" if figures["stall_overlapped"] else "; the streams had ended before it was sent"
        lines.append(f"stall_itl_p99_ratio {figures['stall_itl_p99_ratio']:.3f} (ITL p99 of "
                     f"{figures['stall_streams']} streams {figures['stall_on_itl_p99_ms']:.1f} ms with a "
                     f"{figures['stall_prompt_bytes']}-byte text prompt arriving vs "
                     f"{figures['stall_off_itl_p99_ms']:.1f} ms without; ITL max {figures['stall_on_itl_max_ms']:.1f}"
                     f" vs {figures['stall_off_itl_max_ms']:.1f} ms, x{figures['stall_itl_max_ratio']:.2f}; the "
                     f"prompt's answer: HTTP "
                     f"{figures['stall_request_status']} after {figures['stall_request_s']:.2f} s{overlap})")
    return lines


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
