"""GRPO vs DPPO time per step by phase on one GPU, with nothing from the network and no TRL, datasets or vLLM:
what a bare GPU machine with torch, transformers and peft runs in a few minutes (`benchmarks/gpu.sh` runs it
first). It prints issue 31's table for that machine: generation, the old-policy log-prob pass, the loss forward
and backward, the rest, per method, and their ratios.

Models: random weights in the shapes of real configs (SmolLM2-135M's Llama, Qwen2.5-0.5B's Qwen2; ``tiny`` for a
CPU), LoRA r 16 on every linear layer. Rollouts: ``--prompts`` random prompts x ``--group`` completions sampled
for ``--completion-lengths`` tokens each (a random model rarely stops, so every completion runs to the end, as a
long reasoning rollout does), then each completion cut to a long-tailed length (its "eos"). Reward: a group's
success rate drawn uniform, each completion a Bernoulli of it (spread within most groups; some groups all
equal, advantage 0). Advantages: TRL's group normalization.

- GRPO, as TRL runs it at ``gradient_accumulation_steps < steps_per_generation``: an old-policy log-prob pass over
  every row, then the loss forward and backward over every row, in padded micro-batches of ``--micro-batch``
  rows (``logits_to_keep``: completion positions only).
- DPPO: ``dppo_trl.core``'s keep probabilities (``|advantage|``, keep 0.5) and systematic sample; the kept rows
  packed padding-free (``pack_rows``, ``packed_inputs``; the default budget per attention kernel) for both
  passes, each kept row's loss weighted by 1 / its keep probability.

The package's pure core is imported without ``dppo_trl/__init__`` (which imports TRL) where TRL is absent.

    python benchmarks/gpu_phases.py --models tiny --completion-lengths 16 32 --json out.json     # CPU, seconds
    bash benchmarks/gpu.sh                                                                        # one GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {  # (transformers model type, config fields): the shapes of the real models, random weights
    "smollm2-135m": ("llama", dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                   num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                   max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                                   tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                   tie_word_embeddings=True)),
    "tiny": ("qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096,
                           tie_word_embeddings=True)),
}
PHASES = ("generation", "logps", "loss", "rest")
PAD = 0


def dppo_core():
    """``(packing, pruning)`` of ``dppo_trl.core``: plain torch, importable without TRL."""
    if "dppo_trl" not in sys.modules and importlib.util.find_spec("trl") is None:
        package = types.ModuleType("dppo_trl")  # the package's __init__ imports TRL: skip it, keep the core
        package.__path__ = [str(ROOT / "dppo_trl")]
        sys.modules["dppo_trl"] = package
    from dppo_trl.core import packing, pruning

    return packing, pruning


def clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def build_model(name, attn, dtype, device, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, fields = CONFIGS[name]
    config = AutoConfig.for_model(kind, **fields, pad_token_id=PAD, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype).to(device)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def rollouts(model, args, length, generator, device) -> dict:
    """Prompts x group completions of ``length`` tokens, each then cut to a long-tailed length; rewards with
    spread; TRL's group advantages. Returns the padded batch (prompt left-aligned, completion after it)."""
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.prompts, args.prompt_length), generator=generator).to(device)
    with torch.no_grad():
        out = model.generate(input_ids=prompts.repeat_interleave(args.group, 0), do_sample=True, top_k=0,
                             max_new_tokens=length, min_new_tokens=length, pad_token_id=PAD)
    completion = out[:, args.prompt_length :]
    rows = completion.size(0)
    kept_length = (length * torch.rand(rows, generator=generator) ** 2).long().clamp(min=1).to(device)
    completion_mask = (torch.arange(completion.size(1), device=device)[None] < kept_length[:, None]).long()
    completion = completion.masked_fill(completion_mask == 0, PAD)
    rates = torch.rand(args.prompts, generator=generator).repeat_interleave(args.group)
    rewards = torch.bernoulli(rates, generator=generator).view(args.prompts, args.group)
    spread = rewards.std(1, keepdim=True)
    advantages = torch.where(spread > 0, (rewards - rewards.mean(1, keepdim=True)) / (spread + 1e-4), 0.0)
    input_ids = torch.cat([out[:, : args.prompt_length], completion], 1)
    mask = torch.cat([torch.ones_like(out[:, : args.prompt_length]), completion_mask], 1)
    return {"input_ids": input_ids, "attention_mask": mask, "completion_mask": completion_mask,
            "advantages": advantages.flatten().to(device), "width": completion.size(1)}


