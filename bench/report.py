"""Presenting a benchmark's figures: a table on stdout, one flat JSON object, PNG plots.

Figures are one flat dict of named numbers (plus a few strings naming the set-up). The names
are an interface: later issues read them and add their own. Plots are drawn from that dict
alone, so a JSON file can be re-plotted without re-running anything.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

# The issues' targets (2-core CPU, built-in benchmark model, float32, TP = 1, unless said).
TARGETS: dict[str, tuple[str, float]] = {
    "throughput_ratio_vs_hf_static": (">=", 3.0),
    "throughput_ratio_vs_hf_sequential": (">=", 8.0),
    "mfu": (">=", 0.5),
    "tpot_ratio_vs_hf": ("<=", 1.0),
    "mbu": (">=", 0.6),
    "engine_overhead": ("<=", 1.15),
    "hidden_fraction": (">=", 0.5),
    "server_vs_offline_throughput": (">=", 0.9),
    "tpot_speedup": (">=", 2.0),
    "saturation_throughput_ratio": (">=", 0.95),
    "hit_ttft_ratio": ("<=", 0.3),
    "routed_ttft_ratio": ("<=", 0.6),
    "no_share_overhead": ("<=", 0.03),
    "lost": ("<=", 0),
    "unexpected_5xx": ("<=", 0),
    "leaked_kv_blocks": ("<=", 0),
    "overload_goodput_ratio": (">=", 0.8),
    "recovery_s_max": ("<=", 30.0),
    "groups_hurt_by_one_request": ("<=", 0),
    "preemptions": (">=", 1),
    "observability_throughput_ratio": (">=", 0.98),
    "telemetry_cpu_share": ("<=", 0.02),
    "structured_tpot_ratio_b1": ("<=", 1.05),
    "structured_tpot_ratio_b32": ("<=", 1.10),
    # One GPU, bf16, --bench-model llama-1b.
    "tpot_ratio_vs_hf_compiled": ("<=", 0.7),
    "gpu_busy": (">=", 0.85),
}

# The figures `tandem bench soak` prints (its JSON has many more).
SOAK_ROWS = ("sent", "completed", "rejected", "failed_clean", "failed_abrupt", "lost", "unexpected_5xx", "abandoned",
             "invalid_answered", "invalid_accepted", "wrong_output", "wrong_output_checked", "leaked_kv_blocks",
             "hostile_requests", "groups_hurt_by_one_request", "long_prompts", "preemptions", "slow_readers",
             "slow_readers_completed", "capacity_req_s", "goodput_capacity_req_s", "goodput_overload_req_s",
             "overload_goodput_ratio", "recovery_s_max", "wall_s")

Figures = dict[str, Any]
Plot = Callable[[str, Figures], None]


def log_progress(command: str, show: bool, message: str) -> None:
    """One line of a server benchmark's progress on stderr (`[bench serve] ...`)."""
    if show:
        print(f"[bench {command}] {message}", file=sys.stderr, flush=True)


def meets_target(name: str, value: float) -> bool | None:
    if name not in TARGETS or value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    op, bound = TARGETS[name]
    return value >= bound if op == ">=" else value <= bound


