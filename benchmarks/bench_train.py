"""Training-phase benchmark: the reference log-prob pass plus the loss forward/backward of one generation batch,
timed in one run for TRL's GRPOTrainer path, DPPO pruning without packing, and DPPO pruning with packing.

The generation batch is fixed by a seed: realistic long-tailed completion lengths, binary rewards with some
groups all solved or all failed (zero variance), GRPO advantages. Single-threaded, warm-up rounds, the
variants interleaved in every round (these machines are shared and noisy), medians reported.

    make bench-train            # or: python benchmarks/bench_train.py --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from harness import group_advantages, result_path, text_table, write_json  # noqa: E402


def recorded_batch(trainer, prompts=8, generations=8, seed=0, max_completion=256):
    """One generation batch as TRL's `_generate_and_score_completions` returns it (padded, on CPU)."""
    g = torch.Generator().manual_seed(seed)
    pad = trainer.processing_class.pad_token_id
    vocab = trainer.model.config.vocab_size
    n = prompts * generations
    prompt_lengths = torch.randint(30, 81, (prompts,), generator=g).repeat_interleave(generations)
    completion_lengths = torch.exp(torch.randn(n, generator=g) * 0.8 + 4.0).round().clamp(4, max_completion).long()
    prompt_width, completion_width = int(prompt_lengths.max()), int(completion_lengths.max())
    prompt_ids = torch.randint(10, vocab, (n, prompt_width), generator=g)
    prompt_mask = (torch.arange(prompt_width)[None] >= prompt_width - prompt_lengths[:, None]).long()
    prompt_ids[prompt_mask == 0] = pad
    completion_ids = torch.randint(10, vocab, (n, completion_width), generator=g)
    completion_mask = (torch.arange(completion_width)[None] < completion_lengths[:, None]).long()
    completion_ids[completion_mask == 0] = pad
    solve_rate = torch.tensor([0.0, 1.0, 0.5, 0.25, 0.75, 0.0, 0.6, 0.4])[:prompts].repeat_interleave(generations)
    advantages = group_advantages((torch.rand(n, generator=g) < solve_rate).float(), generations)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }


def build(kind, model_dir, dataset, args_kwargs, max_packed_tokens=None):
    from trl import GRPOConfig, GRPOTrainer

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.tasks.toy import exact_answer_reward

    common = dict(
        output_dir=tempfile.mkdtemp(),
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        **args_kwargs,
    )
    if kind == "grpo":
        trainer = GRPOTrainer(model_dir, exact_answer_reward, args=GRPOConfig(**common), train_dataset=dataset)
    else:
        packing = kind == "dppo+packing"
        config = DPPOConfig(
            **common,
            completion_keep_rate=0.5,
            packing=packing,
            max_packed_tokens=max_packed_tokens if packing else None,
            # Packing against padding, counted in repeated rows; prefix sharing is benchmarks/bench_prefix.py's.
            prefix_sharing=False if packing else None,
        )
        trainer = DPPOTrainer(model_dir, exact_answer_reward, args=config, train_dataset=dataset)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer


