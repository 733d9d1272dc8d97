"""Render the benchmark figures of docs/benchmarks.md, README.md and docs/usage.md from benchmarks/results/*.json,
so that a number in the docs cannot drift from its recorded run.

The docs mark each generated part with HTML comments (invisible once rendered); only the text between a pair of
markers is rewritten, the prose around it stays hand-written:

    <!-- generated: bench_balance -->             a table: a name of TABLES
    ...
    <!-- end generated -->
    <!-- generated: bench_reasoning dppo time_per_epoch_ratio inv.2f -->1.98<!-- end generated -->
    <!-- generated: grpo_gamma_gain -->+17%<!-- end generated -->      a name of SPANS (and its arguments)

The inline form ``FILE KEY FIELD FORMAT`` reads ``benchmarks/results/FILE.json``: KEY names a row (``rows``: a
method, ``loss/design``, ...; ``-`` the file's top level; ``K1:K2`` the ratio of FIELD in two rows; ``*`` the
range of FIELD over every row), FIELD a path (dots for nesting, digits index lists; ``a/b`` the ratio of two
fields), FORMAT a ``format()`` spec or ``k`` (thousands: ``203k``), after an optional prefix of OPS (``inv``
1 / x, ``m1`` x - 1, ``c1`` 1 - x, ``min`` seconds to minutes).

    python benchmarks/render_docs.py --check     # exit 1 (and a diff) when a doc differs from the JSON
    python benchmarks/render_docs.py --write     # rewrite the generated parts (make docs)

Every function here is pure: JSON in, markdown text out.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

from harness.report import md_table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ("README.md", "docs/benchmarks.md")
# Docs rendered and checked too (by `make docs` and tests/test_docs_tables.py) that do not quote every figure DOCS
# must: the gradient audit's cost and false-alarm rates (tests/test_audit.py checks them too), the cut's figures.
MORE_DOCS = ("docs/usage.md", "docs/prompt_pruning.md")

# DPPOConfig's defaults as the labels state them (tests/test_docs_tables.py checks them against DPPOConfig).
DEFAULT_DESIGN = "stratified"
DEFAULT_KEEP_RATE = 0.5
DEFAULT_PROMPT_KEEP_RATE = 1.0

# The design a run's default-design rows (settings without `prune_sampling`) were drawn with, for runs made
# before the default changed, told apart by their recorded elapsed_s. Any other run (a new one) is taken to
# have used DEFAULT_DESIGN, the default of the code that renders it.
RUN_DESIGNS = {
    ("bench_reasoning", 2251.217349980001): "systematic",
    ("bench_reasoning_designs", 1502.333647173): "systematic",
    ("bench_e2e", 1431.5971197039999): "systematic",
    ("bench_gpu", 5.897185185000126): "systematic",
}
BENCH_TRAIN_SYSTEMATIC_RUN = 8.993417888000295  # bench_train.json has no elapsed_s: GRPO's median s of 2026-12-01

MARKER = re.compile(r"<!-- generated: (?P<spec>[^>]*?) -->(?P<body>.*?)<!-- end generated -->", re.DOTALL)

# ------------------------------------------------------------------------------------------------ small helpers


def load_results(directory: Path = RESULTS) -> dict[str, dict]:
    """Every ``*.json`` of ``directory``, by file stem."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(Path(directory).glob("*.json"))}


def num(x: float | None, spec: str = ".3f") -> str:
    """``x`` formatted, ``0`` for an exact (or float-noise) zero, ``-`` for None."""
    if x is None:
        return "-"
    return "0" if abs(x) < 1e-12 else format(x, spec)


def kilo(x: float) -> str:
    return f"{x / 1000:.0f}k"


def pm(mean: float, sd: float, spec: str = ".3f") -> str:
    return f"{mean:{spec}} ± {sd:{spec}}"


IN_TURNS = "in turns"  # harness.training.TIMING_IN_TURNS
ONE_AFTER_THE_OTHER = "one after the other"  # harness.training.TIMING_ONE_AFTER_THE_OTHER


def timing(data: dict) -> str:
    """How a record's runs were timed: its ``timing`` ("in turns": each method's steps in turn with the others',
    ``harness.interleave``), else one after the other (the records from before the turns)."""
    return data.get("timing", ONE_AFTER_THE_OTHER)


def taken(data: dict) -> str:
    """A time column's note of how its runs were timed, for a table's header: "(in turns)", "(one after the
    other)"."""
    return f"({timing(data)})"


def phases_timing(data: dict) -> str:
    """How the paired runs behind a learning summary's projection were timed (``projection_sources``), one after the
    other for the summaries made before the turns."""
    return (data.get("projection_sources") or {}).get("phases_timing") or ONE_AFTER_THE_OTHER


def phase_ratios_of(row: dict):
    """A row's time per step by phase over GRPO's, whichever way it was taken (bench_real.py: ``phase_ratios`` from
    runs in turns, ``phase_ratios_one_after_the_other`` from learning runs back to back; older paired records:
    ``phase_ratios``, their record's ``timing`` absent)."""
    return row.get("phase_ratios", row.get("phase_ratios_one_after_the_other"))


def phase_seconds_of(row: dict):
    return row.get("phase_seconds", row.get("phase_seconds_one_after_the_other"))


def span(values: list, spec: str = ".2f") -> str:
    """``a-b`` (min-max), or one value when all are equal at this precision (``spec`` "": already formatted)."""
    texts = [format(v, spec) if spec else v for v in values]
    number = lambda t: float(t.rstrip("%xk"))  # noqa: E731
    lo, hi = min(texts, key=number), max(texts, key=number)
    return lo if lo == hi else f"{lo}-{hi}"


OPS = {"inv": lambda x: 1.0 / x, "m1": lambda x: x - 1.0, "c1": lambda x: 1.0 - x, "min": lambda x: x / 60.0}


def fmt(value: float, spec: str) -> str:
    """A value by an inline FORMAT: a ``format()`` spec or ``k`` (thousands), after an optional prefix of OPS:
    ``inv`` (1 / x), ``m1`` (x - 1), ``c1`` (1 - x), ``min`` (seconds to minutes)."""
    op = next((o for o in OPS if spec.startswith(o)), None)
    x, spec = (OPS[op](value), spec[len(op) :]) if op else (value, spec)
    return kilo(x) if spec == "k" else format(x, spec)


def rows(name: str, data: dict) -> dict[str, dict]:
    """The rows of one results file by key: a method (bench_reasoning*, bench_gpu), ``loss/design`` and
    ``sft-<steps>`` (bench_variance), ``table/method`` (bench_e2e), ``world/keep`` (bench_balance), a variant
    (bench_train); ``-`` is the whole file."""
    out = {"-": data}
    if name.startswith(("bench_reasoning", "bench_real")) or name in ("bench_gpu", "bench_entropy_filter"):
        out.update({r["method"]: r for r in data["results"]})
    elif name == "bench_variance":
        out.update({f"{r['loss_type']}/{r['design']}": r for r in data["summary"]})
        out.update({f"sft-{c['steps']}": c for c in data["checkpoints"]})
    elif name == "bench_e2e":
        out.update({f"{t}/{r['method']}": r for t, table in data["tables"].items() for r in table})
    elif name == "bench_balance":
        out.update({f"{r['world']}/{r['keep_rate']}": r for r in data["results"]})
    elif name == "bench_train":
        out.update({r["variant"]: r for r in data["results"]})
    elif name == "bench_audit_alarm":
        out.update({f"{r['design']}@{r['keep_rate']}": r for r in data["rows"]})
    elif name.startswith("bench_audit"):
        out.update({f"{r['design']}@{r['keep_rate']}/{r['seed']}": r for r in data["rows"]})
    return out


