"""When prefix sharing pays: one group's kept completions forwarded and backpropagated with the prompt once (shared)
against the prompt in every row (repeated, today's packing), over prompt lengths, completion lengths and kept
completions per group, on a small model with SmolLM2-135M's layer shapes (2 layers, random weights, LoRA r 16).

Both modes run DPPO's own layout (``core.packing.pack_call`` / ``packed_inputs``, the sdpa row budget: the padded
width) on the same tokens; the shared mode's 4-D mask is ``core.prefix.prefix_attention_mask``. Per cell: the
median time of a forward and backward over ``--repeats`` runs, the peak memory of the call (CPU: the profiler's
memory timeline; CUDA: ``max_memory_allocated``), the token positions forwarded, the largest difference of the
completion log-probs between the modes (exactness, float32 here), and whether DPPOTrainer shares there by default
(``core.prefix.sharing_pays`` at the model's pair cost).

    python benchmarks/bench_prefix.py                       # CPU, about 10 minutes at 2 threads
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_phases import CONFIGS, build_model, clock, dppo_core  # noqa: E402
from harness.report import result_path, text_table, write_json  # noqa: E402

PAD = 0
COLUMNS = [("prompt", 7, "prompt_length:d"), ("completion", 11, "completion_length:d"), ("kept", 5, "kept:d"),
           ("positions\nshared/rep.", 13, "positions_ratio:.3f"), ("time\nshared/rep.", 12, "time_ratio:.3f"),
           ("peak memory\nshared/rep.", 13, "memory_ratio:.3f"), ("max |logp|\ndifference", 13,
                                                                   "max_logp_difference:.1e"),
           ("shared by\ndefault", 10, lambda r: "yes" if r["shared_by_default"] else "no")]


def group_batch(prompt_length, completion_length, kept, vocab, generator):
    """One prompt and ``kept`` completions of ``completion_length`` tokens each, padded as TRL pads them."""
    prompt = torch.randint(3, vocab, (1, prompt_length), generator=generator).repeat(kept, 1)
    completions = torch.randint(3, vocab, (kept, completion_length), generator=generator)
    ids = torch.cat([prompt, completions], 1)
    return ids, torch.ones_like(ids)


def packed_call(ids, mask, completion_length, shared: bool):
    """The packed inputs of one call over the group's rows, shared or repeated, as DPPOTrainer builds them."""
    packing, _ = dppo_core()
    from dppo_trl.core.prefix import prefix_attention_mask, segment_length

    rows, width = ids.size(0), ids.size(1)
    segments = [list(range(rows))] if shared else [[b] for b in range(rows)]
    prompt_length = width - completion_length
    lengths = [segment_length([width] * len(s), prompt_length) for s in segments]
    plan = packing.pack_call(lengths, width, rows * width, fit_longest=shared)
    packed = packing.packed_inputs(ids, mask, completion_length, [[segments[i] for i in row] for row in plan], PAD)
    layout = packed.pop("layout")
    if shared and rows > 1:  # as DPPOTrainer: no segment shares, no 4-D mask
        packed["attention_mask"] = prefix_attention_mask(*layout)
    return packed


def forward_backward(model, packed, device):
    """The completion tokens' log-probs (from the hidden states at labelled positions only) and their sum's
    backward; returns the log-probs in the order of ``index``."""
    r, c, _, _ = packed["index"]
    inputs = {k: packed[k].to(device) for k in ("input_ids", "position_ids")}
    if "attention_mask" in packed:
        inputs["attention_mask"] = packed["attention_mask"].to(device)
    hidden = model.base_model.model.model(**inputs).last_hidden_state
    logits = model.base_model.model.lm_head(hidden[r.to(device), (c - 1).to(device)]).float()
    logps = torch.log_softmax(logits, -1).gather(-1, packed["input_ids"][r, c].to(device)[:, None]).squeeze(-1)
    logps.sum().backward()
    return logps.detach().cpu()


def peak_bytes(fn, device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    import json
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the CPU timeline has no successor API yet
        path = Path(folder) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return max((sum(s) for s in sizes), default=0)


def measure(model, ids, mask, completion_length, shared, repeats, device):
    packed = packed_call(ids, mask, completion_length, shared)
    run = lambda: (model.zero_grad(set_to_none=True), forward_backward(model, packed, device))[1]  # noqa: E731
    logps = run()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = clock(device)
        run()
        seconds.append(clock(device) - start)
    return {
        "seconds": statistics.median(seconds),
        "peak_bytes": peak_bytes(run, device),
        "positions": int(packed["input_ids"].numel()),
        "logps": logps,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lengths", nargs="+", type=int, default=[32, 128, 512, 1024])
    parser.add_argument("--completion-lengths", nargs="+", type=int, default=[16, 128, 512])
    parser.add_argument("--kept", nargs="+", type=int, default=[1, 2, 4, 8], help="kept completions of the group")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=result_path("bench_prefix"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    device = torch.device(args.device)
    kind, fields = CONFIGS["smollm2-135m"]
    CONFIGS["smollm2-2layers"] = (kind, {**fields, "num_hidden_layers": 2, "vocab_size": 2048})
    model = build_model("smollm2-2layers", "sdpa", torch.float32, device, seed=0)
    from dppo_trl.core.prefix import attention_pair_cost, sharing_pays

    pair_cost = attention_pair_cost(model.config)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for prompt_length in args.prompt_lengths:
        for completion_length in args.completion_lengths:
            for kept in args.kept:
                ids, mask = group_batch(prompt_length, completion_length, kept, 2048, generator)
                shared = measure(model, ids, mask, completion_length, True, args.repeats, device)
                repeated = measure(model, ids, mask, completion_length, False, args.repeats, device)
                rows.append({
                    "prompt_length": prompt_length,
                    "completion_length": completion_length,
                    "kept": kept,
                    "positions_ratio": shared["positions"] / repeated["positions"],
                    "time_ratio": shared["seconds"] / repeated["seconds"],
                    "memory_ratio": shared["peak_bytes"] / max(repeated["peak_bytes"], 1),
                    "shared_seconds": shared["seconds"],
                    "repeated_seconds": repeated["seconds"],
                    "shared_peak_mb": shared["peak_bytes"] / 2**20,
                    "repeated_peak_mb": repeated["peak_bytes"] / 2**20,
                    "max_logp_difference": float((shared["logps"] - repeated["logps"]).abs().max()),
                    "shared_by_default": sharing_pays([prompt_length + completion_length] * kept, prompt_length,
                                                      pair_cost),
                })
                print(text_table(rows[-1:], COLUMNS), flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    settings.update(model="smollm2-135m shapes, 2 layers, vocab 2048, LoRA r16", attention="sdpa", device=str(device),
                    pair_cost=pair_cost)
    write_json(args.json, {"settings": settings, "elapsed_s": time.perf_counter() - started, "results": rows})
    print(text_table(rows, COLUMNS))


if __name__ == "__main__":
    main()
