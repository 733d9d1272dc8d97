"""Token load across ranks before and after DPPO moves kept rows between them (``balance_ranks``), on
simulated generation batches: long-tailed completion lengths, binary rewards in groups of 8 (GRPO
advantages, some groups all equal), systematic sampling at the given keep rates. Pure planning, no model:
it shows what the slowest rank would carry (max / mean kept tokens per rank) and how many rows move.

    python benchmarks/bench_balance.py                    # worlds 2, 4, 8; keep 0.25, 0.5, 1.0; 200 batches each
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dppo_trl.core.packing import balance_ranks, rank_imbalance  # noqa: E402
from dppo_trl.core.pruning import keep_probabilities, systematic_sample  # noqa: E402


def simulated_batch(world, rows_per_rank, group, generator):
    """Sequence lengths and GRPO advantages of one generation batch spread over ``world`` ranks."""
    n = world * rows_per_rank
    prompts = torch.randint(30, 81, (n // group,), generator=generator).repeat_interleave(group)
    completions = torch.exp(torch.randn(n, generator=generator) * 0.8 + 4.5).round().clamp(4, 1024)
    solve_rate = torch.rand(n // group, generator=generator).repeat_interleave(group)
    rewards = (torch.rand(n, generator=generator) < solve_rate).double().view(-1, group)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    return (prompts + completions).long(), advantages


def measure(world, keep_rate, batches, rows_per_rank=64, group=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    before, after, moved = [], [], []
    for _ in range(batches):
        lengths, advantages = simulated_batch(world, rows_per_rank, group, generator)
        pi, _ = keep_probabilities(advantages, keep_rate, 0.05, zero_score_contributes=False)
        keep = systematic_sample(pi, generator)
        kept = [lengths[r * rows_per_rank : (r + 1) * rows_per_rank][keep[r * rows_per_rank : (r + 1) * rows_per_rank]]
                .tolist() for r in range(world)]  # fmt: skip
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
    parser.add_argument("--json", default="benchmarks/results/bench_balance.json")
    args = parser.parse_args(argv)
    rows = [measure(w, k, args.batches, args.rows_per_rank) for w in args.worlds for k in args.keep_rates]
    print(f"{'ranks':>5}{'keep':>6}{'before med':>12}{'before p95':>12}{'after med':>11}{'after p95':>11}"
          f"{'<=1.1':>7}{'moved':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['world']:>5}{r['keep_rate']:>6}{r['imbalance_before_median']:>12.3f}{r['imbalance_before_p95']:>12.3f}"
              f"{r['imbalance_after_median']:>11.3f}{r['imbalance_after_p95']:>11.3f}"
              f"{r['within_10_percent_after']:>7.2f}{r['rows_moved_fraction']:>7.2f}")  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "results": rows}, indent=1))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