def field(row, path: str):
    """``row``'s value at a dotted ``path`` (digits index lists); ``a/b``: the ratio of two such values."""
    if "/" in path:
        top, bottom = path.split("/")
        return field(row, top) / field(row, bottom)
    for part in path.split("."):
        row = row[int(part)] if part.isdigit() else row[part]
    return row


def value(results: dict, name: str, key: str, path: str, spec: str) -> str:
    """An inline value of ``name``.json: KEY a row (``rows``); ``K1:K2`` the ratio of the field in two rows;
    ``*`` its range (``span``) over every row of the file."""
    table = rows(name, results[name])
    if key == "*":
        return span([fmt(field(r, path), spec) for k, r in table.items() if k != "-"], "")
    if ":" in key:
        top, bottom = key.split(":")
        return fmt(field(table[top], path) / field(table[bottom], path), spec)
    return fmt(field(table[key], path), spec)


def run_design(name: str, data: dict) -> str:
    """The design the default-design rows of this run were drawn with (RUN_DESIGNS, else the default now)."""
    if name == "bench_train":
        grpo = next(r for r in data["results"] if r["variant"] == "grpo")
        return "systematic" if grpo["median_seconds"] == BENCH_TRAIN_SYSTEMATIC_RUN else DEFAULT_DESIGN
    return RUN_DESIGNS.get((name, data.get("elapsed_s")), DEFAULT_DESIGN)


def design_note(design: str) -> str:
    return f"`{design}`, the default" if design == DEFAULT_DESIGN else f"`{design}`, the default then"


def settings_text(settings: dict | None, design: str) -> str:
    """A method's DPPOConfig settings as code, with the design that drew its rows when the settings leave it
    to the default (and prune at all)."""
    if settings is None:
        return "TRL's `GRPOTrainer`"
    text = ", ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={v}" for k, v in settings.items())
    prunes = settings.get("completion_keep_rate", DEFAULT_KEEP_RATE) < 1.0
    return f"`{text}`" + (f" ({design_note(design)})" if prunes and "prune_sampling" not in settings else "")


# --------------------------------------------------------------------------------- bench_reasoning*.json tables


def target_text(r: dict) -> str:
    t = r["time_to_target_ratio"]
    return f"not reached ({r['reached_target']})" if t is None else f"{t:.2f} ({r['reached_target']})"


def reasoning_cells(r: dict, epochs: float) -> dict[str, str]:
    """Every column a bench_reasoning table can show, for one method's row (``r``: medians over seeds)."""
    grpo = r["settings"] is None
    total = f"{r['time_per_epoch_ratio']:.3f}" + (f" ({r['total_s']:.0f} s for {epochs:g} epochs)" if grpo else "")
    ideal = f"({r['ideal_training_ratio']:.3f}: its density)" if grpo else f"{r['ideal_training_ratio']:.3f}"
    return {
        "time": total,
        "train": f"{r['training_phase_ratio']:.3f}",
        "ideal": ideal,
        "x_ideal": "-" if grpo else f"{r['training_phase_ratio'] / r['ideal_training_ratio']:.2f}",
        "target": target_text(r),
        "kept": f"{r['kept_fraction']:.2f}",
        "tokens": kilo(r["trained_tokens"]),
        "zero_var": f"{r['zero_variance_share']:.2f}",
        "acc": pm(r["accuracy_mean"], r["accuracy_std"]),
        "greedy": pm(r["greedy_mean"], r["greedy_std"]),
        "gen_share": f"{r['phase_share']['generation']:.2f}",
    }


REASONING_HEADERS = {
    "time": "time / GRPO (same epochs)",
    "train": "training phase / GRPO",
    "ideal": "ideal",
    "x_ideal": "x ideal",
    "target": "to target / GRPO (seeds reaching)",
    "kept": "kept",
    "tokens": "trained tokens ({epochs:g} epochs)",
    "zero_var": "zero-var. groups",
    "acc": "held-out acc. (sampled)",
    "greedy": "greedy",
    "gen_share": "generation share",
}


def reasoning_table(data: dict, columns: list[str], design: str, settings_column: bool = True) -> str:
    """One row per method of a bench_reasoning run; ``columns`` from REASONING_HEADERS."""
    epochs = data["config"]["epochs"]
    header = ["method"] + (["settings"] if settings_column else []) + [
        REASONING_HEADERS[c].format(epochs=epochs) + (f" {taken(data)}" if c == "time" else "") for c in columns]
    body = []
    for r in data["results"]:
        cells = reasoning_cells(r, epochs)
        first = [r["method"]] + ([settings_text(r["settings"], design)] if settings_column else [])
        body.append(first + [cells[c] for c in columns])
    return md_table(header, body)


def reasoning_seconds_table(data: dict) -> str:
    """Seconds per run by phase (each the median over seeds), optimizer steps and the zero-variance share of the
    first and last quarter of the generation batches (min-max over seeds)."""
    labels = ("generation", "rewards + log-prob passes", "loss forward + backward", "other")
    header = ["method", *[f"{x} (s)" for x in labels], "whole run (s)", "optimizer steps",
              "zero-var. share, first quarter", "last quarter"]
    body = []
    for r in data["results"]:
        seeds = data["per_seed"][r["method"]]
        body.append(
            [r["method"], *[f"{r['phase_s'][p]:.1f}" for p in ("generation", "scoring", "loss", "other")],
             f"{r['total_s']:.1f}", span([s["optimizer_steps"] for s in seeds], ".0f"),
             span([s["zero_variance_first_last"][0] for s in seeds]),
             span([s["zero_variance_first_last"][1] for s in seeds])]
        )
    return md_table(header, body)


SHORT_REASONING = ["time", "train", "ideal", "kept", "tokens", "target", "acc", "greedy"]
FULL_REASONING = ["time", "train", "ideal", "x_ideal", "target", "kept", "tokens", "zero_var", "acc", "greedy",
                  "gen_share"]

# ------------------------------------------------------------------------------------ bench_variance.json tables

VARIANCE_LABELS = {
    "grpo": "grpo (the batch itself)",
    "packing": "packing (every row)",
    "systematic@0.5": "systematic@0.5 (0.1's default)",
    "topk@0.5": "topk@0.5 (biased)",
}


def variance_label(design: str, other_pool: bool = False) -> str:
    """A design's row label; ``other_pool``: measured in a later run on rebuilt pools (its ratios are to that run's
    GRPO), marked with a dagger."""
    if design == f"{DEFAULT_DESIGN}@{DEFAULT_KEEP_RATE}":
        return f"**{design} (the default)**"
    label = VARIANCE_LABELS.get(design, design + (" (adaptive)" if re.search(r"\+e\d", design) else ""))
    return label + " †" if other_pool else label


def other_pool_rows(data: dict) -> set:
    """``(loss_type, design)`` of the rows merged from a run on other pools (``bench_variance.py --merge-new-pools``
    tags their results with ``pool``)."""
    return {(r["loss_type"], r["design"]) for r in data["results"] if "pool" in r}


