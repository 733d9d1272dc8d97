"""``make demo-tiny``: fully offline DPPO training on two-digit addition with a tiny Qwen2, through the CLI.

``python -m dppo_trl.demo prepare [DIR]`` builds a 128-wide, 2-layer Qwen2 and a character tokenizer,
warm-starts the model with plain supervised steps until it samples the right answer sometimes, and writes
it to ``DIR/warm-start`` with the train / held-out prompts in ``DIR/data`` (``DIR`` is ``demo-output`` in the
current directory by default, which is where the shipped ``cpu-demo`` recipe looks). Then, from the same
directory, ``dppo-trl --config cpu-demo`` trains it (exact-answer reward) and prints the DPPO summary.
``python -m dppo_trl.demo [all] [DIR] [dppo-trl flags]`` does both (flags override the recipe).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_DIRECTORY = "demo-output"  # what recipes/cpu-demo.yaml reads, relative to the current directory


def prepare(directory: str | Path, sft_steps: int = 300, seed: int = 0) -> Path:
    """Warm-started model in ``directory/warm-start``, prompts in ``directory/data/{train,test}.jsonl``."""
    import torch

    from .tasks.toy import addition_dataset, addition_pairs, build_tiny_model, build_tokenizer, supervised_warm_start

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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in ("prepare", "all") else "all"
    directory = argv.pop(0) if argv and not argv[0].startswith("-") else DEFAULT_DIRECTORY
    parser = argparse.ArgumentParser(
        prog="python -m dppo_trl.demo",
        usage="%(prog)s [prepare | all] [DIR] [--sft-steps N] [dppo-trl flags]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--sft-steps", type=int, default=300, help="supervised warm-start steps (default: 300)")
    args, dppo_args = parser.parse_known_args(argv)
    if command == "prepare" and dppo_args:
        parser.error(f"prepare takes no dppo-trl flags: {' '.join(dppo_args)}")
    if command == "prepare":
        directory = prepare(directory, args.sft_steps)
        paths = (
            ""
            if str(directory) == DEFAULT_DIRECTORY
            else f" --model_name_or_path {directory / 'warm-start'} --dataset_name {directory / 'data'}"
            f" --output_dir {directory / 'run'}"
        )
        print(f"next, from this directory: dppo-trl --config cpu-demo{paths}")
        return 0
    from .cli import CLIError, bundled_recipes, parse
    from .cli import main as cli_main

    directory = Path(directory)
    cli_argv = [
        "--config",
        str(bundled_recipes()["cpu-demo"]),
        "--model_name_or_path",
        str(directory / "warm-start"),
        "--dataset_name",
        str(directory / "data"),
        "--output_dir",
        str(directory / "run"),
        *dppo_args,
    ]
    try:
        parse(cli_argv)  # a bad flag stops it here, before the warm start
    except CLIError as error:
        print(error, file=sys.stderr)
        raise
    prepare(directory, args.sft_steps)
    return cli_main(cli_argv)


if __name__ == "__main__":
    sys.exit(main())
