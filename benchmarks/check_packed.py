"""Packed == padded, on the attention kernels this machine has: the per-token log-probs DPPO's padding-free calls
give (several sequences per packed row, position_ids restarting per sequence, cu_seq_lens under a variable-length
kernel) against TRL's padded call, on a batch of long-tailed lengths. Exits 1 when a kernel disagrees.

CUDA: bf16, ``sdpa`` and ``flash_attention_2`` (when flash-attn is installed); the tolerance is bf16's (a
sequence mixed with its neighbours is off by O(1) nats). CPU: float32, sdpa, eager and the flash stand-in of
the tests (``tests/varlen_reference.py``).

    python benchmarks/check_packed.py --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from harness import suite_helper, write_json  # noqa: E402


def kernels(cuda: bool) -> list[str]:
    if not cuda:
        return ["sdpa", "eager", suite_helper("varlen_reference").register()]
    found = ["sdpa"]
    if importlib.util.find_spec("flash_attn") is not None:
        found.append("flash_attention_2")
    return found


def long_tailed_batch(vocab: int, rows: int, prompt: int, completion: int, pad: int, generator) -> dict:
    """Left-padded prompts and right-padded completions whose lengths span 1..completion, most of them short."""
    lengths = (completion * torch.rand(rows, generator=generator) ** 3).long().clamp(min=1)
    prompt_lengths = torch.randint(1, prompt + 1, (rows,), generator=generator)
    prompt_ids = torch.randint(10, vocab, (rows, prompt), generator=generator)
    prompt_mask = (torch.arange(prompt).flip(0)[None] < prompt_lengths[:, None]).long()
    completion_ids = torch.randint(10, vocab, (rows, completion), generator=generator)
    completion_mask = (torch.arange(completion)[None] < lengths[:, None]).long()
    prompt_ids[prompt_mask == 0], completion_ids[completion_mask == 0] = pad, pad
    return {"ids": torch.cat([prompt_ids, completion_ids], 1), "mask": torch.cat([prompt_mask, completion_mask], 1),
            "completion_mask": completion_mask, "width": completion}


def compare(model_dir: str, attn: str, cuda: bool, rows: int, prompt: int, completion: int) -> dict:
    from trl import GRPOTrainer

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.tasks.toy import addition_dataset, addition_pairs

    model_init_kwargs = {"attn_implementation": attn, "dtype": torch.bfloat16 if cuda else torch.float32}
    args = DPPOConfig(output_dir=tempfile.mkdtemp(), bf16=cuda, use_cpu=not cuda, report_to=[], save_strategy="no",
                      per_device_train_batch_size=rows, num_generations=rows, max_completion_length=completion,
                      gradient_checkpointing=False, model_init_kwargs=model_init_kwargs)
    trainer = DPPOTrainer(model_dir, lambda completions, **_: [0.0] * len(completions), args=args,
                          train_dataset=addition_dataset(addition_pairs(seed=0)[0][:8]))
    trainer.model.train()
    device = trainer.accelerator.device
    batch = long_tailed_batch(trainer.model.config.vocab_size, rows, prompt, completion,
                              trainer.processing_class.pad_token_id, torch.Generator().manual_seed(0))
    ids, mask, width = batch["ids"].to(device), batch["mask"].to(device), batch["width"]
    with torch.no_grad():
        padded = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, width)[0]
        # Row budgets that put several sequences in each of several packed rows, and the default one.
        results = {}
        for budget in (None, ids.size(1), 3 * ids.size(1)):
            trainer.args.max_packed_tokens = budget
            packed = trainer._packed_logps_and_entropies(trainer.model, ids, mask, width, False)[0]
            real = batch["completion_mask"].to(device).bool()
            diff = (packed.float() - padded.float())[real].abs()
            results[str(budget or "default")] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model directory (default: a random-init local Qwen2)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=24)
    parser.add_argument("--completion", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(1)
    model_dir = args.model
    if model_dir is None:
        from dppo_trl.tasks.toy import save_tiny_model

        model_dir = save_tiny_model(tempfile.mkdtemp(), hidden_size=args.hidden_size, num_layers=args.layers)
    # bf16 rounds log-probs to ~1e-2 nats at these magnitudes; a sequence attending to its neighbours is off by O(1).
    max_abs, mean_abs = (0.25, 0.03) if cuda else (1e-4, 1e-5)
    report, ok = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "tolerance": [max_abs, mean_abs]}, True
    for attn in kernels(cuda):
        report[attn] = compare(model_dir, attn, cuda, args.rows, args.prompt, args.completion)
        for budget, r in report[attn].items():
            good = r["max_abs"] <= max_abs and r["mean_abs"] <= mean_abs
            ok &= good
            print(f"packed == padded  {attn:<22} budget {budget:<8} max {r['max_abs']:.2e}  mean "
                  f"{r['mean_abs']:.2e}  {'ok' if good else 'MISMATCH'}")
    if args.json:
        write_json(args.json, report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
