"""The online gradient audit on the real model: SmolLM2-135M-Instruct (`dppo-trl-smollm2`) with LoRA on reasoning-gym's
chain_sum (bench_real.py's setup: 4 prompts x 8 completions a step, dapo, beta 0, learning rate 2e-4, TRL's LoRA
dropout 0.05), DPPO with unbiased designs and with CPPO's biased topk at keep 0.3, every generation batch audited
(``audit_every=1``), training as usual in between.

Per design and seed it reports the audit's readings: the median cosine of DPPO's and GRPO's gradients of the same
batch, the mean measured relative error against the mean model-based ``dppo/pruning_error`` (and their median
ratio, ``dppo/audit_noise_to_signal``), the bias statistic (``dppo/audit_bias_t`` after the last audit, and the
counted audit at which the bias alarm first fired), and what the audit cost: the seconds of one audit over those
of one training step without it (generation included).

    make bench-audit                                        # the real model, then countdown
    python benchmarks/bench_audit.py --steps 4 --seeds 0 --runs stratified@0.3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import (  # noqa: E402
    config_default,
    countdown_setup,
    group_advantages,
    md_table,
    read_json,
    reasoning_gym_setup,
    result_path,
    write_json,
)

LORA_DROPOUT = 0.05  # TRL's ModelConfig default, the smollm2-chain-sum-lora recipe's


def audit_run(design: str, keep_rate: float, seed: int, setup: dict) -> dict:
    """Train DPPO with ``design`` at ``keep_rate``, every batch audited; return each audit's readings and each
    step's timing (``audit_s`` of the step's wall time went to the audit)."""
    from transformers import TrainerCallback

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.core.audit import compare_gradients, make_sketch

    class Recorded(DPPOTrainer):
        def _record_audit(self, dppo, grpo, seconds, batch):
            records = self.audit_ledger.records
            counted = len(records["projection"])
            super()._record_audit(dppo, grpo, seconds, batch)
            model_error = None if batch.prune_summary is None else batch.prune_summary[1]
            compared = compare_gradients(dppo, grpo) or {}  # {}: GRPO's gradient is 0
            self._bench_audit(batch, seconds, compared, model_error, len(records["projection"]) > counted)

        def _audit_generation_batch(self, batch, dppo_microbatches):
            no_signal = self.audit_ledger.records["no_signal"]
            super()._audit_generation_batch(batch, dppo_microbatches)
            if self.audit_ledger.records["no_signal"] > no_signal:  # every score 0: counted, not compared
                self._bench_audit(batch, batch.audit.seconds, {}, None, False)

        def _bench_audit(self, batch, seconds, compared, model_error, counted):
            records = self.audit_ledger.records
            self.__dict__.setdefault("audits", []).append({
                "step": self.state.global_step, "kind": batch.audit.kind, "seconds": seconds,
                "cosine": compared.get("cosine"), "rel_error": compared.get("rel_error"),
                "projection": compared.get("projection"), "model_error": model_error,
                "ratio": compared["rel_error"] / model_error if compared and model_error else None,
                "counted": counted, "bias_t": records["bias_t"][-1] if counted and records["bias_t"] else None,
                "alarm": records["alarm_at"] is not None,
            })
            self.__dict__["audit_s_this_step"] = self.__dict__.get("audit_s_this_step", 0.0) + seconds

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            draw = self.keep_decision.draw

            def recorded(output, batch, scores):
                draw(output, batch, scores)
                self.__dict__.setdefault("kept_fractions", []).append(float(batch.keep.float().mean()))

            self.keep_decision.draw = recorded

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.trainer, self.steps, self.last = None, [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            audit = self.trainer.__dict__.pop("audit_s_this_step", 0.0)
            self.steps.append({"step": state.global_step, "wall_s": time.perf_counter() - self.last, "audit_s": audit})
            a = (self.trainer.__dict__.get("audits") or [{}])[-1]
            print(f"[{design}@{keep_rate}/{seed}] step {state.global_step}: {self.steps[-1]['wall_s']:.1f} s "
                  f"(audit {audit:.1f} s) cosine {a.get('cosine')} projection {a.get('projection')} "
                  f"bias t {a.get('bias_t')} alarm {a.get('alarm')}", flush=True)

    args = DPPOConfig(output_dir=tempfile.mkdtemp(prefix="dppo-audit-"), report_to=[], save_strategy="no",
                      gradient_checkpointing=False, disable_tqdm=True, logging_steps=10**6, seed=seed,
                      max_steps=setup["steps"], completion_keep_rate=keep_rate, prune_sampling=design, audit_every=1,
                      **setup["trainer_args"])
    times = StepTimes()
    trainer = Recorded(setup["model_dir"], setup["reward_funcs"], args=args, train_dataset=setup["train_dataset"],
                       callbacks=[times], **setup.get("trainer_kwargs", {}))
    times.trainer = trainer
    torch.manual_seed(seed)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    records = trainer.audit_ledger.records
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    sketch = trainer._audit_sketch or make_sketch(sum(p.numel() for p in params), args.audit_sketch_dim,
                                                  args.audit_exact_params, args.seed)
    return {
        "design": design,
        "keep_rate": keep_rate,
        "seed": seed,
        "kept_fraction": statistics.mean(trainer.kept_fractions),
        "steps": trainer.state.global_step,
        "wall_s": wall,
        "audit_s": sum(a["seconds"] for a in trainer.__dict__.get("audits", [])),
        "sketch": {"dim": sketch.dim, "exact": sketch.exact},
        "audited_batches": records["audits"],
        "no_signal": records["no_signal"],
        "alarm_at": records["alarm_at"],
        "audits": trainer.__dict__.get("audits", []),
        "step_times": times.steps,
    }


def summary(run: dict) -> dict:
    audits = run["audits"]
    cosines = [a["cosine"] for a in audits if a["cosine"] is not None]
    ratios = [a["ratio"] for a in audits if a["ratio"] is not None]
    # Measured and model-based errors over the same batches (those with both; topk has no model-based error).
    paired = [a for a in audits if a["rel_error"] is not None and a["model_error"] is not None]
    errors = [a["rel_error"] for a in (paired or audits) if a["rel_error"] is not None]
    model = [a["model_error"] for a in paired]
    counted = [a for a in audits if a["counted"]]
    ts = [a["bias_t"] for a in counted if a["bias_t"] is not None]
    plain = [s["wall_s"] - s["audit_s"] for s in run["step_times"]]  # each step's time without its audit
    audit_seconds = [a["seconds"] for a in audits if a["kind"] != "no signal"]  # no gradient pass without signal
    exact = [a["rel_error"] for a in audits if a["kind"] == "exact" and a["rel_error"] is not None]
    return {
        "design": run["design"],
        "keep_rate": run["keep_rate"],
        "seed": run["seed"],
        "kept_fraction": run["kept_fraction"],
        "audits": len(audits),
        "no_signal": run["no_signal"],
        "counted": len(counted),
        "exact_batches": len(exact),
        "max_exact_rel_error": max(exact, default=None),  # every row that counts kept: float rounding only
        "median_cosine": statistics.median(cosines) if cosines else None,
        "mean_rel_error": statistics.mean(errors) if errors else None,
        "mean_model_error": statistics.mean(model) if model else None,
        "median_noise_to_signal": statistics.median(ratios) if ratios else None,
        "mean_projection": statistics.mean(a["projection"] for a in counted) if counted else None,
        "final_bias_t": ts[-1] if ts else None,
        "max_abs_bias_t": max((abs(t) for t in ts), default=None),
        "alarm_at": run["alarm_at"],
        "audit_s": statistics.mean(audit_seconds) if audit_seconds else None,
        "step_s": statistics.mean(plain) if plain else None,
        "audit_per_step": statistics.mean(audit_seconds) / statistics.mean(plain) if audit_seconds and plain else None,
        "audit_share": run["audit_s"] / (run["wall_s"] - run["audit_s"]),
        "sketch_dim": run["sketch"]["dim"],
        "exact": run["sketch"]["exact"],
    }


# ------------------------------------------------------------------ the bias alarm's false-alarm rate, simulated


def simulated_batch(generator: torch.Generator, geometry: tuple, groups: int = 4, group_size: int = 8, dim: int = 48):
    """One generation batch of ``groups x group_size`` rows as the audit sees it, in exact linear form: TRL's
    group-normalized advantages ``A`` (exactly 0 on zero-spread groups) of binary or partial-credit (thirds)
    rewards, token lengths, and per-row score-function vectors ``h_n`` (``sqrt(L_n)`` times a shared, a per-group
    and an own direction, the own one with log-normal norm, plus a direction shared by the rewarded rows: the
    ``geometry``), so that GRPO's gradient is ``sum A_n h_n`` and DPPO's ``sum w_n A_n h_n``."""
    shared_scale, group_scale, spread, reward_scale = geometry
    f64 = dict(generator=generator, dtype=torch.float64)
    rate = torch.rand(groups, 1, **f64)
    if float(torch.rand((), **f64)) < 0.5:
        rewards = (torch.rand(groups, group_size, **f64) < rate).double()
    else:
        rewards = torch.floor(torch.rand(groups, group_size, **f64) * 4) / 3 * (torch.rand(groups, 1, **f64) < 0.8)
    advantages = group_advantages(rewards, group_size)
    n = groups * group_size
    lengths = torch.randint(4, 40, (n,), generator=generator).double()
    group_of = torch.arange(n) // group_size
    shared, per_group = torch.randn(dim, **f64), torch.randn(groups, dim, **f64)
    own = torch.randn(n, dim, **f64) * torch.exp(spread * torch.randn(n, 1, **f64))
    h = shared_scale * shared + group_scale * per_group[group_of] + own
    h = h + reward_scale * rewards.flatten()[:, None] * shared
    return advantages, lengths, group_of, rewards.flatten(), h * lengths.sqrt()[:, None]


def simulated_projections(design: str, keep_rate: float, audits: int, seed: int) -> list[float]:
    """The projections ``r`` that ``audits`` counted audits of one seeded run feed to the bias statistic: the
    package's own design (``get_design``, default ``keep_floor``) on simulated batches of one random geometry
    (``simulated_batch``), with the trainer's rules (a batch without signal, or with every row that counts kept
    at weight 1, is not counted)."""
    from dppo_trl.core.estimator import horvitz_thompson_weights
    from dppo_trl.core.pruning import PruneProblem, get_design

    keep_floor = config_default("keep_floor")
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand(4, generator=generator, dtype=torch.float64)
    geometry = (2 * float(u[0]), 2 * float(u[1]), float(u[2]), 3 * float(u[3]))
    out = []
    while len(out) < audits:
        advantages, lengths, groups, rewards, h = simulated_batch(generator, geometry)
        counts = advantages != 0
        if not bool(counts.any()):
            continue
        problem = PruneProblem(advantages=advantages, costs=lengths, groups=groups, rewards=rewards,
                               keep_rate=keep_rate, keep_floor=keep_floor)
        keep, pi = get_design(design)(problem, generator)
        weights = keep.double() if pi is None else horvitz_thompson_weights(pi, keep)
        if bool((weights[counts] == 1).all()):
            continue
        grpo, dppo = advantages @ h, (weights * advantages) @ h
        out.append(float((dppo - grpo) @ grpo) / float(grpo @ grpo))
    return out


def first_alarm(projections: list[float]) -> int | None:
    """The counted audit at which the bias alarm first fires (checked at every audit, as the trainer does)."""
    from dppo_trl.core.audit import bias_alarm

    return next((n for n in range(1, len(projections) + 1) if bias_alarm(projections[:n])), None)


def alarm_simulation(seeds: int, looks: int, designs: list[str], keep_rate: float) -> dict:
    """Per design: in how many of ``seeds`` seeded runs the alarm fires within 24 and within ``looks`` counted
    audits, and at which audit it first fires (median, for the biased designs)."""
    from dppo_trl.core.audit import BIAS_ALARM_MIN_AUDITS, BIAS_ALARM_T
    from dppo_trl.core.pruning import unbiased_designs

    results = []
    for design in designs:
        start = time.perf_counter()
        alarms = [first_alarm(simulated_projections(design, keep_rate, looks, seed)) for seed in range(seeds)]
        fired = [a for a in alarms if a is not None]
        results.append({"design": design, "unbiased": design in unbiased_designs(), "keep_rate": keep_rate,
                        "seeds": seeds, "looks": looks, "alarm_within_24": sum(a <= 24 for a in fired) / seeds,
                        f"alarm_within_{looks}": len(fired) / seeds,
                        "median_alarm_at": statistics.median(fired) if fired else None,
                        "seconds": time.perf_counter() - start})
        print(results[-1], flush=True)
    return {"threshold": BIAS_ALARM_T, "min_audits": BIAS_ALARM_MIN_AUDITS, "rows": results}


def real_setup(a) -> dict:
    """bench_real.py's SmolLM2 + LoRA setup on chain_sum, with the recipe's LoRA dropout (TRL's default, 0.05)."""
    return reasoning_gym_setup(
        task="chain_sum", answer_format="last_number", task_seed=0, train_prompts=32, heldout=1, eval_every=10**6,
        steps=a.steps, prompts_per_step=a.prompts_per_step, max_completion_length=a.max_completion_length,
        learning_rate=2e-4, vllm=False, lora_dropout=LORA_DROPOUT, generations=a.generations,
    )


def countdown_audit_setup(a) -> dict:
    """bench_reasoning.py's countdown setup (its warm-started 0.3M-parameter Qwen2, TRL's defaults with GA 2 <
    steps_per_generation 4), trained for ``a.steps`` optimizer steps."""
    setup = countdown_setup(
        train_prompts=256, heldout=1, eval_samples=1, eval_every=10**6, epochs=None, batch_size=32,
        gradient_accumulation_steps=2, steps_per_generation=4, learning_rate=1e-4, sft_steps=300, hidden_size=128,
        layers=2, model_cache="outputs/bench-reasoning",
    )
    return dict(setup, steps=a.steps)


def fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    header = ["design", "keep rate", "kept", "seed", "audits (counted)", "median cosine", "mean rel. error",
              "mean model error", "median measured/model", "mean projection", "final bias t", "alarm at",
              "audit s / step s"]
    return md_table(header, [
        [r["design"], str(r["keep_rate"]), f"{r['kept_fraction']:.3f}", str(r["seed"]),
         f"{r['audits']} ({r['counted']})", fmt(r["median_cosine"]), fmt(r["mean_rel_error"]),
         fmt(r["mean_model_error"]), fmt(r["median_noise_to_signal"], ".2f"), fmt(r["mean_projection"]),
         fmt(r["final_bias_t"], ".2f"), "-" if r["alarm_at"] is None else str(r["alarm_at"]),
         f"{fmt(r['audit_s'], '.1f')} / {fmt(r['step_s'], '.1f')}"]
        for r in rows
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["stratified@0.3", "topk@0.3"],
                        help="DESIGN@KEEP_RATE of each run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts per optimizer step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (the real model's task)")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--task", default="chain_sum", choices=["chain_sum", "countdown", "alarm"],
                        help="chain_sum: bench_real's real model; countdown: bench_reasoning's warm-started tiny "
                        "Qwen2; alarm: the bias alarm's false-alarm rate and topk's detection on simulated batches")
    parser.add_argument("--sim-seeds", type=int, default=500, help="--task alarm: seeded runs per design")
    parser.add_argument("--sim-looks", type=int, default=100, help="--task alarm: counted audits per run")
    parser.add_argument("--json", default=result_path("bench_audit"))
    parser.add_argument("--from-json", nargs="+", default=None,
                        help="train nothing: summarize the runs of saved JSONs (several: runs made side by side, "
                        "merged)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (1 on a CPU shared with other jobs)")
    a = parser.parse_args(argv)
    torch.set_num_threads(a.threads)

    def save(runs, elapsed, config):
        rows = [summary(run) for run in runs]
        write_json(a.json, {"config": config, "elapsed_s": elapsed, "rows": rows, "runs": runs})
        return rows

    if a.task == "alarm" and a.from_json:  # simulations made side by side (e.g. a slow design with fewer seeds)
        saved = [read_json(path) for path in a.from_json]
        result = dict(saved[0], rows=[row for one in saved for row in one["rows"]],
                      commands=[one["config"] for one in saved], elapsed_s=max(one["elapsed_s"] for one in saved))
        result.pop("config")
        write_json(a.json, result)
        print(f"wrote {a.json}")
        return result["rows"]
    if a.task == "alarm":
        specs = [(spec.split("@")[0], float(spec.split("@")[1])) for spec in a.runs]
        start = time.perf_counter()
        result = {"config": vars(a), **alarm_simulation(a.sim_seeds, a.sim_looks, [d for d, _ in specs], specs[0][1])}
        result["elapsed_s"] = time.perf_counter() - start
        write_json(a.json, result)
        print(f"wrote {a.json}")
        return result["rows"]
    if a.from_json:
        saved = [read_json(path) for path in a.from_json]
        runs = [run for one in saved for run in one["runs"]]
        elapsed = max(one["elapsed_s"] for one in saved)  # side by side: the longest
        config = dict(saved[0]["config"], runs=[f"{run['design']}@{run['keep_rate']}" for run in runs])
    else:
        setup = real_setup(a) if a.task == "chain_sum" else countdown_audit_setup(a)
        start = time.perf_counter()
        specs = [(spec.split("@")[0], float(spec.split("@")[1])) for spec in a.runs]
        runs, config = [], vars(a)
        for seed in a.seeds:
            for design, keep in specs:
                runs.append(audit_run(design, keep, seed, setup))
                save(runs, time.perf_counter() - start, config)  # a record after every run
        elapsed = time.perf_counter() - start
    rows = save(runs, elapsed, config)
    print(table(rows))
    print(f"wrote {a.json}")
    return rows


if __name__ == "__main__":
    main()
