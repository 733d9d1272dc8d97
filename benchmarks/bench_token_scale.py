"""The cut's token scale ``T / D`` on reasoning-like completion lengths, simulated (docs/prompt_pruning.md, "What
holds"): under a token-mean loss (dapo, TRL's default) each cut step is GRPO's step times ``T / D``, where ``T`` is
the loss tokens of GRPO's batch (every candidate's group) and ``D`` the count fixed before the draw
(``core.prompts.expected_candidate_tokens``: ``num_generations x`` the sum of each candidate's probe mean length).

The lengths: each prompt has its own median (log-normal over prompts), each completion a log-normal length around it,
cut at ``max_completion_length`` (a truncated completion keeps its full length, as without
``mask_truncated_completions``). The probe is a group's first ``k`` completions, as in the trainer.

    python benchmarks/bench_token_scale.py      # a few seconds; writes benchmarks/results/bench_token_scale.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from dppo_trl.core.prompts import expected_candidate_tokens

RESULTS = Path(__file__).resolve().parent / "results"
# (processes, candidates per process): the candidates D sums over are every process's.
SHAPES = ((1, 4), (1, 16), (8, 4))


def simulated_lengths(prompts: int, group: int, generator: torch.Generator, median: float = 400.0,
                      prompt_sigma: float = 0.5, completion_sigma: float = 0.5, limit: int = 1024) -> torch.Tensor:
    """(prompts, group) completion lengths: a log-normal median per prompt, log-normal lengths around it, cut at
    ``limit``, at least 1 token."""
    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    medians = median * torch.exp(prompt_sigma * normal(prompts, 1))
    return (medians * torch.exp(completion_sigma * normal(prompts, group))).round().clamp(1, limit)


def token_scale(lengths: torch.Tensor, probe: int) -> float:
    """``T / D`` of one step: ``lengths`` (C, G) of every candidate's group; the probe, each group's first ``probe``
    completions."""
    group = lengths.size(1)
    return float(lengths.sum()) / expected_candidate_tokens(lengths[:, :probe].mean(1), group)


def summarize(values: torch.Tensor) -> dict:
    q = torch.quantile(values, torch.tensor([0.05, 0.95], dtype=torch.float64)).tolist()
    return {"mean": float(values.mean()), "sd": float(values.std()), "se": float(values.std()) / math.sqrt(len(values)),
            "q05": q[0], "q95": q[1]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20000, help="simulated steps a shape")
    parser.add_argument("--group", type=int, default=8, help="num_generations")
    parser.add_argument("--probe", type=int, default=2, help="prompt_probe_generations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=str(RESULTS / "bench_token_scale.json"))
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(args.seed)
    scale, every_length = {}, []
    for processes, per_process in SHAPES:
        candidates = processes * per_process
        lengths = [simulated_lengths(candidates, args.group, generator) for _ in range(args.steps)]
        every_length += lengths
        scale[f"{processes}x{per_process}"] = summarize(
            torch.tensor([token_scale(x, args.probe) for x in lengths], dtype=torch.float64))
    flat = torch.cat([x.flatten() for x in every_length])
    result = {"group": args.group, "probe": args.probe, "steps": args.steps, "seed": args.seed,
              "mean_length": float(flat.mean()), "truncated_share": float((flat >= 1024).double().mean()),
              "scale": scale}
    print(f"lengths: mean {result['mean_length']:.0f} tokens, {result['truncated_share']:.1%} at 1024; "
          f"G {args.group}, probe {args.probe}")
    for shape, s in scale.items():
        print(f"{shape:>5}: T/D mean {s['mean']:.3f} (sd {s['sd']:.3f}, 5-95% {s['q05']:.2f}-{s['q95']:.2f})")
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