def bias_text(r: dict) -> str:
    """The bias, bold where it exceeds 3x what the seeds alone give an unbiased design."""
    text = num(r["bias"], ".4f")
    return f"**{text}**" if r["bias"] > 3 * r["bias_noise"] else text


def variance_table(data: dict, loss_type: str, full: bool = True) -> str:
    """bench_variance's summary (means over checkpoints) for one loss type; ``full`` adds the balance columns."""
    header = ["design", "kept rows", "compute / GRPO", "mse / GRPO", "bias", "noise", "**efficiency**", "/ oracle"]
    header += ["rows sd", "tokens rel. sd", "group imbal."] if full else []
    body, other = [], other_pool_rows(data)
    for r in (r for r in data["summary"] if r["loss_type"] == loss_type):
        default = r["design"] == f"{DEFAULT_DESIGN}@{DEFAULT_KEEP_RATE}"
        eff, oracle = f"{r['efficiency']:.2f}", f"{r['efficiency_to_oracle']:.2f}"
        row = [variance_label(r["design"], (loss_type, r["design"]) in other), f"{r['kept_fraction']:.3f}",
               f"{r['compute_ratio']:.3f}", f"{r['mse_ratio']:.3f}", bias_text(r), num(r["bias_noise"], ".4f"),
               f"**{eff}**" if default else eff, f"**{oracle}**" if default else oracle]
        if full:
            row += [num(r["kept_rows_sd"], ".2f"), num(r["kept_tokens_rel_sd"]), num(r["group_imbalance"])]
        body.append(row)
    return md_table(header, body)


def variance_checkpoints_table(data: dict) -> str:
    """bench_variance's checkpoints: each pool's zero-variance share, accuracy and completion lengths."""
    header = ["checkpoint", "rows", "zero-variance groups", "pool accuracy (sampled)", "completion tokens",
              "median", "parameters"]
    body = []
    for c in data["checkpoints"]:
        tokens = c["completion_tokens"]
        body.append([f"sft-{c['steps']}", str(c["rows"]), f"{c['zero_variance_share']:.0%}",
                     f"{c['pool_accuracy']:.2f}", f"{tokens['min']}-{tokens['max']}", f"{tokens['median']:.0f}",
                     f"{c['parameters']:,}"])
    return md_table(header, body)


# --------------------------------------------------------------------------------------- bench_e2e.json tables

E2E_LABELS = {
    "dppo": "dppo (keep 0.5, {design})",
    "dppo+prompt": "dppo + prompt pruning 0.5 ({design})",
    "topk": "topk (CPPO, biased)",
    "zero_variance": "zero_variance (DAPO filter, biased)",
}


def e2e_methods_table(data: dict) -> str:
    """bench_e2e's methods at the fixed step budget (medians over its seeds, accuracy mean +- sd)."""
    steps = data["config"]["steps"]
    table = data["tables"]["methods"]
    header = ["method", "s/step", f"total time / GRPO {taken(data)}", "training phase / GRPO",
              "time to GRPO's final reward / GRPO (seeds reaching)", "kept", f"reward at {steps} steps",
              f"held-out accuracy ({table[0]['seeds']} seeds)"]
    design = f"`{run_design('bench_e2e', data)}`"
    label = lambda method: E2E_LABELS.get(method, method).format(design=design)  # noqa: E731
    body = [[label(r["method"]), f"{r['step_s']:.3f}", f"{r['total_ratio']:.3f}", f"{r['training_phase_ratio']:.3f}",
             target_text(r), f"{r['kept_fraction']:.2f}", f"{r['final_reward']:.3f}",
             pm(r["accuracy_mean"], r["accuracy_std"])] for r in table]
    return md_table(header, body)


def sweep_label(method: str, default: float, extra: dict[float, str]) -> str:
    """``keep=0.5`` -> ``**0.5**`` (bold at DPPOConfig's default), ``grpo`` -> ``GRPO``."""
    if method == "grpo":
        return "GRPO"
    value = float(method.split("=")[1])
    text = f"{value:g}" + (".0" if value == int(value) else "") + (f" {extra[value]}" if value in extra else "")
    return f"**{text}**" if value == default else text


def e2e_sweep_table(data: dict, knob: str) -> str:
    """One sweep of bench_e2e (``completion_keep_rate`` or ``prompt_keep_rate``), seeds of config sweep_seeds."""
    steps = data["config"]["steps"]
    prompt = knob == "prompt_keep_rate"
    first = "`prompt_keep_rate` (with keep 0.5)" if prompt else "`completion_keep_rate`"
    header = [first, f"total time / GRPO {taken(data)}"] + ([] if prompt else ["training phase / GRPO"]) + [
        "time to target / GRPO", f"reward at {steps} steps", "held-out accuracy"]
    default = DEFAULT_PROMPT_KEEP_RATE if prompt else DEFAULT_KEEP_RATE
    extra = {1.0: "(off)"} if prompt else {1.0: "(packing only)"}
    body = []
    for r in data["tables"][knob]:
        row = [sweep_label(r["method"], default, extra), f"{r['total_ratio']:.3f}"]
        row += [] if prompt else [f"{r['training_phase_ratio']:.3f}"]
        body.append(row + [target_text(r), f"{r['final_reward']:.3f}", pm(r["accuracy_mean"], r["accuracy_std"])])
    return md_table(header, body)


def e2e_grpo_shares(data: dict) -> str:
    share = next(r for r in data["tables"]["methods"] if r["method"] == "grpo")["phase_share"]
    labels = {"generation": "generation", "scoring": "rewards + log-prob passes", "loss": "loss forward + backward",
              "other": "other"}
    return ", ".join(f"{labels[p]} {share[p]:.2f}" for p in labels)


# ------------------------------------------------------------------------ bench_balance, bench_gpu, bench_train


def balance_table(data: dict) -> str:
    """Kept tokens per rank, max / mean, before and after balance_ranks, per (ranks, keep rate)."""
    header = ["ranks", "keep", "before: median", "before: p95", "after: median", "after: p95",
              "batches within 10% after", "rows moved"]
    body = [[str(r["world"]), str(r["keep_rate"]), f"{r['imbalance_before_median']:.3f}",
             f"{r['imbalance_before_p95']:.3f}", f"{r['imbalance_after_median']:.3f}",
             f"{r['imbalance_after_p95']:.3f}", f"{r['within_10_percent_after']:.0%}",
             f"{r['rows_moved_fraction']:.1%}"] for r in data["results"]]
    return md_table(header, body)


def gpu_table(data: dict) -> str:
    c = data["config"]
    what = (f"`bash benchmarks/gpu.sh` ({c['model']} model, Qwen2 {c['hidden_size']}x{c['layers']}, completions "
            f"<= {c['max_completion_length']}, {c['steps']} steps, {data['device']})")
    by = {r["method"]: r for r in data["results"]}
    header = ["command", "GRPO s/step", "DPPO s/step", f"step ratio {taken(data)}", "training-phase ratio"]
    dppo = by["dppo"]
    return md_table(header, [[what, f"{by['grpo']['step_s']:.3f}", f"{dppo['step_s']:.3f}",
                              f"{dppo['step_ratio_to_grpo']:.3f}", f"{dppo['training_phase_ratio_to_grpo']:.3f}"]])


