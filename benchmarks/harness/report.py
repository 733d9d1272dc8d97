"""What a benchmark prints and writes: fixed-width text tables, markdown tables, a mean with its standard error,
PNG plots of curves over seeds and of where the time goes, and the JSON results (``benchmarks/results/``)."""

from __future__ import annotations

import json
import statistics
from collections import namedtuple
from pathlib import Path

from .figures import eval_curve, reward_curve, seed_mean
from .training import PHASE_LABELS, PHASES

RESULTS = Path("benchmarks/results")  # from the repository root, where the benchmarks run


def result_path(name: str) -> str:
    """``benchmarks/results/NAME.json``: a benchmark's default ``--json``."""
    return str(RESULTS / f"{name}.json")


def runs_path(summary_path) -> Path:
    """Where the per-step records of a run saved at ``summary_path`` go (``*_runs.json``, git-ignored)."""
    summary_path = Path(summary_path)
    return summary_path.with_name(summary_path.stem + "_runs.json")


def write_json(path, data, indent=1, compact=False) -> Path:
    """``data`` as JSON at ``path`` (its folder made; ``compact``: no whitespace, for large per-step records)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, separators=(",", ":")) if compact else json.dumps(data, indent=indent))
    return path


def read_json(path):
    return json.loads(Path(path).read_text())


def without_per_seed(rows):
    """Summary rows without their per-seed figures (those go under ``per_seed``, by method)."""
    return [{k: v for k, v in r.items() if k != "per_seed"} for r in rows]


def pm(mean, se, digits=3):
    """``mean ± se``, ``-`` when there is no mean."""
    return "-" if mean is None else f"{mean:.{digits}f} ± {se:.{digits}f}"


def _target_cell(key):
    """``mean ± SE (reached/seeds)`` of one of ``targets.TARGET_RATIOS`` in a summary row."""
    return lambda r: f"{pm(r[key + '_mean'], r[key + '_se'], 2)} ({r[key + '_reached']})"


# The text columns of the 90%-of-rise figures (``targets.target_figures``), for ``text_table``.
TARGET_COLUMNS = [
    ("method", -13, "method:"),
    ("steps (train)", 22, _target_cell("steps_to_90_ratio")),
    ("time (train)", 22, _target_cell("time_to_90_ratio")),
    ("steps (held-out)", 22, _target_cell("heldout_steps_to_90_ratio")),
    ("time (held-out)", 22, _target_cell("heldout_time_to_90_ratio")),
    ("held-out - GRPO, 95% CI", 26,
     lambda r: "-" if r["heldout_final_diff_ci"] is None else "[{:+.3f}, {:+.3f}]".format(*r["heldout_final_diff_ci"])),
]


def text_table(rows, columns) -> str:
    """A text table, laid out by ``tabulate``. ``columns``: ``(header, align, cell)``; ``cell`` a function of a
    row, or ``"key:spec"`` (``row[key]`` formatted, ``-`` for None); ``align`` negative or 0 aligns left, positive
    right; a ``\\n`` in a header starts its second header line."""
    from tabulate import tabulate

    def text(row, cell):
        if callable(cell):
            return cell(row)
        key, _, spec = cell.partition(":")
        return "-" if row[key] is None else format(row[key], spec)

    return tabulate([[text(row, cell) for _, _, cell in columns] for row in rows],
                    headers=[header for header, _, _ in columns], tablefmt="simple", disable_numparse=True,
                    colalign=["right" if align > 0 else "left" for _, align, _ in columns])


def print_table(rows, columns, title) -> None:
    print(f"\n{title}")
    print(text_table(rows, columns))


def md_table(header, rows) -> str:
    """A markdown table of string cells, unpadded (``tabulate`` pads every cell to its column's width, so a changed
    figure would rewrite every line of a table in the docs' diffs)."""
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def phase_shares(row) -> str:
    """``gen/score/loss/other``: a summary row's median shares of the wall time."""
    return "/".join(f"{row['phase_share'][p]:.2f}" for p in PHASES)


# A plot panel: ``curve(run) -> (x, y)``, averaged over the seeds of each method; ``title`` may use ``{seeds}``.
Panel = namedtuple("Panel", ["curve", "xlabel", "ylabel", "title", "style"])


def reward_panels(window, eval_label="greedy held-out accuracy") -> list[Panel]:
    """The sampled reward (trailing mean of ``window`` generation batches) and the held-out evaluation, each
    against wall time."""
    wall = "wall seconds (evaluation excluded)"
    return [
        Panel(lambda r: reward_curve(r, window), wall, f"sampled reward (trailing mean of {window} batches)",
              "Reward vs wall time (mean of {seeds} seeds)", dict(lw=1.4)),
        Panel(eval_curve, wall, eval_label, "Held-out evaluation vs wall time (mean of {seeds} seeds)",
              dict(marker="o", ms=3, lw=1.4)),
    ]


def phase_seconds(row) -> dict:
    """A summary row's seconds per phase: ``phase_s``, or the median over its seeds."""
    if "phase_s" in row:
        return row["phase_s"]
    return {p: statistics.median(s["phases"][p] for s in row["per_seed"]) for p in PHASES}


def plot_runs(runs, rows, panels, directory, prefix, breakdown_title) -> list[str]:
    """``PREFIX_curves.png`` (one panel per ``panels``, a line per method of ``rows``, the mean over its seeds,
    point by point) and ``PREFIX_breakdown.png`` (each method's median seconds per phase) under ``directory``;
    returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = [r["method"] for r in rows]
    colors = dict(zip(names, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 3))
    seeds = len({r["seed"] for r in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2))
    for ax, panel in zip(axes, panels):
        for method in names:
            mine = [r for r in runs if r["method"] == method]
            if mine:
                ax.plot(*seed_mean([panel.curve(r) for r in mine]), color=colors[method], label=method, **panel.style)
        ax.set(xlabel=panel.xlabel, ylabel=panel.ylabel, title=panel.title.format(seeds=seeds))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    written = [directory / f"{prefix}_curves.png"]
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.2))
    left = [0.0] * len(rows)
    for phase in PHASES:
        widths = [phase_seconds(r)[phase] for r in rows]
        ax.barh(names, widths, left=left, label=PHASE_LABELS[phase])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set(xlabel="seconds (median over seeds)", title=breakdown_title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4)
    fig.tight_layout()
    written.append(directory / f"{prefix}_breakdown.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return [str(p) for p in written]


def plot_projection(projection, path, paper_speedup=None, typical_share=None) -> str:
    """``path`` (a PNG): each method's projected speedup over GRPO (1 / time ratio, with its SE) against the share
    of generation in GRPO's step, with the paper's speedup and a typical GPU share marked where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for method in dict.fromkeys(p["method"] for p in projection):
        mine = [p for p in projection if p["method"] == method]
        speed = [1 / p["time_ratio"] for p in mine]
        err = [p["time_ratio_se"] / p["time_ratio"] ** 2 for p in mine]  # the SE of 1/x, to first order
        ax.errorbar([p["generation_share"] for p in mine], speed, yerr=err, marker="o", ms=3, capsize=2, label=method)
    if paper_speedup:
        ax.axhline(paper_speedup, color="grey", ls="--", lw=1, label=f"paper: {paper_speedup}x")
    if typical_share:
        ax.axvline(typical_share, color="grey", ls=":", lw=1, label=f"typical GPU run: {typical_share:.0%}")
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set(xlabel="generation's share of GRPO's step", ylabel="speedup over GRPO to the target (x)",
           title="Learning per step x time per step, projected")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
