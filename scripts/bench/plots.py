"""All the benchmarks' plots. Figures are built with matplotlib's Figure class, without pyplot's global state or a
display, and written atomically as PNG files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .common import UsageError, setting_text, write_png
from .contenders import AR


def import_figure() -> Any:
    """matplotlib's Figure class; a one-line usage error where matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError('matplotlib is not installed: pip install -e ".[bench]"') from None
    return Figure


def write_decode_plots(Figure: Any, summary: list[dict], costs: dict[int, float], source: str,
                       marks: dict[str, int], out: Path) -> None:
    """speedup.png, compression_vs_flops.png and (when costs were measured) step_cost.png in out."""
    plot_speedups(Figure, summary, out / "speedup.png")
    plot_compression_vs_flops(Figure, summary, out / "compression_vs_flops.png")
    if costs:
        plot_step_costs(Figure, costs, source, marks, out / "step_cost.png")


def plot_speedups(Figure: Any, summary: list[dict], path: Path) -> None:
    """Speedup vs minilade AR per dataset (groups) and contender (bars), one panel per temperature."""
    temperatures = sorted({s["temperature"] for s in summary})
    fig = Figure(figsize=(7 * len(temperatures), 4.5))
    axes = fig.subplots(1, len(temperatures), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rows = [s for s in summary if s["temperature"] == temperature and s["config"] != AR]
        datasets = list(dict.fromkeys(s["dataset"] for s in rows))
        labels = list(dict.fromkeys(s["config"] for s in rows))
        width = 0.8 / max(1, len(labels))
        for j, label in enumerate(labels):
            values = {s["dataset"]: s["speedup_vs_ar"] for s in rows if s["config"] == label}
            xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(datasets))]
            ax.bar(xs, [values.get(d) or 0 for d in datasets], width, label=label)
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_ylabel("speedup vs minilade AR (median paired ratio)")
        ax.set_title("greedy" if temperature == 0 else f"sampled, T={temperature:g}")
        ax.legend(fontsize=7)
    write_png(path, fig)


def plot_compression_vs_flops(Figure: Any, summary: list[dict], path: Path) -> None:
    """Tokens emitted per forward pass (compression) against FLOPs per step, one line per dataset and
    temperature, one point per lookahead setting; autoregressive decoding is the point at 1 token per pass."""
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    rows = [s for s in summary if s["flops_per_step"] and s["compression"]]
    for dataset, temperature in dict.fromkeys((s["dataset"], s["temperature"]) for s in rows):
        points = sorted((s for s in rows if s["dataset"] == dataset and s["temperature"] == temperature),
                        key=lambda s: s["flops_per_step"])
        label = dataset if temperature == 0 else f"{dataset}, T={temperature:g}"
        ax.plot([s["flops_per_step"] for s in points], [s["compression"] for s in points], marker="o",
                linewidth=0.8, label=label)
        for s in points:
            name = "AR" if s["setting"] is None else f"({setting_text(s['setting'])})"
            ax.annotate(name, (s["flops_per_step"], s["compression"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("FLOPs per step (weight matmuls, all G candidates)")
    ax.set_title("FLOPs = 2 x non-embedding params x (W+G)(N-1) + 2 x vocab x dim x rows projected", fontsize=8)
    ax.set_ylabel("tokens per forward pass (compression)")
    ax.legend()
    write_png(path, fig)


def plot_step_costs(Figure: Any, costs: dict[int, float], source: str, marks: dict[str, int], path: Path) -> None:
    """Seconds per forward pass against tokens in the pass, relative to one token.
    marks: label -> tokens fed, annotated where measured (the lookahead settings)."""
    base = costs.get(1) or min(costs.values())
    sizes = sorted(costs)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    ax.plot(sizes, [costs[t] / base for t in sizes], marker="o")
    for label, fed in marks.items():
        if fed in costs:
            ax.annotate(label, (fed, costs[fed] / base), fontsize=7, xytext=(-12, 8), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xscale("log", base=2)
    ticks = [t for t in sizes if t & (t - 1) == 0]  # powers of two: the settings' own sizes are annotated
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("tokens in the forward pass")
    ax.set_ylabel("time per pass / time of a 1-token pass")
    ax.set_title(f"step cost ({source})")
    write_png(path, fig)


def plot_draft_ablation(Figure: Any, results: list[dict], label_key: str, title: str, path: Path) -> None:
    """Compression (tokens per forward pass) per dataset (groups) and draft policy or strategy (bars), each bar
    annotated with the rows it fed per step. results: rows of `replay rank` or `replay live` (dataset,
    label_key, compression, rows_per_step)."""
    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    labels = list(dict.fromkeys(r[label_key] for r in results))
    fig = Figure(figsize=(max(7.0, 0.45 * len(labels) * len(datasets) + 2), 4.8))
    ax = fig.subplots()
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        mine = {r["dataset"]: r for r in results if r[label_key] == label}
        xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(datasets))]
        heights = [mine[d]["compression"] if d in mine else 0 for d in datasets]
        ax.bar(xs, heights, width, label=label)
        for x, d, h in zip(xs, datasets, heights):
            if d in mine:
                ax.annotate(f"{mine[d]['rows_per_step']:.0f}", (x, h), fontsize=6, ha="center",
                            xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("tokens per forward pass (compression)")
    ax.set_title(f"{title} (numbers on bars: rows fed per step)", fontsize=9)
    ax.legend(fontsize=7)
    write_png(path, fig)
