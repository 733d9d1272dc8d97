"""The online gradient audit on the real model: SmolLM2-135M-Instruct (`dppo-trl-smollm2`) with LoRA on reasoning-gym's
chain_sum (bench_real.py's setup: 4 prompts x 8 completions a step, dapo, beta 0, learning rate 2e-4), DPPO with an
unbiased design (stratified, the default) at keep 0.5 (the default) and 0.25, and with CPPO's biased topk at 0.25,
every generation batch audited (``audit_every=1``), training as usual in between. (On this task about half the
rows have A = 0, so at keep 0.5 both designs keep nearly every row that counts; 0.25 makes them prune.)

Per design and seed it reports the audit's readings: the median cosine of DPPO's and GRPO's gradients of the same
batch, the mean measured relative error against the mean model-based ``dppo/pruning_error`` (and their median
ratio, ``dppo/audit_noise_to_signal``), the final bias z (Bonferroni-corrected over the directions), and what the
audit cost (its seconds over the rest of the step's).

    make bench-audit                                        # the real model (33 min here), then countdown (7 min)
    python benchmarks/bench_audit.py --steps 4 --seeds 0 --runs stratified@0.25
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_reasoning  # noqa: E402
import bench_real  # noqa: E402


def audit_run(design: str, keep_rate: float, seed: int, setup: dict) -> dict:
    """Train DPPO with ``design`` at ``keep_rate``, every batch audited; return each audit's readings and timing."""
    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.audit import compare_gradients

    class Recorded(DPPOTrainer):
        def _record_audit(self, dppo, grpo, seconds):
            before = {k: len(v) for k, v in self._audit_records().items()}
            super()._record_audit(dppo, grpo, seconds)
            records = self._audit_records()
            new = {k: records[k][before[k]] if len(records[k]) > before[k] else None for k in records}
            model_error = None if self._prune_summary is None else self._prune_summary[1]
            compared = compare_gradients(dppo, grpo)  # None: GRPO's gradient is 0 (every group's rewards equal)
            self.__dict__.setdefault("audits", []).append({**new, "model_error": model_error, "seconds": seconds,
                                                           "rel_error": compared and compared["rel_error"]})

        def _draw_keep_mask(self, output, scores):
            keep, weights, pi = super()._draw_keep_mask(output, scores)
            self.__dict__.setdefault("kept_fractions", []).append(float(keep.float().mean()))
            return keep, weights, pi

    args = DPPOConfig(output_dir=tempfile.mkdtemp(prefix="dppo-audit-"), report_to=[], save_strategy="no",
                      gradient_checkpointing=False, disable_tqdm=True, logging_steps=10**6, seed=seed,
                      max_steps=setup["steps"], completion_keep_rate=keep_rate, prune_sampling=design, audit_every=1,
                      **setup["trainer_args"])  # fmt: skip
    trainer = Recorded(setup["model_dir"], setup["reward_funcs"], args=args, train_dataset=setup["train_dataset"],
                       **setup["trainer_kwargs"])  # fmt: skip
    torch.manual_seed(seed)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    audits = trainer.audits
    audit_seconds = sum(a["seconds"] for a in audits)
    return {
        "design": design,
        "keep_rate": keep_rate,
        "seed": seed,
        "kept_fraction": statistics.mean(trainer.kept_fractions),
        "steps": trainer.state.global_step,
        "wall_s": wall,
        "audit_s": audit_seconds,
        "sketch": {"dim": trainer._audit_sketch.dim, "exact": trainer._audit_sketch.exact},
        "audits": audits,
        "final_bias_z": audits[-1]["bias_z"] if audits else None,
    }


