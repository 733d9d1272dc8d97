"""``make demo``: fully offline DPPO training on two-digit addition with a tiny Qwen2.

It builds a 128-wide, 2-layer Qwen2 and a character tokenizer, warm-starts the model with plain supervised
steps until it samples the right answer sometimes, then trains it with ``DPPOTrainer`` (exact-answer reward)
and prints a summary: steps, wall time, reward at start and end, kept fraction, held-out accuracy.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500, help="DPPO optimizer steps")
    parser.add_argument("--sft-steps", type=int, default=300, help="supervised warm-start steps")
    parser.add_argument("--completion-keep-rate", type=float, default=0.5)
    parser.add_argument("--prune-sampling", default="systematic")
    parser.add_argument("--prompt-keep-rate", type=float, default=1.0, help="prompt pruning before rollout (1.0: off)")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)

    import torch

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.toy import (
        addition_dataset,
        addition_pairs,
        build_tiny_model,
        build_tokenizer,
        exact_answer_reward,
        sampled_accuracy,
        supervised_warm_start,
    )

    torch.set_num_threads(1)  # this task is latency bound; one thread is faster and steadier on small CPUs
    # Validate the configuration before building anything.
    output_dir = args.output_dir or tempfile.mkdtemp(prefix="dppo-demo-")
    config = DPPOConfig(
        output_dir=output_dir,
        completion_keep_rate=args.completion_keep_rate,
        prune_sampling=args.prune_sampling,
        prompt_keep_rate=args.prompt_keep_rate,
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=8,
        temperature=1.0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        beta=0.0,
        max_steps=args.steps,
        logging_steps=max(1, args.steps // 20),
        save_strategy="no",
        report_to=[],
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=args.seed,
        disable_tqdm=False,
    )

    start = time.perf_counter()
    train_pairs, heldout_pairs = addition_pairs(seed=args.seed)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=128, num_layers=2, seed=args.seed)
    supervised_warm_start(model, tokenizer, train_pairs, steps=args.sft_steps, seed=args.seed)
    model_dir = os.path.join(output_dir, "warm-start")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sft_time = time.perf_counter() - start
    before = sampled_accuracy(model, tokenizer, heldout_pairs, greedy=True)
    print(f"warm start: {args.sft_steps} supervised steps in {sft_time:.0f} s, held-out greedy accuracy {before:.2f}")

    trainer = DPPOTrainer(
        model_dir, exact_answer_reward, args=config, train_dataset=addition_dataset(train_pairs), processing_class=tokenizer
    )
    train_start = time.perf_counter()
    trainer.train()
    train_time = time.perf_counter() - train_start
    after = sampled_accuracy(trainer.model, tokenizer, heldout_pairs, greedy=True)

    logs = [h for h in trainer.state.log_history if "reward" in h]
    first, last = logs[0], logs[-1]
    kept = [h["dppo/kept_fraction"] for h in logs if "dppo/kept_fraction" in h]
    print()
    print("DPPO demo summary")
    print(f"  steps                 {trainer.state.global_step}")
    print(f"  wall time             {train_time:.0f} s training (+ {sft_time:.0f} s warm start)")
    print(f"  reward                {first['reward']:.3f} (first log) -> {last['reward']:.3f} (last log)")
    kept_text = f"{sum(kept) / len(kept):.3f} of completions (mean over logs)" if kept else "1 (pruning off)"
    print(f"  kept fraction         {kept_text}")
    print(f"  held-out greedy acc.  {before:.3f} -> {after:.3f}")
    return trainer


if __name__ == "__main__":
    main()