def token_logps(logits, labels):
    """Per-position log-prob of ``labels`` (-100: none) under ``logits``, in float32, chunked by row."""
    out = []
    for row_logits, row_labels in zip(logits, labels):
        lp = torch.log_softmax(row_logits.float(), -1)
        out.append(lp.gather(-1, row_labels.clamp(min=0)[:, None]).squeeze(-1))
    return torch.stack(out)


def padded_pass(model, batch, rows, grad: bool):
    """TRL's padded call over ``rows``: log-probs of the completion tokens; with ``grad``, the ``dapo`` loss
    backpropagated."""
    ids, mask, width = batch["input_ids"][rows], batch["attention_mask"][rows], batch["width"]
    with torch.set_grad_enabled(grad):
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
        logps = token_logps(logits, ids[:, -width:])
        if grad:
            cmask = batch["completion_mask"][rows].float()
            loss = -(logps * batch["advantages"][rows, None] * cmask).sum() / cmask.sum().clamp(min=1)
            loss.backward()
    return logps.detach()


def packed_pass(model, batch, rows, weights, calls, packing, varlen: bool, grad: bool):
    """DPPO's padding-free calls over the kept ``rows`` (``calls``: each call's positions into ``rows`` and its
    packed rows), the loss weighted by ``weights`` (1 / keep probability). Under sdpa without flash-attn the
    packed rows' sequences are not masked from one another: a timing stand-in of the same shape, not the package's
    exact block-diagonal mask."""
    ids, mask, width = batch["input_ids"][rows], batch["attention_mask"][rows], batch["width"]
    tokens = batch["completion_mask"][rows].sum().clamp(min=1)
    scales = batch["advantages"][rows] * weights
    for call, packed_rows in calls:  # positions into ``rows``; its packed rows, positions into ``call``
        sel = torch.tensor(call, device=ids.device)
        segments = [[[i] for i in row] for row in packed_rows]  # each row alone (no prefix sharing here)
        packed = packing.packed_inputs(ids[sel], mask[sel], width, segments, PAD)
        kwargs = packing.varlen_kwargs(packed["position_ids"]) if varlen else {}
        with torch.set_grad_enabled(grad):
            logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], **kwargs).logits
            logps = token_logps(logits, packed["shift_labels"])
            if grad:
                r, c, b, _ = packed["index"]
                scale = scales[sel][b].to(logps.dtype)
                (-(logps[r, c - 1] * scale).sum() / tokens).backward()


