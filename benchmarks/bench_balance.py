"""Token load across ranks before and after DPPO moves kept rows between them (``balance_ranks``), on
simulated generation batches: long-tailed completion lengths, binary rewards in groups of 8 (GRPO
advantages, some groups all equal), systematic sampling at the given keep rates. Pure planning, no model:
it shows what the slowest rank would carry (max / mean kept tokens per rank) and how many rows move.

    python benchmarks/bench_balance.py                    # worlds 2, 4, 8; keep 0.25, 0.5, 1.0; 200 batches each
"""

from __future__ import annotations

import argparse
import statistics

import torch
from harness import config_default, group_advantages, result_path, text_table, write_json

from dppo_trl.core.packing import balance_ranks, rank_imbalance
from dppo_trl.core.pruning import keep_probabilities, systematic_sample


def simulated_batch(world, rows_per_rank, group, generator):
    """Sequence lengths and GRPO advantages of one generation batch spread over ``world`` ranks."""
    n = world * rows_per_rank
    prompts = torch.randint(30, 81, (n // group,), generator=generator).repeat_interleave(group)
    completions = torch.exp(torch.randn(n, generator=generator) * 0.8 + 4.5).round().clamp(4, 1024)
    solve_rate = torch.rand(n // group, generator=generator).repeat_interleave(group)
    rewards = (torch.rand(n, generator=generator) < solve_rate).double()
    return (prompts + completions).long(), group_advantages(rewards, group)


def measure(world, keep_rate, batches, rows_per_rank=64, group=8, seed=0):
    generator, floor = torch.Generator().manual_seed(seed), config_default("keep_floor")
    before, after, moved = [], [], []
    for _ in range(batches):
        lengths, advantages = simulated_batch(world, rows_per_rank, group, generator)
        pi, _ = keep_probabilities(advantages, keep_rate, floor, zero_score_contributes=False)
        keep = systematic_sample(pi, generator)
        ranks = [slice(r * rows_per_rank, (r + 1) * rows_per_rank) for r in range(world)]
        kept = [lengths[rank][keep[rank]].tolist() for rank in ranks]
        plan = balance_ranks(kept)
        before.append(rank_imbalance([sum(k) for k in kept]))
        after.append(rank_imbalance([sum(kept[r][i] for r, i in rows) for rows in plan]))
        moved.append(
            sum(src != dest for dest, rows in enumerate(plan) for src, _ in rows) / max(1, sum(map(len, kept)))
        )
    return {
        "world": world,
        "keep_rate": keep_rate,
        "imbalance_before_median": statistics.median(before),
        "imbalance_before_p95": sorted(before)[int(0.95 * (len(before) - 1))],
        "imbalance_after_median": statistics.median(after),
        "imbalance_after_p95": sorted(after)[int(0.95 * (len(after) - 1))],
        "within_10_percent_after": sum(a <= 1.1 for a in after) / len(after),
        "rows_moved_fraction": statistics.mean(moved),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--keep-rates", nargs="+", type=float, default=[0.25, 0.5, 1.0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rows-per-rank", type=int, default=64)
    parser.add_argument("--json", default=result_path("bench_balance"))
    args = parser.parse_args(argv)
    rows = [measure(w, k, args.batches, args.rows_per_rank) for w in args.worlds for k in args.keep_rates]
    print(text_table(rows, [
        ("ranks", 5, "world:"), ("keep", 6, "keep_rate:"), ("before med", 12, "imbalance_before_median:.3f"),
        ("before p95", 12, "imbalance_before_p95:.3f"), ("after med", 11, "imbalance_after_median:.3f"),
        ("after p95", 11, "imbalance_after_p95:.3f"), ("<=1.1", 7, "within_10_percent_after:.2f"),
        ("moved", 7, "rows_moved_fraction:.2f"),
    ]))
    out = write_json(args.json, {"config": vars(args), "results": rows})
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
