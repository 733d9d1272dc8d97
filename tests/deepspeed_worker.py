"""Run by tests/test_deepspeed.py under `torchrun --nproc_per_node 2` (CPU, gloo, DS_ACCELERATOR=cpu): trains DPPO
on the offline tiny model once per RUN, one after the other in the same two processes, and writes per rank and run
the global keep masks, the rows each rank kept, the logged metrics, the number of forward calls of the policy and
the reference model, how the run was wrapped and sharded, and the final parameters (whole, gathered under ZeRO-3).

    deepspeed_worker.py MODEL_DIR OUT_DIR RUN [RUN ...]      RUN: ddp | zero2 | zero3 | ddp-empty | zero3-empty

DDP runs must come first: accelerate decides DeepSpeed from the environment (ACCELERATE_USE_DEEPSPEED, set by the first
TrainingArguments with `deepspeed=`), never back. Between runs accelerate's state is reset; the torch.distributed
process group stays. Each run starts from the same seed, model files and data, so one run does not feed the next
(measured: zero2 and zero3 run alone in a fresh torchrun end bitwise equal to their runs in the sequence); one
torchrun for all of them saves the ~10 s of imports and start-up each would cost.

Every run trains with plain SGD (the Trainer's `optim="sgd"`, handed to DeepSpeed as a client optimizer): a
parameter's move is lr times its gradient, so parameters that agree say the gradients agree (AdamW would divide
out a wrong gradient scale and amplify rounding noise where a gradient is ~0)."""

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from support.configs import cpu_config  # noqa: E402
from support.models import addition_prompts  # noqa: E402
from support.processes import full_parameters, leave_without_destructors  # noqa: E402
from support.recording import recording  # noqa: E402
from support.rewards import random_reward  # noqa: E402

# run name: (ZeRO stage or None for DDP, prune_sampling, completion_keep_rate). *-empty: topk keeps 1 row of the 32
# in a generation batch, so one rank has nothing to train on (under ZeRO-3 it must still join every parameter
# gather).
RUNS = {
    "ddp": (None, "systematic", 0.5),
    "zero2": (2, "systematic", 0.5),
    "zero3": (3, "systematic", 0.5),
    "ddp-empty": (None, "topk", 0.03),
    "zero3-empty": (3, "topk", 0.03),
}


def deepspeed_config(stage):
    """A ZeRO config as TRL's zero2/zero3 accelerate configs (no offload; under ZeRO-3 transformers loads the models
    in `zero.Init`) but fp32, the rest from the TrainingArguments ("auto"). ZeRO-3 with persistence threshold 0:
    every parameter of the policy is released after use and gathered again in every forward (DeepSpeed's default,
    1e5 elements, keeps smaller parameters gathered once fetched, which here would be all of them), so that every
    forward call is a collective. No "train_batch_size": with
    `use_cpu=True` accelerate starts torch.distributed itself, not DeepSpeed's comm, so when the first DeepSpeed
    object of a process is ZeRO-3's `zero.Init` (at model loading) DeepSpeed counts a world of 1 and rejects the
    Trainer's "auto" value (32 != 8 * 2 * 1); left out, DeepSpeed derives it."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }


# DPPOTrainer recording each training batch's global keep mask (``masks``) and this rank's kept rows (``local_kept``)
Worker = recording(record_masks=True)


def count_forward_calls(trainer) -> dict:
    """Counts of forward calls (generation and log-prob calls alike) of the policy and the reference model,
    updated in place as training runs."""
    counts = {"policy": 0, "ref": 0}

    def hook(name):
        def pre_hook(module, args, kwargs):
            counts[name] += 1

        return pre_hook

    trainer.model.register_forward_pre_hook(hook("policy"), with_kwargs=True)
    if trainer.ref_model is not None:
        trainer.ref_model.register_forward_pre_hook(hook("ref"), with_kwargs=True)
    return counts


def sharding(model) -> dict:
    """Elements of ``model``'s parameters held on this rank and in all, as ZeRO-3 partitions them (``ds_tensor``
    the local shard, ``ds_numel`` the whole), and how many parameters stay gathered once fetched (``ds_persist``);
    ``None`` where the parameters are not ZeRO-3 parameters."""
    params = list(model.parameters())
    if not all(hasattr(p, "ds_tensor") for p in params):
        return None
    return {
        "local": sum(p.ds_tensor.numel() for p in params),
        "whole": sum(p.ds_numel for p in params),
        "persistent": sum(bool(p.ds_persist) for p in params),
    }


def train(model_dir, out_dir, run):
    """One DPPO run of 2 optimizer steps (one generation batch, num_iterations 2, GA 2, beta > 0: deferred
    old-policy and reference passes); returns this rank's record and its final parameters."""
    stage, sampling, rate = RUNS[run]
    extra = {} if stage is None else {"deepspeed": deepspeed_config(stage)}
    args = cpu_config(Path(out_dir, run), max_steps=2, beta=0.05, steps_per_generation=2,
                      gradient_accumulation_steps=2, num_iterations=2, completion_keep_rate=rate,
                      prune_sampling=sampling, optim="sgd", learning_rate=0.1,
                      speed_check=False,  # refused under ZeRO: DDP's reference run makes the same calls without it
                      **extra)
    dataset = addition_prompts(64)
    trainer = Worker(model_dir, random_reward, args=args, train_dataset=dataset)
    calls = count_forward_calls(trainer)
    trainer.train()
    engine = trainer.model_wrapped
    record = {
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapped": type(engine).__name__,
        "zero_stage": engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None,
        "sharding": {"policy": sharding(trainer.model), "ref": sharding(trainer.ref_model)},
        "masks": trainer.masks,
        "local_kept": trainer.local_kept,
        "forward_calls": calls,
        "logs": [h for h in trainer.state.log_history if "loss" in h],
    }
    return record, full_parameters(trainer.model)


def skip_shm_comm_build():
    """DeepSpeed's torch comm backend JIT-compiles its shared-memory all-reduce (``deepspeed_shm_comm``, about 2 min
    on 2 cores the first time, then cached under ~/.cache/torch_extensions) when it starts on the CPU accelerator.
    That kernel serves only ``inference_all_reduce`` (tensor-parallel inference), never training, which reduces
    through torch.distributed (gloo): the build is skipped so that a fresh machine needs no compiler and no build."""
    import importlib

    # by module name: the attribute deepspeed.comm.torch is torch itself (deepspeed.comm star-imports it)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def main(model_dir, out_dir, *runs):
    from accelerate.state import AcceleratorState

    skip_shm_comm_build()
    records = {}
    for run in runs:
        records[run], params = train(model_dir, out_dir, run)
        rank = int(os.environ["RANK"])
        torch.save(params, Path(out_dir, f"{run}-params{rank}.pt"))
        AcceleratorState._reset_state()  # the next run's Accelerator reads its own DeepSpeed plugin
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(records))
    leave_without_destructors()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:])