def train_table(data: dict) -> str:
    labels = {"dppo": "dppo (no packing)", "dppo+packing": "dppo + packing"}
    header = ["variant", "real tokens", "allocated tokens", "density", "median s", "ratio to GRPO", "ideal", "x ideal"]
    body = [[labels.get(r["variant"], r["variant"]), f"{r['real_tokens']:.0f}", f"{r['allocated_tokens']:.0f}",
             f"{r['token_density']:.3f}", f"{r['median_seconds']:.3f}", f"{r['time_ratio_to_grpo']:.3f}",
             f"{r['ideal_ratio']:.3f}", f"{r['time_ratio_to_grpo'] / r['ideal_ratio']:.2f}"]
            for r in data["results"]]
    return md_table(header, body)


def real_table(data: dict) -> str:
    """bench_real.json and bench_real_vllm.json: each method's ratios to GRPO (mean ± SE over seeds), final reward
    and held-out score."""
    labels = {"grpo": "GRPO (TRL)", "dppo": "DPPO (defaults: keep 0.5, stratified, packing)",
              "dppo+prompt": "DPPO + prompt pruning (prompt_keep_rate 0.5)", "packing": "packing alone (keep 1.0)"}
    header = ["method", f"time to GRPO's final reward {taken(data)}", "reached", "total time", "training phase",
              "ideal", "kept", "final reward", "minus GRPO's (paired)", "held-out score (start -> end)"]
    body = []
    for r in data["results"]:
        ratio = lambda key: pm(r[key + "_mean"], r[key + "_se"]) if r[key + "_mean"] is not None else "-"  # noqa: E731
        # A time to target exists only for the seeds that reached it: from one seed, a value without an SE.
        one_seed = r["reached_target"].split("/")[0] == "1" and r["reached_target"] != "1/1"
        to_target = f"{r['time_to_target_ratio_mean']:.3f} (one seed)" if one_seed else ratio("time_to_target_ratio")
        body.append([labels.get(r["method"], r["method"]), to_target, r["reached_target"],
                     ratio("total_ratio"), ratio("training_phase_ratio"), ratio("ideal_training_ratio"),
                     f"{r['kept_fraction']:.2f}", pm(r["final_reward_mean"], r["final_reward_se"]),
                     pm(r["final_reward_diff_mean"], r["final_reward_diff_se"]),
                     f"{r['heldout_start_mean']:.3f} -> "
                     f"{pm(r['heldout_final_mean'], r['heldout_final_se'])}"])
    return md_table(header, body)


REAL_LABELS = {"grpo": "GRPO (TRL)", "dppo": "DPPO (keep 0.5)",
               "dppo+prompt": "DPPO + prompt pruning, retired fill mode (0.5, ema score)",
               "dppo+calibrated": "DPPO + prompt pruning, retired fill mode (0.5, calibrated score)",
               "dppo+cut": "DPPO + the cut (2 of 4 prompts, probe of 2)",
               "dppo+cut-calibrated": "DPPO + the cut (2 of 4 prompts, calibrated history score)",
               "dppo+audit": "DPPO, every other batch audited"}


def _reached(r, key):
    """``mean ± SE (k/n)`` over the seeds that reached the target; one seed's value without an SE."""
    if r[key + "_mean"] is None:
        return f"- ({r[key + '_reached']})"
    mean, se, reached = r[key + "_mean"], r[key + "_se"], r[key + "_reached"]
    return f"{mean:.2f} ({reached})" if reached.startswith("1/") else f"{mean:.2f} ± {se:.2f} ({reached})"


# The learning summaries: TRL's default loss with each engine generating, then GSPO (transformers generating).
LEARNING_RUNS = (("bench_real_learning", "transformers"), ("bench_real_vllm_learning", "vLLM, colocated"),
                 ("bench_real_gspo_learning", "transformers, GSPO"))
DEFAULT_LOSS_RUNS = 2  # the first two: the README's headline


def learning_records(results: dict, runs=LEARNING_RUNS) -> list[tuple[str, dict]]:
    """(run, summary) of each learning summary of ``runs`` recorded (bench_real*_learning.json), in their order."""
    return [(run, results[name]) for name, run in runs if name in results]


TARGET_HEADER = ["steps to target: training reward", "steps: held-out score", "time to target: training reward",
                 "time: held-out score", "held-out minus GRPO's, 95% CI", "non-inferior (CI above -0.05)"]


def target_cells(r: dict) -> list[str]:
    """A summary row's 90%-of-rise figures (``harness.target_figures``), in ``TARGET_HEADER``'s order."""
    ci = r["heldout_final_diff_ci"]
    return [_reached(r, "steps_to_90_ratio"), _reached(r, "heldout_steps_to_90_ratio"), _reached(r, "time_to_90_ratio"),
            _reached(r, "heldout_time_to_90_ratio"),
            "-" if ci is None else f"{r['heldout_final_diff_mean']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]",
            "-" if ci is None else "yes" if r["heldout_non_inferior"] else "no"]


def timed_target_header(records: list[dict]) -> list[str]:
    """``TARGET_HEADER`` with its time columns labelled by how the records' runs were timed (one label where they
    agree, else each row's run says it)."""
    ways = {timing(data) for data in records}
    note = f" ({ways.pop()})" if len(ways) == 1 else ""
    return [h + note if h.startswith("time") else h for h in TARGET_HEADER]


def learning_table(results: dict) -> str:
    """bench_real*_learning.json, per engine and method: the steps and the time to 90% of GRPO's rise as ratios to
    GRPO's (mean ± SE over the seeds that reached it; the times labelled with how the runs were timed), and the
    final held-out score's paired difference with its 95% interval."""
    records = learning_records(results)
    body = [[engine, REAL_LABELS.get(r["method"], r["method"]), str(len(r["seeds"])), *target_cells(r)]
            for engine, data in records for r in data["results"] if r["method"] != "grpo"]
    return md_table(["run", "method", "seeds", *timed_target_header([data for _, data in records])], body)


def reasoning_targets_table(data: dict) -> str:
    """bench_reasoning*.json with the 90%-of-rise figures: per method, as ``learning_table``'s."""
    body = [[REAL_LABELS.get(r["method"], r["method"]), str(r["seeds"]), *target_cells(r)]
            for r in data["results"] if r["method"] != "grpo"]
    return md_table(["method", "seeds", *timed_target_header([data])], body)


# The paired per-phase records, each a loss (or GSPO) and an engine: bench-prefix's runs have prefix sharing on (the
# default since 2026-12-05); bench-real-phases' records taken one after the other predate it, those taken in turns
# (2026-12-07 on) have it.
PHASE_RECORDS = (
    ("bench_real_prefix", "`dapo` (TRL's default)", "transformers"),
    ("bench_real_prefix_vllm", "`dapo` (TRL's default)", "vLLM colocated"),
    ("bench_real_phases_dapo", "`dapo` (TRL's default)", "transformers"),
    ("bench_real_phases_grpo", "`grpo`", "transformers"),
    ("bench_real_phases_dr_grpo", "`dr_grpo`", "transformers"),
    ("bench_real_phases_gspo", 'GSPO (`importance_sampling_level="sequence"`)', "transformers"),
)


def phase_record_label(name: str, engine: str, data: dict) -> str:
    """A paired record's engine, whether prefix sharing was on, and how its runs were timed."""
    sharing = name.startswith("bench_real_prefix") or timing(data) == IN_TURNS
    return f"{engine}, {'prefix sharing on' if sharing else 'before prefix sharing'}, {timing(data)}"


