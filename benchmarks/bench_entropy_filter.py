"""The entropy filter under completion pruning, what exactness costs: with TRL's filter on
(``top_entropy_quantile < 1``) and completion pruning on, DPPO forwards the rows of each TRL micro-batch it did not
keep once more, without gradient (``_unkept_entropies``), so that the filter's quantile is GRPO's exactly. This
measures the training phase per step (everything but generation: rewards, log-prob passes, loss forward and
backward, optimizer; ``harness.targets.step_phases``) of GRPO with the filter, DPPO with the filter and DPPO
without it, on bench_real's setup (SmolLM2-135M-Instruct + LoRA, reasoning-gym chain_sum, 4 prompts x 8
completions, ``max_completion_length=16``, ``dapo``, ``beta=0``).

The methods train in one process, step by step in turn: each in its own thread, one optimizer step at a time in a
fixed rotation (the held-out hook of ``harness.training.clock``, whose time is off the clock, hands the turn on),
each thread's random state its own (saved when it hands on, restored when its turn comes back), so that every
method draws what it would alone and GRPO's step k runs beside the others' step k under the same load. Figures
per method: its training phase over GRPO's in the same rotation, step by step after each run's first step (the
mean of the per-step ratios ± its SE over every paired step; and each seed's ratio of means, ± SE over seeds); the
seconds of the no-gradient forward of the unkept rows (timed around ``DPPOTrainer._unkept_entropies``), also over
GRPO's training phase step by step. ``--resume`` with seeds already recorded only summarizes them again.

    make bench-entropy-filter          # 3 seeds x 6 steps, one torch thread, 23 minutes here
    python benchmarks/bench_entropy_filter.py --seeds 3 --resume    # a seed more, into the same records
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import (  # noqa: E402
    LORA,
    mean_se,
    median_phase_ratios,
    phase_ratios,
    pm,
    read_json,
    reasoning_gym_setup,
    result_path,
    run_one,
    text_table,
    write_json,
)
from harness.targets import step_phases  # noqa: E402

# name -> (DPPOConfig settings, None for TRL's GRPOTrainer; whether the entropy filter is on)
METHODS = {
    "grpo": (None, True),
    "dppo+filter": (dict(completion_keep_rate=0.5), True),  # the exact way: the unkept rows forwarded
    "dppo": (dict(completion_keep_rate=0.5), False),  # for reference: no filter, no extra forward
}
COLUMNS = [
    ("method", -12, "method:"),
    ("steps", 6, "paired_steps:d"),
    ("train s", 8, "training_s:.2f"),
    ("train/GRPO (steps)", 20, lambda r: pm(r["training_ratio_mean"], r["training_ratio_se"])),
    ("train/GRPO (seeds)", 20, lambda r: pm(r["training_ratio_seed_mean"], r["training_ratio_seed_se"])),
    ("step/GRPO", 16, lambda r: pm(r["step_ratio_mean"], r["step_ratio_se"])),
    ("unkept fwd s", 13, "unkept_s:.2f"),
    ("unkept/GRPO train", 18, lambda r: pm(r["unkept_ratio_mean"], r["unkept_ratio_se"])),
    ("kept", 6, "kept_fraction:.2f"),
]


class Turns:
    """One optimizer step at a time over the methods' threads, in a fixed rotation; a finished thread leaves the
    rotation. Each thread's random states (torch, Python, NumPy) are its own: saved when it hands the turn on,
    restored when the turn comes back (seeded with ``seed`` at its first turn)."""

    def __init__(self, count: int, seed: int):
        self.gates = [threading.Semaphore(0) for _ in range(count)]
        self.done = [False] * count
        self.states = [None] * count
        self.seed = seed

    def wait(self, i: int) -> None:
        import numpy as np

        self.gates[i].acquire()
        if self.states[i] is None:
            torch.manual_seed(self.seed), random.seed(self.seed), np.random.seed(self.seed)
        else:
            torch.set_rng_state(self.states[i][0]), random.setstate(self.states[i][1])
            np.random.set_state(self.states[i][2])

    def hand_on(self, i: int) -> None:
        import numpy as np

        self.states[i] = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        count = len(self.gates)
        following = [(i + k) % count for k in range(1, count + 1)]
        nxt = next((j for j in following if not self.done[j]), None)
        if nxt is not None:
            self.gates[nxt].release()

    def step(self, i: int) -> float:
        """The held-out hook of each step (off the clock): the turn to the next thread, then back."""
        self.hand_on(i)
        self.wait(i)
        return 0.0

    def finish(self, i: int) -> None:
        self.done[i] = True
        self.hand_on(i)


UNKEPT_SECONDS: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))  # thread -> step -> seconds


def time_unkept_forward() -> None:
    """Clock ``DPPOTrainer._unkept_entropies`` (inside the loss phase) per thread and optimizer step: every call
    (without the filter it returns at once, a few microseconds a step)."""
    from dppo_trl import DPPOTrainer

    original = DPPOTrainer._unkept_entropies
    if getattr(original, "bench_timed", False):
        return

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:  # during optimizer step k, global_step is k - 1
            UNKEPT_SECONDS[threading.current_thread().name][self.state.global_step + 1] += time.perf_counter() - start

    timed.bench_timed = True
    DPPOTrainer._unkept_entropies = timed


def run_seed(methods: dict, seed: int, setup: dict, quantile: float) -> list[dict]:
    """Every method of ``methods`` for ``setup["steps"]`` steps of seed ``seed``, step by step in turn (the
    rotation starts at a different method each seed); their records (``run_one``'s, the held-out hook's dummy
    evaluations and the per-group records left out, the unkept forward's seconds per step added)."""
    names = list(methods)
    names = names[seed % len(names):] + names[: seed % len(names)]
    turns, runs, errors = Turns(len(names), seed), {}, []

    def work(i: int, name: str) -> None:
        settings, filtered = methods[name]
        mine = {**setup, "evaluate": lambda model, tokenizer=None: turns.step(i),
                "trainer_args": {**setup["trainer_args"], "top_entropy_quantile": quantile if filtered else 1.0}}
        turns.wait(i)  # the trainer is built in turn too
        try:
            runs[name] = run_one(name, settings, seed, mine)
        except BaseException as error:  # noqa: BLE001  (re-raised below, after the others finished)
            errors.append(error)
        finally:
            turns.finish(i)

    threads = [threading.Thread(target=work, args=(i, name), name=f"{name}@{seed}") for i, name in enumerate(names)]
    for thread in threads:
        thread.start()
    turns.gates[0].release()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    out = []
    for name in methods:
        run = runs[name]
        unkept = UNKEPT_SECONDS.pop(f"{name}@{seed}", {})
        for step in run["steps"]:
            step["unkept"] = unkept.get(step["step"], 0.0)
        run["generations"] = [{k: v for k, v in g.items() if k != "groups"} for g in run["generations"]]
        run["filter"] = methods[name][1]
        out.append({k: v for k, v in run.items() if k not in ("evals", "budget")})
    return out


def training_seconds(step: dict) -> float:
    """A step's training phase: all but generation."""
    phases = step_phases(step)
    return phases["logps"] + phases["loss"] + phases["rest"]


def step_seconds(step: dict) -> float:
    return sum(step_phases(step).values())


def paired(run: dict, base: dict, measure, skip: int) -> list[float]:
    """``measure`` of ``run`` over ``base``'s, step by step (the same rotation), after the first ``skip`` steps."""
    return [measure(a) / measure(b) for a, b in zip(run["steps"][skip:], base["steps"][skip:])]


def seed_ratio(run: dict, base: dict, skip: int) -> float:
    """A seed's ratio of mean training seconds per step, after the first ``skip`` steps."""
    return (statistics.mean(map(training_seconds, run["steps"][skip:]))
            / statistics.mean(map(training_seconds, base["steps"][skip:])))


def figures(runs: list[dict], methods, skip: int = 1, base_method: str = "grpo", reference: str = "dppo") -> list[dict]:
    """One row per method of ``methods`` over the seeds where it and ``base_method`` ran: its training phase and
    whole step against GRPO's, paired step by step (``_mean``, ``_se`` over every paired step) and per seed (each
    seed's ratio of mean seconds; ``_seed_mean``, ``_seed_se`` over seeds), the seconds per step of its training
    phase and of its unkept rows' forward, that forward over GRPO's training phase step by step (``unkept_ratio``),
    the kept fraction, the share of groups whose rewards were all equal, the harness's unpaired ``phase_ratios``
    (median over seeds); and, for a filtered DPPO, its training phase over ``reference``'s (DPPO without the
    filter) per seed: the two DPPO runs keep other rows after the first step (their models differ), so a step of
    one is no pair for the other's (a step that kept nothing trains in a fraction of a second), but GRPO's, which
    trains every row, is."""
    by = {(r["method"], r["seed"]): r for r in runs}
    rows = []
    for method in methods:
        seeds = sorted(s for m, s in by if m == method and (base_method, s) in by)
        if not seeds:
            continue
        mine = [by[method, s] for s in seeds]
        steps = [step for run in mine for step in run["steps"][skip:]]
        train = [p for s in seeds for p in paired(by[method, s], by[base_method, s], training_seconds, skip)]
        whole = [p for s in seeds for p in paired(by[method, s], by[base_method, s], step_seconds, skip)]
        per_seed = [seed_ratio(by[method, s], by[base_method, s], skip) for s in seeds]
        unkept = [a["unkept"] / training_seconds(b) for s in seeds
                  for a, b in zip(by[method, s]["steps"][skip:], by[base_method, s]["steps"][skip:])]
        row = {"method": method, "settings": mine[0]["settings"], "filter": mine[0]["filter"], "seeds": seeds,
               "paired_steps": len(train), "training_s": statistics.mean(map(training_seconds, steps)),
               "step_s": statistics.mean(map(step_seconds, steps)),
               "unkept_s": statistics.mean(s["unkept"] for s in steps),
               "kept_fraction": sum(g["kept_completions"] for r in mine for g in r["generations"])
               / sum(g["completions"] for r in mine for g in r["generations"]),
               "zero_variance_share": statistics.mean(g["zero_variance_groups"] for r in mine
                                                      for g in r["generations"]),
               "training_ratio_per_seed": per_seed}
        row["unkept_share"] = row["unkept_s"] / row["training_s"]
        row["training_ratio_mean"], row["training_ratio_se"] = mean_se(train)
        row["training_ratio_seed_mean"], row["training_ratio_seed_se"] = mean_se(per_seed)
        row["step_ratio_mean"], row["step_ratio_se"] = mean_se(whole)
        row["unkept_ratio_mean"], row["unkept_ratio_se"] = mean_se(unkept)
        row["phase_ratios"] = median_phase_ratios([phase_ratios(by[method, s], by[base_method, s], skip)
                                                   for s in seeds])
        if row["filter"] and row["settings"] is not None and all((reference, s) in by for s in seeds):
            exact = [seed_ratio(by[method, s], by[reference, s], skip) for s in seeds]
            row["training_ratio_to_unfiltered_per_seed"] = exact
            row["training_ratio_to_unfiltered_mean"], row["training_ratio_to_unfiltered_se"] = mean_se(exact)
        rows.append(row)
    return rows


def machine(threads: int) -> dict:
    """What ran it: the CPU, its cores, the memory, torch's threads."""
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 if hasattr(os, "sysconf") else None
    return {"cpu": model, "cores": os.cpu_count(), "memory_gib": round(memory, 1) if memory else None,
            "torch_threads": threads, "torch": torch.__version__, "platform": platform.platform()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of every method (the first unpaired)")
    parser.add_argument("--quantile", type=float, default=0.2, help="top_entropy_quantile where the filter is on")
    parser.add_argument("--keep-rate", type=float, default=0.5, help="DPPO's completion_keep_rate")
    parser.add_argument("--task", default="chain_sum", help="a reasoning-gym task")
    parser.add_argument("--train-prompts", type=int, default=32)
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts per optimizer step (x 8 completions)")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=2e-4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--json", default=result_path("bench_entropy_filter"))
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in this --json (same settings) and run only the seeds it lacks")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    methods = {name: (None if s is None else {**s, "completion_keep_rate": args.keep_rate}, f)
               for name, (s, f) in METHODS.items()}
    setup = reasoning_gym_setup(
        task=args.task, answer_format="last_number", task_seed=0, train_prompts=args.train_prompts, heldout=1,
        eval_every=1, steps=args.steps, prompts_per_step=args.prompts_per_step,
        max_completion_length=args.max_completion_length, learning_rate=args.learning_rate, vllm=False,
    )
    config = {k: v for k, v in vars(args).items() if k not in ("json", "resume", "seeds")}
    saved = read_json(args.json) if args.resume and Path(args.json).exists() else None
    if saved is not None and (saved["config"] != config or saved["trainer_args"] != setup["trainer_args"]):
        parser.error(f"--resume: {args.json} was run with other settings")
    runs = saved["runs"] if saved else []
    elapsed, ran = saved["elapsed_s"] if saved else 0.0, False
    time_unkept_forward()
    for seed in args.seeds:
        if any(r["seed"] == seed for r in runs):
            continue
        runs += run_seed(methods, seed, setup, args.quantile)
        ran = True
        print(f"[{time.perf_counter() - started:6.0f} s] seed {seed}: "
              + ", ".join(f"{r['method']} {statistics.mean(map(training_seconds, r['steps'][1:])):.2f} s"
                          for r in runs if r["seed"] == seed) + " of training per step", flush=True)
    rows = figures(runs, methods)
    print(f"\nThe entropy filter (top_entropy_quantile={args.quantile}) under completion pruning, SmolLM2-135M-Instruct"
          f" + LoRA, {args.task}, seeds {sorted({r['seed'] for r in runs})} x {args.steps} steps, ratios to GRPO's "
          "(mean ± SE over paired steps after each run's first; per seed):")
    print(text_table(rows, COLUMNS))
    exact = next((r for r in rows if "training_ratio_to_unfiltered_mean" in r), None)
    if exact is not None:
        print(f"{exact['method']} over DPPO without the filter, training phase (per seed): "
              f"{pm(exact['training_ratio_to_unfiltered_mean'], exact['training_ratio_to_unfiltered_se'])}; the unkept "
              f"rows' forward {exact['unkept_s']:.2f} s a step, {exact['unkept_share']:.0%} of its training phase, "
              f"{pm(exact['unkept_ratio_mean'], exact['unkept_ratio_se'])} of GRPO's")
    out = write_json(args.json, {
        "date": datetime.date.today().isoformat(),
        "machine": machine(args.threads),
        "config": config,
        "seeds": sorted({r["seed"] for r in runs}),
        "methods": {name: {"settings": s, "filter": f} for name, (s, f) in methods.items()},
        "trainer_args": setup["trainer_args"],
        "lora": LORA,
        "elapsed_s": elapsed + (time.perf_counter() - started if ran else 0.0),  # only what ran seeds counts
        "results": rows,
        "runs": runs,
    })
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