def summary(run: dict) -> dict:
    audits = run["audits"]
    cosines = [a["cosine"] for a in audits if a["cosine"] is not None]
    ratios = [a["ratio"] for a in audits if a["ratio"] is not None]
    # Measured and model-based errors over the same batches (those with both; topk has no model-based error).
    paired = [a for a in audits if a["rel_error"] is not None and a["model_error"] is not None]
    errors = [a["rel_error"] for a in (paired or audits) if a["rel_error"] is not None]
    model = [a["model_error"] for a in paired]
    return {
        "design": run["design"],
        "keep_rate": run["keep_rate"],
        "seed": run["seed"],
        "kept_fraction": run["kept_fraction"],
        "audits": len(audits),
        "median_cosine": statistics.median(cosines) if cosines else None,
        "mean_rel_error": statistics.mean(errors) if errors else None,
        "mean_model_error": statistics.mean(model) if model else None,
        "median_noise_to_signal": statistics.median(ratios) if ratios else None,
        "final_bias_z": run["final_bias_z"],
        "max_bias_z": max((a["bias_z"] for a in audits if a["bias_z"] is not None), default=None),
        "audit_share": run["audit_s"] / (run["wall_s"] - run["audit_s"]),
        "sketch_dim": run["sketch"]["dim"],
        "exact": run["sketch"]["exact"],
    }


def real_setup(a) -> dict:
    """bench_real.py's SmolLM2 + LoRA setup on chain_sum."""
    return bench_real.prepare_setup(argparse.Namespace(
        task="chain_sum", answer_format="last_number", task_seed=0, train_prompts=32, heldout=1, eval_every=10**6,
        steps=a.steps, prompts_per_step=a.prompts_per_step, max_completion_length=a.max_completion_length,
        learning_rate=2e-4, vllm=False))  # fmt: skip


def countdown_setup(a) -> dict:
    """bench_reasoning.py's countdown setup (its warm-started 0.3M-parameter Qwen2, TRL's defaults with GA 2 <
    steps_per_generation 4), trained for ``a.steps`` optimizer steps."""
    setup = bench_reasoning.prepare_setup(argparse.Namespace(
        train_prompts=256, heldout=1, eval_samples=1, eval_every=10**6, epochs=None, batch_size=32,
        gradient_accumulation_steps=2, steps_per_generation=4, learning_rate=1e-4, sft_steps=300, hidden_size=128,
        layers=2, model_cache="outputs/bench-reasoning"))  # fmt: skip
    return dict(setup, steps=a.steps, trainer_kwargs={})


def fmt(x, spec=".3f"):
    return "n/a" if x is None else format(x, spec)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=["stratified@0.5", "stratified@0.25", "topk@0.25"],
                        help="DESIGN@KEEP_RATE of each run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts per optimizer step (x 8 completions)")
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--task", default="chain_sum", choices=["chain_sum", "countdown"],
                        help="chain_sum: bench_real's real model; countdown: bench_reasoning's warm-started tiny Qwen2")
    parser.add_argument("--json", default="benchmarks/results/bench_audit.json")
    parser.add_argument("--from-json", default=None, help="train nothing: summarize the runs of a saved JSON")
    a = parser.parse_args(argv)
    torch.set_num_threads(2)
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        runs, elapsed, config = saved["runs"], saved["elapsed_s"], saved["config"]
    else:
        setup = real_setup(a) if a.task == "chain_sum" else countdown_setup(a)
        start = time.perf_counter()
        specs = [(spec.split("@")[0], float(spec.split("@")[1])) for spec in a.runs]
        runs = [audit_run(design, keep, seed, setup) for seed in a.seeds for design, keep in specs]
        elapsed, config = time.perf_counter() - start, vars(a)
    rows = [summary(run) for run in runs]
    print("| design | keep rate | kept | seed | audits | median cosine | mean rel. error | mean model error "
          "| median measured/model | final bias z | max bias z | audit time / rest |")
    print("|---" * 12 + "|")
    for r in rows:
        print(f"| {r['design']} | {r['keep_rate']} | {r['kept_fraction']:.3f} | {r['seed']} | {r['audits']} "
              f"| {fmt(r['median_cosine'])} | {fmt(r['mean_rel_error'])} "
              f"| {fmt(r['mean_model_error'])} | {fmt(r['median_noise_to_signal'], '.2f')} "
              f"| {fmt(r['final_bias_z'], '.2f')} | {fmt(r['max_bias_z'], '.2f')} | {fmt(r['audit_share'], '.2f')} |")
    result = {"config": config, "elapsed_s": elapsed, "rows": rows, "runs": runs}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.json}")
    return rows


if __name__ == "__main__":
    main()