def phases_table(results: dict) -> str:
    """The paired per-phase records (``PHASE_RECORDS``): per loss, engine and method, GRPO's seconds per step and
    each method's time per step by phase as a ratio to GRPO's (the median over seeds of the mean over the steps
    after the first, with its SE)."""
    header = ["loss", "record", "method", "GRPO's step", "step vs GRPO", "generation", "log-prob passes",
              "loss fwd + bwd", "rest", "all but generation"]
    body = []
    for name, loss, engine in PHASE_RECORDS:
        data = results.get(name)
        if data is None:
            continue
        grpo = rows(name, data)["grpo"]
        for r in data["results"]:
            if r["method"] in ("grpo", "dppo+audit", "dppo+repeated"):
                continue
            ratio = phase_ratios_of(r)
            cell = lambda name: "-" if ratio[name] is None else "{:.2f} ± {:.2f}".format(*ratio[name])  # noqa: E731
            body.append([loss, phase_record_label(name, engine, data), REAL_LABELS.get(r["method"], r["method"]),
                         f"{phase_seconds_of(grpo)['step']:.1f} s", cell("step"), cell("generation"), cell("logps"),
                         cell("loss"), cell("rest"), cell("training")])
    return md_table(header, body)


def projection_table(results: dict) -> str:
    """bench_real*_learning.json's ``projection``: the time to the training-reward target over GRPO's (± SE) and
    the speedup, by generation's share of GRPO's step (a row), engine and method (a column)."""
    columns = [(engine, m, {p["generation_share"]: p for p in data["projection"] if p["method"] == m})
               for engine, data in learning_records(results)
               for m in dict.fromkeys(p["method"] for p in data["projection"])]
    shares = sorted({s for *_, at in columns for s in at})
    phases = {engine: phases_timing(data) for engine, data in learning_records(results)}
    header = ["generation's share of GRPO's step",
              *(f"{REAL_LABELS.get(m, m)}, {engine} (time per step {phases[engine]})" for engine, m, _ in columns)]
    cell = lambda p: f"{p['time_ratio']:.2f} ± {p['time_ratio_se']:.2f} ({1 / p['time_ratio']:.2f}x)"  # noqa: E731
    body = [[f"{s:.0%}", *(cell(at[s]) for *_, at in columns)] for s in shares]
    return md_table(header, body)


CUT_METHODS = ("dppo+cut", "dppo+cut-calibrated")


def cut_table(results: dict) -> str:
    """bench_real*_learning.json, the cut (issue 42) per engine and predictor: learning per step (steps to 90% of
    GRPO's rise), the held-out score's paired difference, generation per step over GRPO's (median over seeds of the
    paired ratio), the accepted groups without signal, and the projected time to the training-reward target over
    GRPO's at a GPU-like generation share."""
    header = ["generating with", "method", "seeds", "steps to target: reward", "steps: held-out",
              "held-out minus GRPO's, 95% CI", "generation per step vs GRPO (interleaved calls)",
              "accepted groups without signal",
              "projected time to target at 70% generation"]
    body = []
    for engine, data in learning_records(results, LEARNING_RUNS[:DEFAULT_LOSS_RUNS]):
        by_method = {row["method"]: row for row in data["results"]}
        for method in CUT_METHODS:
            r = by_method.get(method)
            if r is None:
                continue
            ci = r["heldout_final_diff_ci"]
            at = next(p for p in data["projection"]
                      if p["method"] == method and abs(p["generation_share"] - 0.7) < 1e-9)
            generation = r.get("generation_ratio_projected") or phase_ratios_of(r)["generation"]
            body.append([engine, REAL_LABELS[method], str(len(r["seeds"])), _reached(r, "steps_to_90_ratio"),
                         _reached(r, "heldout_steps_to_90_ratio"),
                         "-" if ci is None else f"{r['heldout_final_diff_mean']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]",
                         f"{generation[0]:.2f} ± {generation[1]:.2f}", f"{r['zero_variance_share']:.0%}",
                         f"{at['time_ratio']:.2f} ± {at['time_ratio_se']:.2f} ({1 / at['time_ratio']:.2f}x)"])
    return md_table(header, body)


def probe_table(results: dict) -> str:
    """bench_real*_learning.json's ``probe_prediction`` of the cut with the probe: per engine and probe size ``k``,
    the share of flat probes, the share of those whose group is flat, and the share of spread groups a flat probe
    hides (Horvitz-Thompson over every candidate)."""
    header = ["generating with", "probe of k", "groups", "probes whose rewards agree",
              "of those, groups without signal", "groups with signal behind a flat probe"]
    body = [[engine, str(p["k"]), str(p["groups"]), f"{p['probe_flat_share']:.0%}",
             f"{p['group_flat_given_probe_flat']:.0%}", f"{p['spread_hidden_by_flat_probe']:.0%}"]
            for engine, data in learning_records(results, LEARNING_RUNS[:DEFAULT_LOSS_RUNS])
            for p in (data.get("probe_prediction") or {}).get("dppo+cut") or []]
    return md_table(header, body)


def prompt_pruning_table(data: dict) -> str:
    """bench_real*_learning.json: what each method's generated batches held once prompt pruning acts (after GRPO's
    first epoch; mean ± SE over seeds) and its learning per step on the held-out score."""
    header = ["method", "seeds", "groups without signal", "raw reward of the generated prompts", "completions kept",
              "steps to target: held-out", "held-out at the end"]
    def cell(r, key, spec=".2f"):
        return "-" if r.get(key + "_mean") is None else pm(r[key + "_mean"], r[key + "_se"], spec)

    body = [[REAL_LABELS.get(r["method"], r["method"]), str(len(r["seeds"])),
             cell(r, "later_zero_variance_share"), cell(r, "later_generated_reward"), f"{r['kept_fraction']:.0%}",
             _reached(r, "heldout_steps_to_90_ratio"), cell(r, "heldout_final", ".3f")] for r in data["results"]]
    return md_table(header, body)


def revisits_table(data: dict) -> str:
    """bench_real*_learning.json's ``revisits``: per method with per-group records, by the look of a prompt's last
    group, the revisits and the share of them whose new group had signal."""
    methods = [m for m, table in data.get("revisits", {}).items() if any(v["revisits"] for v in table.values())]
    header = ["the prompt's last group"] + [REAL_LABELS.get(m, m) for m in methods]
    states = list(next(iter(data["revisits"].values()))) if methods else []
    body = [[state] + [f"{t['spread_next']:.0%} of {t['revisits']}" if t["revisits"] else "-"
                       for t in (data["revisits"][m][state] for m in methods)] for state in states]
    return md_table(header, body)


ALL_RESULTS = "*"  # a TABLES entry whose function reads every results file
def speedup_text(projected: dict) -> str:
    """A projected speedup and the time ratio it inverts, with its SE: ``1.32x (time 0.76 ± 0.04)``."""
    ratio, se = projected["time_ratio"], projected["time_ratio_se"]
    return f"{1 / ratio:.2f}x (time {pm(ratio, se, '.2f')})"


