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
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from harness import config_default, group_advantages, result_path, text_table, write_json  # noqa: E402

from dppo_trl.core.pruning import PruneProblem, get_design  # noqa: E402


def simulated_problem(rows: int, group: int, seed: int, keep_rate: float = 0.5) -> PruneProblem:
    """One generation batch of ``rows`` completions in groups of ``group``, as the trainer's ``PruneProblem``."""
    g = torch.Generator().manual_seed(seed)
    groups = rows // group
    lengths = torch.exp(torch.randn(rows, generator=g) * 0.8 + 5.0).round().clamp(4, 1024)
    solve_rate = torch.rand(groups, generator=g).repeat_interleave(group)
    rewards = (torch.rand(rows, generator=g) < solve_rate).double()
    return PruneProblem(group_advantages(rewards, group), lengths, torch.arange(rows) // group, rewards, keep_rate,
                        keep_floor=config_default("keep_floor"))


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
            "expected_kept": float(pi.sum()), "kept": kept}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[512, 4096, 16384, 65536])
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--designs", nargs="+", default=["balanced", "stratified"])
    parser.add_argument("--draws", type=int, default=5, help="draws per size (at most 2 above 16,384 rows)")
    parser.add_argument("--json", default=result_path("bench_cube"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = [measure(d, n, args.group, args.draws if n <= 16384 else min(args.draws, 2))
               for n in args.rows for d in args.designs]
    print(text_table(results, [
        ("rows", 7, "rows:"), ("groups", 8, "groups:"), ("  design", -13, lambda r: "  " + r["design"]),
        ("wall (ms)", 11, lambda r: f"{1e3 * r['wall_s']:.1f}"), ("cpu (ms)", 10, lambda r: f"{1e3 * r['cpu_s']:.1f}"),
        ("ms / 1k rows", 14, lambda r: f"{1e6 * r['cpu_s'] / r['rows']:.2f}"),
    ]))
    config = {**vars(args), "threads": torch.get_num_threads(), "torch": torch.__version__}
    out = write_json(args.json, {"config": config, "results": results})
    print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
