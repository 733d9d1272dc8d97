"""Cost of one draw of the ``balanced`` design (the cube method, ``dppo_trl.core.cube``) against ``stratified``, on
simulated generation batches of ``--rows`` rows in groups of ``--group`` (16): binary rewards at a per-group
solve rate drawn uniformly (so some groups are zero-spread), TRL's group advantages, long-tailed completion
lengths, ``completion_keep_rate`` 0.5 of the rows. One thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``).
The keep probabilities are solved before timing (they are shared by every design); a draw is the design's call:
its balancing variables, its order and its walk. Reported: the median over ``--draws`` seeded draws of the wall
time and of the process CPU time (the CPU time is what a busy machine distorts least).

    python benchmarks/bench_cube.py                          # 512, 4096, 16384, 65536 rows
    python benchmarks/bench_cube.py --rows 512 4096 --draws 3
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before numpy and torch load their thread pools
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dppo_trl.core.pruning import PruneProblem, get_design  # noqa: E402


def simulated_problem(rows: int, group: int, seed: int, keep_rate: float = 0.5) -> PruneProblem:
    """One generation batch of ``rows`` completions in groups of ``group``, as the trainer's ``PruneProblem``."""
    g = torch.Generator().manual_seed(seed)
    groups = rows // group
    lengths = torch.exp(torch.randn(rows, generator=g) * 0.8 + 5.0).round().clamp(4, 1024)
    solve_rate = torch.rand(groups, generator=g).repeat_interleave(group)
    rewards = (torch.rand(rows, generator=g) < solve_rate).double().view(groups, group)
    advantages = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).flatten()
    return PruneProblem(advantages, lengths, torch.arange(rows) // group, rewards.flatten(), keep_rate, keep_floor=0.05)


def measure(design: str, rows: int, group: int, draws: int) -> dict:
    problem = simulated_problem(rows, group, seed=0)
    pi = problem.keep_probabilities()  # solved once per problem, outside the timing
    walls, cpus, kept = [], [], []
    for seed in range(draws):
        generator = torch.Generator().manual_seed(seed)
        wall, cpu = time.perf_counter(), time.process_time()
        keep, _ = get_design(design)(problem, generator)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        kept.append(int(keep.sum()))
    return {"design": design, "rows": rows, "groups": rows // group, "draws": draws,
            "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
            "expected_kept": float(pi.sum()), "kept": kept}  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[512, 4096, 16384, 65536])
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--designs", nargs="+", default=["balanced", "stratified"])
    parser.add_argument("--draws", type=int, default=5, help="draws per size (at most 2 above 16,384 rows)")
    parser.add_argument("--json", default="benchmarks/results/bench_cube.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [measure(d, n, args.group, args.draws if n <= 16384 else min(args.draws, 2))
               for n in args.rows for d in args.designs]  # fmt: skip
    print(f"{'rows':>7}{'groups':>8}  {'design':<11}{'wall (ms)':>11}{'cpu (ms)':>10}{'ms / 1k rows':>14}")
    for r in results:
        print(f"{r['rows']:>7}{r['groups']:>8}  {r['design']:<11}{1e3 * r['wall_s']:>11.1f}{1e3 * r['cpu_s']:>10.1f}"
              f"{1e6 * r['cpu_s'] / r['rows']:>14.2f}")  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {**vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__}
    out.write_text(json.dumps({"config": config, "results": results}, indent=1))
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