def format_value(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 1e9:
        return f"{value:.3g}"
    if magnitude >= 100:
        return f"{value:,.1f}"
    return f"{value:.3f}"


def print_table(title: str, rows: list[tuple[str, Any, str]], file: Any = None) -> None:
    """rows: (name, value, unit). Rows with a target get a target column and PASS/FAIL."""
    lines = []
    for name, value, unit in rows:
        target = ""
        if name in TARGETS:
            op, bound = TARGETS[name]
            ok = meets_target(name, value)
            target = f"{op} {bound:g}  " + ("PASS" if ok else "FAIL" if ok is False else "-")
        lines.append((name, format_value(value), unit, target))
    widths = [max(len(row[i]) for row in lines + [("figure", "value", "unit", "target")]) for i in range(4)]
    rule = "-" * (sum(widths) + 6)
    out = [title, rule, _row(("figure", "value", "unit", "target"), widths), rule]
    out += [_row(row, widths) for row in lines]
    out.append(rule)
    print("\n".join(out), file=file, flush=True)


def _row(cells: tuple[str, str, str, str], widths: list[int]) -> str:
    name, value, unit, target = cells
    return f"{name:<{widths[0]}}  {value:>{widths[1]}}  {unit:<{widths[2]}}  {target}".rstrip()


def write_json(path: str, figures: Figures) -> None:
    """One flat JSON object; NaN/inf become null so any JSON reader can load it."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in figures.items()}
    assert all(not isinstance(v, dict) for v in clean.values()), "figures must stay flat"
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean, f, indent=2, sort_keys=True)
        f.write("\n")


def write_outputs(figures: Figures, output_json: str | None, plot_path: str | None, plot: Plot | None) -> None:
    """What --output-json and --plot ask for; each file written is named on stderr."""
    if output_json:
        write_json(output_json, figures)
        print(f"wrote {output_json}", file=sys.stderr)
    if plot_path:
        if plot is None:
            print("no plot for this benchmark", file=sys.stderr)
        else:
            plot(plot_path, figures)
            print(f"wrote {plot_path}", file=sys.stderr)


def warn_if_busy(figures: Figures) -> None:
    """Warn when other processes shared this machine's CPU during a CPU run: its figures are unreliable.

    Busy: a load average above the cores + 1 (this run), or (where measured) this process
    getting under 70% of its threads' CPU time."""
    if figures.get("device", "cpu") != "cpu":
        return
    cores = figures.get("cpu_count") or 1
    load = max(figures.get("load_average_1m", 0.0), figures.get("load_average_1m_end", 0.0))
    share = figures.get("process_cpu_share")
    if load > cores + 1 or (share is not None and share < 0.7):
        got = "" if share is None else f", this process got {share:.0%} of its threads' CPU time"
        print(f"warning: load average {load:.1f} on {cores} cores{got}: other processes shared the CPU, so these "
              "figures are unreliable", file=sys.stderr)


# ---- plots -------------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib
    matplotlib.use("Agg")  # files only: works with no display, and in threads
    import matplotlib.pyplot as plt
    return plt


def plot_offline(path: str, figures: Figures) -> None:
    """Output tokens/s per system, each bar labelled with tandem's ratio over it."""
    plt = _pyplot()
    systems = [(key, label) for key, label in (("tandem", "tandem"), ("hf_static", "transformers\nstatic batch 16"),
                                               ("hf_sequential", "transformers\none at a time"))
               if figures[f"{key}_output_tok_s"] is not None]  # a baseline may be left out
    values = [figures[f"{key}_output_tok_s"] for key, _ in systems]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bars = ax.bar([label for _, label in systems], values, color=["tab:blue", "tab:orange", "tab:gray"][:len(systems)])
    for bar, (key, _) in zip(bars, systems, strict=True):
        label = f"{bar.get_height():,.0f} tok/s"
        if key != "tandem":
            label += f"\n(tandem {figures[f'throughput_ratio_vs_{key}']:.2f}x)"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=9)
    ax.set_ylabel("output tokens / s (median of repeats)")
    ax.set_ylim(0, max(values) * 1.25)
    ax.set_title(f"Offline throughput, {figures['num_requests']} requests "
                 f"({figures['device']}, {figures['dtype']}; MFU {figures['mfu']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sampled(figures: Figures) -> str:
    """A title's note of tandem's sampling temperature (nothing when greedy)."""
    temperature = figures.get("temperature")
    return f"; tandem sampling at temperature {temperature:g}" if temperature else ""


def sweep_batches(figures: Figures) -> list[int]:
    return sorted(int(k[len("sweep_b"):-len("_tpot_ms")]) for k in figures
                  if k.startswith("sweep_b") and k.endswith("_tpot_ms"))


def plot_latency(path: str, figures: Figures) -> None:
    """Three panels: batch-1 TPOT; throughput against TPOT over the batch sweep; MFU/MBU by batch."""
    plt = _pyplot()
    batches = sweep_batches(figures)
    tpot = [figures[f"sweep_b{b}_tpot_ms"] for b in batches]
    tok_s = [figures[f"sweep_b{b}_tok_s"] for b in batches]
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.3, 1.6, 1.6]})

    names = ["tandem\nengine step", "tandem\nbare forward"]
    values = [figures["tpot_tandem_ms"], figures["bare_forward_ms"]]
    if figures.get("tpot_hf_ms") is not None:
        names.append("transformers\ngenerate")
        values.append(figures["tpot_hf_ms"])
    if figures.get("tpot_hf_compiled_ms") is not None:
        names.append("transformers\nstatic + compile")
        values.append(figures["tpot_hf_compiled_ms"])
    bars = ax0.bar(names, values, color=["tab:blue", "tab:cyan", "tab:orange", "tab:red"][:len(values)])
    for bar in bars:
        ax0.annotate(f"{bar.get_height():.2f} ms", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                     ha="center", va="bottom", fontsize=9)
    ax0.tick_params(axis="x", labelsize=8)
    ax0.set_ylabel("ms per output token (batch 1)")
    compiled = figures.get("tpot_ratio_vs_hf_compiled")
    eager = figures.get("tpot_ratio_vs_hf")
    ax0.set_title("Batch-1 TPOT: " + (f"ratio {eager:.2f}" if eager is not None else "tandem alone")
                  + (f" ({compiled:.2f} vs compiled)" if compiled is not None else "")
                  + f", overhead {figures['engine_overhead']:.2f}", fontsize=10)

    knee = figures.get("compute_bound_from_batch")
    ax1.plot(tpot, tok_s, "o-", color="tab:blue")
    for b, x, y in zip(batches, tpot, tok_s, strict=True):
        ax1.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, -12), fontsize=8)
        if b == knee:
            ax1.plot([x], [y], "r*", markersize=16, label=f"compute-bound from B={b}")
    ax1.set_xlabel("time per output token (ms)")
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("Decode throughput against latency as the batch grows", fontsize=10)
    if knee is not None:
        ax1.legend(loc="lower right", fontsize=8)

    ax2.plot(batches, [figures[f"sweep_b{b}_mbu"] for b in batches], "s-", label="MBU (copy bandwidth)")
    ax2.plot(batches, [figures[f"sweep_b{b}_mfu"] for b in batches], "o-", label="MFU (matmul FLOP/s)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(batches, [str(b) for b in batches])
    ax2.set_xlabel("batch size (requests decoding together)")
    ax2.set_ylabel("utilisation")
    if knee is not None:
        ax2.axvline(knee, color="red", linestyle="--", label=f"measured: compute-bound from B={knee}")
    roof = figures.get("roofline_crossover_batch")
    if roof is not None and math.isfinite(roof):
        ax2.axvline(roof, color="gray", linestyle=":", label=f"roofline ridge at B={roof:g}")
    ax2.legend(fontsize=8)
    ax2.set_title("Memory-bound (MBU > MFU) turning compute-bound", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
