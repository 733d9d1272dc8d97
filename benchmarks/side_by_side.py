"""``make demo``: TRL's GRPO and DPPO side by side on a real model, on a CPU.

SmolLM2-135M-Instruct (converted offline by ``dppo_trl.smollm2``) with LoRA learns reasoning-gym's ``chain_sum``
(sums of two numbers of one or two digits). ``GRPOTrainer`` and ``DPPOTrainer`` train from the same start, with the
same seed, prompts and settings. DPPO differs only by its own defaults: it keeps about half of the completions
(unbiased, reweighted) and packs what it keeps. Its speed check is off (it would time GRPO's training passes once,
on DPPO's clock).

The two runs take turns (``harness.interleave``): each trains in a process of its own, and their optimizer steps
alternate, DPPO's, GRPO's, DPPO's, ..., so that a load on the machine that changes falls on both. Each method's
time is the wall time of its own steps; loading the model and the held-out evaluation are not in it.

It prints a table (time, reward at the start and the end, held-out score, completions kept) and writes
``DIR/grpo_vs_dppo.png`` (reward against time) and ``DIR/grpo_vs_dppo.json`` (every logged step).

    python benchmarks/side_by_side.py [--steps N] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK = "chain_sum"
TASK_OPTIONS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, answer_format="last_number")
METHODS = ("DPPO", "GRPO")
EDGE = 3  # logged steps averaged for "reward at the start" and "at the end"
# DPPO's speed check times GRPO's training passes once, inside one of DPPO's steps: on DPPO's clock here, where
# the table measures GRPO itself.
DPPO_ONLY = dict(speed_check=False)
TIMING = ("times: the wall time of each method's own optimizer steps, taken in turns (DPPO's step, GRPO's, "
          "DPPO's, ...)\nin two processes, so that both see the same load; model loading and evaluation not counted")


def trainer_settings(output_dir: Path, steps: int, seed: int) -> dict:
    """The settings both trainers share: TRL's defaults where users keep them (dapo, beta 0), on a CPU."""
    return dict(
        output_dir=str(output_dir),
        max_steps=steps,
        per_device_train_batch_size=32,  # 4 prompts x 8 completions per step
        num_generations=8,
        max_completion_length=16,
        temperature=1.0,
        loss_type="dapo",
        beta=0.0,
        learning_rate=3e-4,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=seed,
    )


def heldout_score(model, tokenizer, dataset, max_new_tokens: int = 16, batch: int = 32) -> float:
    """Mean task score of the greedy completion of each held-out prompt."""
    import torch

    from dppo_trl.tasks.reasoning_gym import reasoning_gym_reward

    scores, padding_side = [], tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(dataset), batch):
            rows = dataset[start : start + batch]
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in rows["prompt"]]
            encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**encoded, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
            completions = tokenizer.batch_decode(out[:, encoded["input_ids"].size(1) :], skip_special_tokens=True)
            scores += reasoning_gym_reward(completions, **rows)
    tokenizer.padding_side = padding_side
    model.train(was_training)
    return statistics.mean(scores)