def headline_table(results: dict) -> str:
    """README's headline: DPPO at its defaults against GRPOTrainer, the speedup in two factors on the real model,
    per engine (bench_real*_learning.json): learning per step (steps to 90% of GRPO's rise), the final held-out
    score's paired difference, and the product with the training time per step (paired runs) at a GPU-like
    generation share. The other methods' rows are on their pages (benchmarks.md, prompt_pruning.md)."""
    records = learning_records(results, LEARNING_RUNS[:DEFAULT_LOSS_RUNS])
    share = records[0][1]["projection_sources"]["typical_gpu_generation_share"]  # one constant of bench_real.py
    header = ["generating with", "method", "seeds", "steps to target: reward", "steps: held-out",
              "held-out minus GRPO's, 95% CI", f"projected speedup at {share:.0%} generation",
              "its time per step, timed"]
    body = []
    for engine, data in records:
        at = {p["method"]: p for p in data["projection"] if abs(p["generation_share"] - share) < 1e-9}
        phases = phases_timing(data)
        for r in data["results"]:
            if r["method"] != "dppo":
                continue
            ci = r["heldout_final_diff_ci"]
            speed = at.get(r["method"])
            body.append([engine, REAL_LABELS.get(r["method"], r["method"]), str(len(r["seeds"])),
                         _reached(r, "steps_to_90_ratio"), _reached(r, "heldout_steps_to_90_ratio"),
                         "-" if ci is None else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]",
                         "-" if speed is None else speedup_text(speed), phases])
    return md_table(header, body)


def prefix_table(data: dict) -> str:
    """bench_prefix.json: one group's kept completions with the prompt once (shared) over the prompt in every row
    (repeated), per prompt length, completion length and kept completions."""
    header = ["prompt tokens", "completion tokens", "kept of the group", "token positions", "forward + backward time",
              "peak memory", "max log-prob difference", "shared by default"]
    body = [[str(r["prompt_length"]), str(r["completion_length"]), str(r["kept"]), f"{r['positions_ratio']:.2f}",
             f"**{r['time_ratio']:.2f}**" if r["time_ratio"] > 1.0 else f"{r['time_ratio']:.2f}",
             f"{r['memory_ratio']:.2f}", f"{r['max_logp_difference']:.0e}",
             "-" if r["kept"] == 1 else "yes" if r["shared_by_default"] else "no"] for r in data["results"]]
    return md_table(header, body)


PREFIX_ENGINES = {"bench_real_prefix": "transformers", "bench_real_prefix_vllm": "vLLM (colocated)"}


def real_prefix_table(results: dict) -> str:
    """bench_real_prefix*.json (paired 8-step runs): per engine, the share of token positions prefix sharing removed,
    DPPO's phases with sharing over DPPO's without (median over seeds of each seed's ratio ± SE over its steps) and
    each one's step over GRPO's."""
    header = ["generation", "timed", "seeds", "token positions removed", "old/ref log-prob passes",
              "loss forward + backward", "training phase", "whole step", "step / GRPO's: shared", "repeated"]
    body = []
    for name, engine in PREFIX_ENGINES.items():
        if name not in results:
            continue
        data = results[name]
        sharing, by = data["prefix_sharing"], {r["method"]: r for r in data["results"]}
        ratios = sharing["ratios"]
        body.append([engine, timing(data), str(len(sharing["seeds"])), f"{sharing['prefix_tokens_saved']:.2f}",
                     *(pm(*ratios[p]) if ratios[p] else "-" for p in ("logps", "loss", "training", "step")),
                     pm(*phase_ratios_of(by["dppo"])["step"]), pm(*phase_ratios_of(by["dppo+repeated"])["step"])])
    return md_table(header, body)


def entropy_filter_table(data: dict) -> str:
    """bench_entropy_filter.json (the methods step by step in turn in one process): per method, whether TRL's entropy
    filter is on, its training phase (all but generation) over GRPO's, paired step by step (mean ± SE over the paired
    steps) and per seed (mean ± SE over seeds of each seed's ratio of means), its whole step over GRPO's, and the
    no-gradient forward of the rows it did not keep: seconds a step (its share of the method's training phase) and
    over GRPO's training phase, step by step."""
    quantile = data["config"]["quantile"]
    header = ["method", "entropy filter", "seeds", "paired steps", "training phase, s/step",
              "training / GRPO's: per step", "per seed", "whole step / GRPO's",
              "unkept rows' forward, s/step (share)", "unkept rows' forward / GRPO's training", "kept"]
    body = []
    for r in data["results"]:
        settings = r["settings"]
        label = ("GRPO (TRL's `GRPOTrainer`)" if settings is None
                 else f"DPPO (keep {settings.get('completion_keep_rate', DEFAULT_KEEP_RATE):g})")
        forwards = settings is not None and r["filter"]
        unkept = f"{r['unkept_s']:.2f} ({r['unkept_share']:.0%})" if forwards else "-"
        body.append([label, f"on (`top_entropy_quantile={quantile:g}`)" if r["filter"] else "off",
                     str(len(r["seeds"])), str(r["paired_steps"]), f"{r['training_s']:.2f}",
                     pm(r["training_ratio_mean"], r["training_ratio_se"]),
                     pm(r["training_ratio_seed_mean"], r["training_ratio_seed_se"]),
                     pm(r["step_ratio_mean"], r["step_ratio_se"]), unkept,
                     pm(r["unkept_ratio_mean"], r["unkept_ratio_se"]) if forwards else "-",
                     f"{r['kept_fraction']:.2f}"])
    return md_table(header, body)


def demo_table(data: dict) -> str:
    """demo.json (``make demo``'s record, ``benchmarks/side_by_side.py``): its printed table as markdown."""
    header = ["method", "time (its own steps, in turns)", "time / GRPO's", "reward: start -> end",
              "held-out: start -> end", "kept"]
    body = [[r["method"], f"{r['wall']:.0f} s", f"{r['time_ratio']:.2f}",
             f"{r['reward_start']:.2f} -> {r['reward_end']:.2f}", f"{r['heldout_start']:.2f} -> {r['heldout_end']:.2f}",
             f"{r['kept']:.2f}"] for r in data["rows"]]
    return md_table(header, body)


