"""``make demo``: fully offline DPPO training on two-digit addition with a tiny Qwen2, through the CLI.

``python -m dppo_trl.demo prepare DIR`` builds a 128-wide, 2-layer Qwen2 and a character tokenizer,
warm-starts the model with plain supervised steps until it samples the right answer sometimes, and writes
it to ``DIR/warm-start`` with the train / held-out prompts in ``DIR/data``. Then
``dppo-trl --config recipes/cpu-demo.yaml`` trains it (exact-answer reward) and prints the DPPO summary.
``python -m dppo_trl.demo [DIR] [dppo-trl flags]`` does both (flags override the recipe).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "cpu-demo.yaml"


def prepare(directory: str | Path, sft_steps: int = 300, seed: int = 0) -> Path:
    """Warm-started model in ``directory/warm-start``, prompts in ``directory/data/{train,test}.jsonl``."""
    import torch

    from .toy import addition_dataset, addition_pairs, build_tiny_model, build_tokenizer, supervised_warm_start

    torch.set_num_threads(1)  # this task is latency bound; one thread is faster and steadier on small CPUs
    directory = Path(directory)
    start = time.perf_counter()
    train_pairs, heldout_pairs = addition_pairs(seed=seed)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=128, num_layers=2, seed=seed)
    supervised_warm_start(model, tokenizer, train_pairs, steps=sft_steps, seed=seed)
    model.save_pretrained(directory / "warm-start")
    tokenizer.save_pretrained(directory / "warm-start")
    (directory / "data").mkdir(parents=True, exist_ok=True)
    addition_dataset(train_pairs).to_json(str(directory / "data" / "train.jsonl"))
    addition_dataset(heldout_pairs).to_json(str(directory / "data" / "test.jsonl"))
    print(f"warm start: {sft_steps} supervised steps in {time.perf_counter() - start:.0f} s -> {directory}")
    return directory


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=["prepare", "all"], default="all")
    parser.add_argument("directory", nargs="?", default="demo-output")
    parser.add_argument("--sft-steps", type=int, default=300)
    args, dppo_args = parser.parse_known_args(argv)
    prepare(args.directory, args.sft_steps)
    if args.command == "all":
        from .cli import main as cli_main

        directory = Path(args.directory)
        cli_main(
            [
                "--config",
                str(RECIPE),
                "--model_name_or_path",
                str(directory / "warm-start"),
                "--dataset_name",
                str(directory / "data"),
                "--output_dir",
                str(directory / "run"),
                *dppo_args,
            ]
        )


if __name__ == "__main__":
    main()