def step_times(model, optimizer, batch, method, args, packing, pruning, generator, varlen):
    """One step of ``method`` on ``batch``: seconds of the old-policy pass, the loss, and the rest (selection,
    optimizer); and the rows it trained."""
    device = batch["input_ids"].device
    start = clock(device)
    rows = torch.arange(batch["input_ids"].size(0), device=device)
    if method == "dppo":
        pi, _ = pruning.keep_probabilities(batch["advantages"].cpu(), args.keep_rate, args.keep_floor, False)
        keep = pruning.systematic_sample(pi, generator)
        rows, weights = rows[keep.to(device)], (1.0 / pi[keep]).to(device)
        lengths = batch["attention_mask"][rows].sum(1).tolist()
        # The package's plan: as few calls as fit TRL's padded micro-batch each, packed rows of the kernel's budget.
        budget = packing.default_packed_tokens(args.micro_batch, batch["input_ids"].size(1), varlen)
        call_budget = args.micro_batch * batch["input_ids"].size(1)
        calls = [(group, packing.pack_call([lengths[i] for i in group], budget, call_budget))
                 for group in packing.plan_forward_calls(lengths, args.micro_batch, budget, call_budget) if group]
    selected = clock(device)
    if method == "grpo":
        for chunk in rows.split(args.micro_batch):
            padded_pass(model, batch, chunk, grad=False)
    elif len(rows):
        packed_pass(model, batch, rows, weights, calls, packing, varlen, grad=False)
    logps = clock(device)
    if method == "grpo":
        for chunk in rows.split(args.micro_batch):
            padded_pass(model, batch, chunk, grad=True)
    elif len(rows):
        packed_pass(model, batch, rows, weights, calls, packing, varlen, grad=True)
    loss = clock(device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end = clock(device)
    return {"logps": logps - selected, "loss": loss - logps, "rest": (selected - start) + (end - loss),
            "rows": len(rows)}


def measure(name, length, args, device, dtype, attn, packing, pruning) -> list[dict]:
    """Both methods on the same rollouts, ``--steps`` times; medians over the steps after the first."""
    model = build_model(name, attn, dtype, device, args.seed)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    generator = torch.Generator().manual_seed(args.seed)
    varlen = attn == "flash_attention_2"
    records = {"grpo": [], "dppo": []}
    for _ in range(args.steps):
        model.eval()
        start = clock(device)
        batch = rollouts(model, args, length, generator, device)
        generation = clock(device) - start
        model.train()
        for method in records:
            records[method].append({"generation": generation,
                                    **step_times(model, optimizer, batch, method, args, packing, pruning, generator,
                                                 varlen)})
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out = []
    for method, steps in records.items():
        timed = steps[1:] or steps
        row = {"model": name, "completion_length": length, "method": method, "attn": attn,
               **{p: statistics.median(s[p] for s in timed) for p in PHASES},
               "rows": statistics.median(s["rows"] for s in timed)}
        row["step"] = sum(row[p] for p in PHASES)
        out.append(row)
    grpo, dppo = out
    for row in out:
        row["step_ratio"] = row["step"] / grpo["step"]
        row["training_ratio"] = (row["step"] - row["generation"]) / (grpo["step"] - grpo["generation"])
        row["generation_share"] = row["generation"] / row["step"]
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-0.5b"], choices=list(CONFIGS))
    parser.add_argument("--completion-lengths", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows of one padded call (TRL's batch size)")
    parser.add_argument("--keep-rate", type=float, default=0.5)
    parser.add_argument("--keep-floor", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=3, help="steps per model and length (the first not timed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "bench_gpu_phases.json"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    attn = "flash_attention_2" if cuda and importlib.util.find_spec("flash_attn") is not None else "sdpa"
    packing, pruning = dppo_core()
    started = time.perf_counter()
    rows = []
    for name in args.models:
        for length in args.completion_lengths:
            rows += measure(name, length, args, device, dtype, attn, packing, pruning)
            print(f"[{time.perf_counter() - started:6.0f} s] {name}, completions of {length}", flush=True)
    header = f"{'model':<14}{'length':>7}  {'method':<6}{'rows':>6}" + "".join(f"{p:>12}" for p in PHASES)
    print(f"\nseconds per step by phase ({device}, {attn}, {dtype}), and DPPO over GRPO\n{header}"
          f"{'step':>10}{'step/GRPO':>11}{'train/GRPO':>12}{'gen share':>11}")
    for r in rows:
        print(f"{r['model']:<14}{r['completion_length']:>7}  {r['method']:<6}{r['rows']:>6.0f}"
              + "".join(f"{r[p]:>12.3f}" for p in PHASES)
              + f"{r['step']:>10.3f}{r['step_ratio']:>11.3f}{r['training_ratio']:>12.3f}{r['generation_share']:>11.2f}")
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    record = {"config": vars(args), "device": device_name, "attn": attn, "dtype": str(dtype),
              "torch": torch.__version__, "elapsed_s": time.perf_counter() - started, "results": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