def training_phase(trainer, batch, kind):
    """Reference pass + loss forward/backward over the micro-batches. Returns (real, allocated) tokens."""
    from trl import GRPOTrainer
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

    from dppo_trl.core.packing import packed_allocation, plan_forward_calls
    from dppo_trl.components.generation_batch import GenerationBatch

    batch = {k: v.clone() for k, v in batch.items()}
    spg = trainer.args.steps_per_generation
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    lengths = mask.sum(1)
    if kind == "grpo":
        with torch.no_grad():
            batch["ref_per_token_logps"] = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, trainer.ref_model, ids, mask, width, batch_size=trainer.args.per_device_train_batch_size
            )[0]
        microbatches = split_tensor_dict(shuffle_sequence_dict(batch), spg)
        real, allocated = 2 * float(lengths.sum()), 2 * float(ids.numel())
    else:
        # The trainer's passes after scoring (DPPOTrainer._generate_and_score_completions), on the recorded batch.
        batch["ref_per_token_logps"] = torch.zeros(ids.size(0), width)
        decided = GenerationBatch(deferred_calls=[trainer.ref_model])
        trainer.keep_decision.draw(batch, decided, batch["advantages"].abs())
        keep = decided.keep
        batch["dppo_keep"], batch["dppo_weight"] = keep, decided.weights.float()
        batch.update(trainer.placement.trl_split_of_rows(batch, decided))
        trainer._run_deferred_logps(batch, decided)
        microbatches = trainer.placement.kept_microbatches(shuffle_sequence_dict(batch), decided)
        kept_real = float(lengths[keep].sum())
        real = 2 * kept_real
        if kind == "dppo+packing":
            budget, call = trainer.placement.packed_budget(ids.size(1)), trainer.args.per_device_train_batch_size * ids.size(1)
            calls = plan_forward_calls(lengths[keep].tolist(), trainer.args.per_device_train_batch_size, budget, call)
            allocated = sum(packed_allocation([int(lengths[keep][i]) for i in g], budget, call) for g in calls) + sum(
                packed_allocation((mb["prompt_mask"].sum(1) + mb["completion_mask"].sum(1)).tolist(), budget, call)
                for mb in microbatches
            )
        else:
            allocated = float(keep.sum()) * ids.size(1) + sum(
                mb["prompt_ids"].size(0) for mb in microbatches
            ) * ids.size(1)
    for mb in microbatches:
        loss = trainer._compute_loss(trainer.model, mb)
        loss.backward()
    trainer.model.zero_grad(set_to_none=True)
    return real, allocated


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-packed-tokens", type=int, default=None, help="DPPOConfig.max_packed_tokens")
    parser.add_argument("--json", default=result_path("bench_train"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from dppo_trl.tasks.toy import addition_dataset, addition_pairs, save_tiny_model

    model_dir = save_tiny_model(tempfile.mkdtemp(), hidden_size=args.hidden_size, num_layers=args.layers)
    dataset = addition_dataset(addition_pairs()[0][:64])
    trainer_args = dict(
        per_device_train_batch_size=16,
        num_generations=8,
        steps_per_generation=4,
        gradient_accumulation_steps=4,
        beta=0.04,
        max_completion_length=256,
        seed=0,
    )
    kinds = ["grpo", "dppo", "dppo+packing"]
    trainers = {k: build(k, model_dir, dataset, trainer_args, args.max_packed_tokens) for k in kinds}
    batch = recorded_batch(trainers["grpo"])
    times = {k: [] for k in kinds}
    tokens = {}
    for round_index in range(args.warmup + args.rounds):
        for kind in kinds:
            torch.manual_seed(round_index)
            start = time.perf_counter()
            tokens[kind] = training_phase(trainers[kind], batch, kind)
            if round_index >= args.warmup:
                times[kind].append(time.perf_counter() - start)

    base_time = statistics.median(times["grpo"])
    base_allocated = tokens["grpo"][1]
    rows = []
    for kind in kinds:
        real, allocated = tokens[kind]
        med = statistics.median(times[kind])
        rows.append(
            {
                "variant": kind,
                "real_tokens": real,
                "allocated_tokens": allocated,
                "token_density": real / allocated,
                "median_seconds": med,
                "time_ratio_to_grpo": med / base_time,
                "ideal_ratio": real / base_allocated,
                "seconds": times[kind],
            }
        )
    print(text_table(rows, [
        ("variant", -14, "variant:"), ("real tok", 10, "real_tokens:.0f"), ("alloc tok", 11, "allocated_tokens:.0f"),
        ("density", 9, "token_density:.3f"), ("median s", 10, "median_seconds:.3f"),
        ("ratio", 8, "time_ratio_to_grpo:.3f"), ("ideal", 8, "ideal_ratio:.3f"),
    ]))
    packed = rows[-1]
    print(
        f"dppo+packing: {packed['time_ratio_to_grpo'] / packed['ideal_ratio']:.2f}x the ideal ratio "
        f"(target <= 1.10), token density {packed['token_density']:.3f} (target >= 0.98)"
    )
    out = write_json(args.json, {"config": vars(args), "trainer_args": trainer_args, "results": rows}, indent=2)
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