def progress_callback(name: str, steps: int, turns):
    """A line per logged step, with its reward; it records every logged step (``wall``: the seconds on the run's
    clock of turns, ``turns.elapsed()``)."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        def __init__(self):
            self.records = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                kept = logs.get("dppo/kept_fraction", 1.0)
                record = dict(step=state.global_step, wall=turns.elapsed(), reward=logs["reward"], kept=kept)
                self.records.append(record)
                left = record["wall"] / record["step"] * (steps - record["step"])  # at its mean step time so far
                print(f"{name:>4} step {record['step']:>3}/{steps}  reward {record['reward']:.2f}  kept {kept:.2f}"
                      f"  {record['wall']:6.1f} s, about {left:.0f} s of its steps left", flush=True)

    return Progress()


def prompt_sets(heldout: int) -> dict:
    """The training prompts and the held-out ones (reasoning-gym's generator, seeds 0 and 1)."""
    from dppo_trl.tasks.reasoning_gym import reasoning_gym_dataset

    return {"train": reasoning_gym_dataset(TASK, size=32, seed=0, **TASK_OPTIONS),
            "heldout": reasoning_gym_dataset(TASK, size=heldout, seed=1, **TASK_OPTIONS)}


def train(turns, name: str, model_dir: str, heldout: int, settings: dict) -> dict:
    """One run, a job of ``interleave.run_in_turns``: ``GRPOTrainer`` or ``DPPOTrainer`` with LoRA, its optimizer
    steps in turns; its logged steps, the spans of its clock and its held-out score at the end."""
    from peft import LoraConfig
    from transformers import set_seed
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from harness.interleave import turns_callback

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.tasks.reasoning_gym import reasoning_gym_reward

    quiet_libraries()
    data = prompt_sets(heldout)
    config_cls, trainer_cls = (DPPOConfig, DPPOTrainer) if name == "DPPO" else (GRPOConfig, GRPOTrainer)
    own = DPPO_ONLY if name == "DPPO" else {}
    set_seed(settings["seed"])  # the same LoRA initialization in both runs
    trainer = trainer_cls(
        model_dir,
        reasoning_gym_reward,
        args=config_cls(**{**settings, **own, "output_dir": str(Path(settings["output_dir"]) / name.lower())}),
        train_dataset=data["train"],
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    trainer.remove_callback(PrinterCallback)  # a line per step shows the reward; the table reports the rest
    if name == "DPPO":  # its summary's wall time would count GRPO's turns; the table gives each method's own
        from dppo_trl.host.summary import DPPOSummaryCallback

        trainer.remove_callback(DPPOSummaryCallback)
    trainer.add_callback(turns_callback(turns))
    progress = progress_callback(name, settings["max_steps"], turns)
    trainer.add_callback(progress)
    trainer.train()
    return dict(method=name, steps=progress.records, wall=turns.elapsed(), spans=turns.spans,
                heldout=heldout_score(trainer.model, trainer.processing_class, data["heldout"]))


def summary_rows(runs: list[dict], heldout_start: float) -> list[dict]:
    """Per run: the time of its own steps, its ratio to GRPO's, reward over the first and the last logged steps,
    held-out score, completions kept."""
    grpo_wall = next(r["wall"] for r in runs if r["method"] == "GRPO")
    rows = []
    for run in runs:
        rewards = [s["reward"] for s in run["steps"]]
        rows.append(dict(method=run["method"], wall=run["wall"], time_ratio=run["wall"] / grpo_wall,
                         reward_start=statistics.mean(rewards[:EDGE]), reward_end=statistics.mean(rewards[-EDGE:]),
                         heldout_start=heldout_start, heldout_end=run["heldout"],
                         kept=statistics.mean(s["kept"] for s in run["steps"])))
    return rows


def table(rows: list[dict]) -> str:
    """The rows as printed (``harness.text_table``), and how the times were taken."""
    from harness import text_table

    columns = [("", -1, "method:"), ("time", 1, lambda r: f"{r['wall']:.0f} s"),
               ("vs GRPO", 1, lambda r: f"{r['time_ratio']:.2f}x"),
               ("reward start -> end", 1, lambda r: f"{r['reward_start']:.2f} -> {r['reward_end']:.2f}"),
               ("held-out start -> end", 1, lambda r: f"{r['heldout_start']:.2f} -> {r['heldout_end']:.2f}"),
               ("kept", 1, "kept:.2f")]
    return "\n".join([text_table(rows, columns), TIMING])


def plot(runs: list[dict], path: Path, window: int = 4) -> Path | None:
    """Reward (trailing mean over ``window`` steps; each step faint) against the time of the method's own steps,
    one line per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"DPPO": "tab:blue", "GRPO": "tab:gray"}
    for run in runs:
        color = colors[run["method"]]
        walls, rewards = [s["wall"] for s in run["steps"]], [s["reward"] for s in run["steps"]]
        smooth = [statistics.mean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        ax.plot(walls, rewards, "o", color=color, alpha=0.25, markersize=3)
        ax.plot(walls, smooth, color=color, label=f"{run['method']} ({run['wall']:.0f} s)")
    ax.set_xlabel("wall time of its own steps, taken in turns (s)")
    ax.set_ylabel(f"reward (mean of {window} steps)")
    ax.set_title(f"SmolLM2-135M-Instruct + LoRA, reasoning-gym {TASK}, same steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/side_by_side.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps of each run (default: 8)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="outputs/demo", help="where the plot and the JSON go")
    parser.add_argument("--heldout", type=int, default=64, help="held-out prompts, scored greedily (default: 64)")
    parser.add_argument("--model", default=None, help="a SmolLM2-135M-Instruct folder (default: convert one)")
    args = parser.parse_args(argv)

    from harness.interleave import run_in_turns

    from dppo_trl import smollm2

    if args.steps < 2 * EDGE:
        print(f"Warning: --steps {args.steps} is under {2 * EDGE}: the reward at the start and at the end average the "
              f"first and the last {EDGE} steps, which overlap, so they read partly the same steps.", flush=True)
    quiet_libraries()
    started = time.perf_counter()
    model_dir = str(smollm2.ensure(args.model))
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    settings = trainer_settings(output_dir, args.steps, args.seed)
    print(f"Loading {Path(model_dir).name} for GRPO and DPPO, each in a process of its own, then {args.steps} steps "
          "of each in turns: the first step comes in a minute or two.", flush=True)
    runs = run_in_turns([(train, name, model_dir, args.heldout, settings) for name in METHODS],
                        preload=("dppo_trl.trainer",))
    rows = summary_rows(runs, heldout_start=base_heldout_score(model_dir, prompt_sets(args.heldout)["heldout"]))
    print(f"\nGRPO and DPPO, SmolLM2-135M-Instruct + LoRA on reasoning-gym {TASK}, {args.steps} steps each, "
          f"seed {args.seed}.\nReward: the mean over the first and the last {EDGE} steps. Held-out: the mean score "
          f"of greedy answers to {args.heldout} prompts never trained on.")
    print(table(rows))
    png = plot(runs, output_dir / "grpo_vs_dppo.png")
    elapsed = time.perf_counter() - started  # the model's conversion (when it runs), loading, both runs, evaluation
    shared = {k: v for k, v in settings.items() if k != "output_dir"}
    record = dict(task=TASK, steps=args.steps, seed=args.seed, heldout=args.heldout, elapsed_s=elapsed,
                  timing=" ".join(TIMING.split()), settings=shared, dppo_settings=DPPO_ONLY, rows=rows, runs=runs)
    (output_dir / "grpo_vs_dppo.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {output_dir / 'grpo_vs_dppo.json'}" + (f" and {png}" if png else "") + f" ({elapsed:.0f} s in all)")
    return 0


def quiet_libraries() -> None:
    """Leave the screen to the bars and the table: no weight-loading bars, no deprecation notices of the
    libraries (their FutureWarnings are TRL's and transformers' own, printed for GRPOTrainer alike)."""
    import warnings

    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def base_heldout_score(model_dir: str, dataset) -> float:
    """The held-out score of the start both runs share (LoRA starts as the identity)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32")
    return heldout_score(model, AutoTokenizer.from_pretrained(model_dir), dataset)


if __name__ == "__main__":
    sys.exit(main())