def audit_table(data: dict) -> str:
    """bench_audit*.json: each run's audit readings (design, keep rate, seed)."""
    def cell(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    header = ["design", "keep rate", "kept", "seed", "audits (counted)", "median cosine", "mean measured rel. error",
              "mean model-based error", "median measured / model", "mean projection", "final bias t",
              "bias alarm at", "audit s / step s"]
    body = [[f"`{r['design']}`", str(r["keep_rate"]), cell(r["kept_fraction"], ".2f"), str(r["seed"]),
             f"{r['audits']} ({r['counted']})", cell(r["median_cosine"]),
             cell(r["mean_rel_error"]), cell(r["mean_model_error"]), cell(r["median_noise_to_signal"], ".2f"),
             cell(r["mean_projection"]), cell(r["final_bias_t"], ".2f"), cell(r["alarm_at"], "d"),
             f"{cell(r['audit_s'], '.1f')} / {cell(r['step_s'], '.1f')}"]
            for r in data["rows"]]
    return md_table(header, body)


def audit_alarm_table(data: dict) -> str:
    """bench_audit_alarm.json: how often the bias alarm fires per design on simulated seeded runs."""
    looks = max(r["looks"] for r in data["rows"])

    def rate(r, n):
        return f"{r[f'alarm_within_{n}']:.1%}" if r["looks"] >= n else "-"

    header = ["design", "unbiased", "seeded runs", "alarm within 24 counted audits", f"within {looks}",
              "median audit of the alarm"]
    body = [[f"`{r['design']}`", "yes" if r["unbiased"] else "no", str(r["seeds"]), rate(r, 24), rate(r, looks),
             "-" if r["median_alarm_at"] is None else f"{r['median_alarm_at']:g}"]
            for r in data["rows"]]
    return md_table(header, body)


# ------------------------------------------------------------------------------------------ the registry


def reuse_table(data: dict) -> str:
    """bench_reuse: each row's learning per generation against GRPO (``mu = 1``), its training phase per generation
    (timed in turns) and the projected time at each generation share; ``-`` where a figure is not recorded yet."""
    shares = sorted({p["generation_share"] for p in data["projection"]})
    projected = {(p["name"], p["generation_share"]): p for p in data["projection"]}
    out = []

    def ratio(r, key):
        mean = r[f"{key}_mean"]
        return "-" if mean is None else f"{pm(mean, r[f'{key}_se'], '.2f')} ({r[f'{key}_reached']})"

    for r in data["results"]:
        ci = r["heldout_final_diff_ci"]
        training = r["training_ratio_per_generation"]
        out.append([
            f"`{r['method']}`", str(r["num_iterations"]), f"{r['learning_rate']:g}", str(len(r["seeds"])),
            ratio(r, "heldout_generations_to_90_ratio"), ratio(r, "generations_to_90_ratio"),
            "-" if ci is None else f"{r['heldout_final_diff_mean']:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]",
            "-" if training is None else pm(*training, ".2f"),
            *[pm(projected[r["name"], s]["time_ratio"], projected[r["name"], s]["time_ratio_se"], ".2f")
              if (r["name"], s) in projected else "-" for s in shares],
        ])
    header = ["method", "`num_iterations`", "learning rate", "seeds", "held-out: generations to 90%",
              "training reward: generations to 90%", "held-out final - GRPO's [95% CI]",
              f"training per generation ({len(data['timing_seeds'])} seed(s) in turns)",
              *[f"time at s = {s:g}" for s in shares]]
    return md_table(header, out)


def _reasoning(name, columns, settings=True):
    return name, lambda d: reasoning_table(d, columns, run_design(name, d), settings)


TABLES = {  # block name -> (results file, function of its JSON; ALL_RESULTS: of every results file)
    "headline": (ALL_RESULTS, headline_table),
    "demo": ("demo", demo_table),
    "bench_reasoning": _reasoning("bench_reasoning", FULL_REASONING),
    "bench_reasoning_seconds": ("bench_reasoning", reasoning_seconds_table),
    "bench_reasoning_designs": _reasoning("bench_reasoning_designs", SHORT_REASONING),
    "bench_reasoning_adaptive": _reasoning("bench_reasoning_adaptive", SHORT_REASONING),
    "bench_variance_checkpoints": ("bench_variance", variance_checkpoints_table),
    "bench_variance_dapo": ("bench_variance", lambda d: variance_table(d, "dapo")),
    "bench_variance_grpo": ("bench_variance", lambda d: variance_table(d, "grpo", full=False)),
    "bench_e2e_methods": ("bench_e2e", e2e_methods_table),
    "bench_e2e_completion_keep_rate": ("bench_e2e", lambda d: e2e_sweep_table(d, "completion_keep_rate")),
    "bench_e2e_prompt_keep_rate": ("bench_e2e", lambda d: e2e_sweep_table(d, "prompt_keep_rate")),
    "bench_balance": ("bench_balance", balance_table),
    "bench_gpu": ("bench_gpu", gpu_table),
    "bench_train": ("bench_train", train_table),
    "bench_real": ("bench_real", real_table),
    "bench_real_vllm": ("bench_real_vllm", real_table),
    "bench_real_learning": (ALL_RESULTS, learning_table),
    "bench_reasoning_targets": ("bench_reasoning_targets", reasoning_targets_table),
    "bench_real_projection": (ALL_RESULTS, projection_table),
    "bench_real_prompt_pruning": ("bench_real_learning", prompt_pruning_table),
    "bench_real_cut": (ALL_RESULTS, cut_table),
    "bench_real_probe": (ALL_RESULTS, probe_table),
    "bench_real_revisits": ("bench_real_learning", revisits_table),
    "bench_real_phases": (ALL_RESULTS, phases_table),
    "bench_prefix": ("bench_prefix", prefix_table),
    "bench_real_prefix": (ALL_RESULTS, real_prefix_table),
    "bench_entropy_filter": ("bench_entropy_filter", entropy_filter_table),
    "bench_audit": ("bench_audit", audit_table),
    "bench_audit_countdown": ("bench_audit_countdown", audit_table),
    "bench_audit_alarm": ("bench_audit_alarm", audit_alarm_table),
    "bench_reuse": ("bench_reuse", reuse_table),
}


def efficiency(results: dict, key: str) -> float:
    return rows("bench_variance", results["bench_variance"])[key]["efficiency"]


MATCHED = ("@0.5", "+g-0.5@0.5", "+tokens@0.4", "+tokens+g-0.5@0.4")  # the designs bench_variance runs in pairs


def stratified_gains(results: dict) -> list[float]:
    """Efficiency of `stratified` over `systematic`, minus 1, in every matched pair and loss type."""
    return [efficiency(results, f"{loss}/stratified{m}") / efficiency(results, f"{loss}/systematic{m}") - 1
            for loss in ("dapo", "grpo") for m in MATCHED]


def bias_verdict(results: dict, key: str) -> str:
    """A design's bias against the noise level of its seeds, and which of the two it is."""
    r = rows("bench_variance", results["bench_variance"])[key]
    verdict = "a real bias" if r["bias"] > 3 * r["bias_noise"] else "at the noise level"
    return f"{r['bias']:.2f} of the batch gradient's norm against noise {r['bias_noise']:.2f}: {verdict}"


def rerun_seconds(results: dict) -> tuple[float, float]:
    """The same `stratified` runs (same seeds, same masks) timed in two bench-reasoning runs: 2-epoch seconds."""
    return (rows("bench_reasoning_adaptive", results["bench_reasoning_adaptive"])["dppo"]["total_s"],
            rows("bench_reasoning_designs", results["bench_reasoning_designs"])["stratified"]["total_s"])


def rerun_noise(results: dict) -> str:
    """How much less time the faster of the two timings of the same runs took."""
    a, b = rerun_seconds(results)
    return f"{1 - min(a, b) / max(a, b):.0%}"


def rerun_gap(results: dict) -> str:
    a, b = rerun_seconds(results)
    return f"{a:.0f} s against {b:.0f} s per 2-epoch run ({rerun_noise(results)} less)"


def audit_alarm_worst(results: dict, looks: str) -> str:
    """The largest false-alarm rate of the unbiased designs within ``looks`` counted audits (bench_audit_alarm)."""
    rows = [r for r in results["bench_audit_alarm"]["rows"] if r["unbiased"] and r["looks"] >= int(looks)]
    return f"{max(r[f'alarm_within_{looks}'] for r in rows):.1%}"


def _design(name):
    return lambda R: f"`{run_design(name, R[name])}`"


def learning_seeds(results: dict, method: str, name: str = "bench_real_learning") -> str:
    """How many seeds a learning summary (``name``, bench_real_learning.json by default) holds for ``method``."""
    return str(len(rows(name, results[name])[method]["seeds"]))


def revisit_share(results: dict, method: str, state: str) -> str:
    """The share of ``method``'s revisits whose new group had signal, after a last group in state number
    ``state`` (harness.targets.REVISIT_STATES: 0 failed, 1 spread, 2 solved)."""
    table = results["bench_real_learning"]["revisits"][method]
    return f"{list(table.values())[int(state)]['spread_next']:.0%}"


def prefix_cells(results: dict) -> list[dict]:
    """bench_prefix.json's cells with more than one kept completion (where there is something to share)."""
    return [r for r in results["bench_prefix"]["results"] if r["kept"] > 1]


def prefix_rule_agreement(results: dict) -> str:
    """In how many of bench_prefix's cells the default (``sharing_pays``) shares exactly where sharing was faster."""
    cells = prefix_cells(results)
    agree = sum(r["shared_by_default"] == (r["time_ratio"] < 1.0) for r in cells)
    return f"{agree} of {len(cells)}"


def prefix_rule_misses(results: dict) -> str:
    """The cells where the default's decision and the measured sign differ: prompt/completion/kept and time ratio."""
    misses = [r for r in prefix_cells(results) if r["shared_by_default"] != (r["time_ratio"] < 1.0)]
    return "; ".join(f"{r['prompt_length']}/{r['completion_length']}/{r['kept']}: {r['time_ratio']:.2f}"
                     f" ({'shared' if r['shared_by_default'] else 'apart'} by default)" for r in misses) or "none"


def audit_verdict(results: dict) -> str:
    """The audit's step ratio against the paired runs' (bench_real_phases_dapo's ``audit_check``): whether it lies
    within the check's tolerance, and the difference in standard errors of the paired ratio where it has one."""
    check = results["bench_real_phases_dapo"]["audit_check"]
    text = f"{'within' if check['within_tolerance'] else 'outside'} the {check['tolerance']:.0%} the check asks for"
    se = check.get("paired_step_time_ratio_se")
    if se:
        difference = check["audit_step_time_ratio"] - check["paired_step_time_ratio"]
        text += (f"; the difference, {difference:+.3f}, is {abs(difference) / se:.1f} standard errors of the paired "
                 "ratio")
    return text


def reuse_verdict(results: dict) -> str:
    """bench_reuse's verdict at its generation share: the fastest DPPO row whose held-out score is non-inferior,
    its projected time against GRPO at ``num_iterations`` 1 and against GRPO's fastest row, the issue's targets,
    and whether reuse is what won."""
    data = results["bench_reuse"]
    verdict = data["verdict"]
    if verdict is None:
        return "no verdict yet (a row without a held-out target reached or without a timed training ratio)"
    rows = {r["name"]: r for r in data["results"]}
    best, grpo_best = rows[verdict["dppo_best"]], rows[verdict["grpo_best"]]
    reuse = "reuse" if best["num_iterations"] > 1 else "no reuse"
    return (f"at {verdict['generation_share']:.0%} generation the fastest DPPO row with a non-inferior held-out "
            f"score is DPPO at `num_iterations` {best['num_iterations']}: "
            f"{pm(verdict['dppo_best_time_ratio'], verdict['dppo_best_time_ratio_se'], '.2f')} of GRPO's time at "
            f"`num_iterations` 1 (the target: {verdict['target_vs_grpo']:.2f} or less), "
            f"{verdict['dppo_best_over_grpo_best']:.2f} of GRPO's fastest row, GRPO at `num_iterations` "
            f"{grpo_best['num_iterations']} (the target: {verdict['target_vs_grpo_best']:.2f} or less); the targets "
            f"are {'met' if verdict['met'] else 'not met'}, and the fastest DPPO row is the one with {reuse}")


SPANS = {  # inline values that are not one field: name [arguments] -> function of every results file
    "audit_verdict": audit_verdict,
    "reuse_verdict": reuse_verdict,
    "e2e_grpo_shares": lambda R: e2e_grpo_shares(R["bench_e2e"]),
    "grpo_gamma_gain": lambda R: format(
        efficiency(R, f"grpo/{DEFAULT_DESIGN}+g-0.5@0.5") / efficiency(R, f"grpo/{DEFAULT_DESIGN}@0.5") - 1, "+.0%"),
    "stratified_wins": lambda R: f"{sum(g > 0 for g in stratified_gains(R))} of {len(stratified_gains(R))}",
    "stratified_gains": lambda R: f"{min(stratified_gains(R)):+.1%} to {max(stratified_gains(R)):+.1%}",
    "bias_verdict": bias_verdict,
    "rerun_gap": rerun_gap,
    "rerun_noise": rerun_noise,
    "default_design": lambda R: f"`{DEFAULT_DESIGN}`",
    "bench_audit_alarm_worst": audit_alarm_worst,
    "learning_seeds": learning_seeds,
    "revisit_share": revisit_share,
    "prefix_rule_agreement": prefix_rule_agreement,
    "prefix_rule_misses": prefix_rule_misses,
    **{f"design:{n}": _design(n) for n in ("bench_reasoning", "bench_reasoning_designs", "bench_reasoning_adaptive",
                                           "bench_e2e", "bench_train", "bench_gpu")},
}


def render_spec(spec: str, results: dict) -> str:
    """The text a marker's spec stands for: a table (between blank lines), a SPANS value, or
    ``FILE KEY FIELD FORMAT`` (``value``)."""
    words = spec.split()
    try:
        if len(words) == 1 and words[0] in TABLES:
            name, function = TABLES[words[0]]
            data = results if name == ALL_RESULTS else results[name]
            return "\n\n" + function(data) + "\n\n"  # blank lines: the table is its own block
        if words and words[0] in SPANS:
            return SPANS[words[0]](results, *words[1:])
        if len(words) == 4:
            return value(results, *words)
    except (KeyError, IndexError, TypeError) as err:
        raise ValueError(f"generated part {spec!r}: nothing at {err} in benchmarks/results/") from None
    raise ValueError(f"unknown generated part {spec!r}: a table {sorted(TABLES)}, a span {sorted(SPANS)}, "
                     "or FILE KEY FIELD FORMAT")


def render(text: str, results: dict) -> str:
    """``text`` with every generated part replaced by what the JSON gives; the rest unchanged."""
    return MARKER.sub(
        lambda m: f"<!-- generated: {m['spec']} -->{render_spec(m['spec'], results)}<!-- end generated -->", text
    )


def stale(paths: list[Path], results: dict) -> dict[Path, str]:
    """Docs whose generated parts differ from the JSON: path -> a unified diff."""
    out = {}
    for path in paths:
        text = path.read_text()
        new = render(text, results)
        if new != text:
            diff = difflib.unified_diff(text.splitlines(), new.splitlines(), str(path), "from the JSON", lineterm="")
            out[path] = "\n".join(diff)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when a doc differs from the JSON")
    mode.add_argument("--write", action="store_true", help="rewrite the generated parts of the docs")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("docs", nargs="*", type=Path, default=[ROOT / d for d in DOCS + MORE_DOCS])
    args = parser.parse_args(argv)
    results = load_results(args.results)
    differ = stale(args.docs, results)
    for path, diff in differ.items():
        if args.write:
            path.write_text(render(path.read_text(), results))
            print(f"rewrote {path}")
        else:
            print(diff)
    if args.check and differ:
        print(f"\n{len(differ)} doc(s) differ from benchmarks/results/*.json: run `make docs`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
