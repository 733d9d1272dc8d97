"""The golden runs: a fixed set of short DPPO runs on the offline tiny model, float64 end to end, whose keep
masks, weights, micro-batch plans, logged values and final parameters must be reproduced by every later version:
decisions exactly, numbers to float64 rounding (float32 kernels and reductions round differently on different
CPUs; float64 leaves 7 orders of magnitude of room). Float64 end to end includes TRL's rewards and their
statistics, which TRL computes in the default dtype (float32 differed by an ulp across CPUs): ``run`` sets it to
float64. Recorded before the restructuring (issue 29); recorded again at issue 41, when the runs became float64
end to end (rewards, the deferred log-probs) and the entropy filter exact under pruning: every other run's
decisions were the earlier record's; its numbers moved by float32 rounding only (parameters by at most 2e-6
relative; values near 0, such as the first step's KL, by more).

Record (only on purpose, when behaviour is meant to change): ``cd tests && python -m support.golden record``."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

GOLDEN_FILE = Path(__file__).parent.parent / "golden" / "dppo_runs.json"

# One entry per run: DPPOConfig overrides on top of BASE. Every sampling design, prompt pruning, packing on and
# off, GA < spg, beta 0 and > 0, the entropy filter and bonus, the audit.
BASE = dict(max_steps=4, steps_per_generation=2, gradient_accumulation_steps=1, completion_keep_rate=0.5)
RUNS = {
    "systematic_packed_dapo": dict(prune_sampling="systematic", packing=True),
    "poisson_padded_grpo_beta": dict(prune_sampling="poisson", packing=False, loss_type="grpo", beta=0.05),
    "stratified_packed_audit": dict(prune_sampling="stratified", packing=True, audit_every=1),
    "balanced_packed_bnpo_beta": dict(prune_sampling="balanced", packing=True, loss_type="bnpo", beta=0.05),
    "topk_padded": dict(prune_sampling="topk", packing=False, gradient_accumulation_steps=2),
    "zero_variance_packed": dict(prune_sampling="zero_variance", packing=True, reward="coarse"),
    "prompt_pruning_packed": dict(prune_sampling="systematic", packing=True, prompt_keep_rate=0.5, max_steps=10,
                                  prompts=4, prompt_score="ema"),
    "entropy_filter_bonus": dict(prune_sampling="stratified", packing=True, top_entropy_quantile=0.5,
                                 entropy_coef=0.01, loss_type="dr_grpo"),
    "packing_only_sequence_is": dict(completion_keep_rate=1.0, packing=True, importance_sampling_level="sequence",
                                     num_iterations=2),
}

# The CPU settings every run shares (frozen here: a change to the tests' own presets must not move the golden file).
# prefix_sharing=False: the records predate prefix sharing, whose micro-batch plan keeps a group's rows together
# (its equality with repeated rows: tests/test_prefix_sharing.py).
FIXED = dict(bf16=False, use_cpu=True, per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
             learning_rate=1e-3, gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[],
             seed=0, temperature=1.0, dataloader_num_workers=0, prefix_sharing=False)


def random_reward(completions, **kwargs):
    return [float((sum(map(ord, c)) * 7919) % 5) for c in completions]


def coarse_reward(completions, **kwargs):
    return [float(len(c) > 3) for c in completions]


_TIMING = ("runtime", "per_second", "seconds", "profiling", "time", "generation_share")
# Metrics added after the record (what they measure is tested where they are defined).
_NEWER = ("dppo/prefix_tokens_saved",)


def _values(tensor: torch.Tensor) -> list:
    return tensor.detach().cpu().tolist()


def _sketch(tensor: torch.Tensor) -> list[float]:
    """A tensor's fingerprint that float64 rounding moves only slightly: its sum and a fixed weighted sum."""
    flat = tensor.detach().cpu().double().flatten()
    weights = torch.cos(torch.arange(flat.numel(), dtype=torch.float64))
    return [float(flat.sum()), float(flat @ weights)]


def float64_model() -> dict:
    """DPPOConfig overrides that load the model in float64 and keep TRL's LM head in it (fresh: TRL edits them)."""
    return dict(cast_lm_head_to_fp32=False, model_init_kwargs={"dtype": torch.float64})


def _recording_trainer():
    from dppo_trl import DPPOTrainer

    class GoldenTrainer(DPPOTrainer):
        """Records each generation batch's decision and each micro-batch the loss receives."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if self.model.training and "dppo_keep" in out:
                self.__dict__.setdefault("golden_batches", []).append(
                    {
                        "global_keep": _values(self.last_global_keep.int()),
                        "keep": _values(out["dppo_keep"].int()),
                        "weight": _values(out["dppo_weight"].double()),
                        "advantages": _values(out["advantages"].double()),
                    }
                )
            return out

        def _prepare_inputs(self, generation_batch):
            micro = super()._prepare_inputs(generation_batch)
            if self.model.training:
                self.__dict__.setdefault("golden_microbatches", []).append(
                    {
                        "completion_ids": _values(micro["completion_ids"]),
                        "completion_mask": _values(micro["completion_mask"]),
                        "weight": _values(micro["dppo_weight"].double()) if "dppo_weight" in micro else None,
                        "old_logps": _sketch(micro["old_per_token_logps"])
                        if micro.get("old_per_token_logps") is not None else None,
                    }
                )
            return micro

    return GoldenTrainer


def run(name: str, model_dir: str, workdir: Path) -> dict:
    """One golden run's record: decisions, micro-batches, logged values (no timings), parameter sketches. The
    caller has put the float64 kernels in place (``support.exact.use_float64_kernels``)."""
    from dppo_trl import DPPOConfig
    from dppo_trl.tasks.toy import addition_dataset, addition_pairs

    settings = {**FIXED, **BASE, **RUNS[name]}
    reward = coarse_reward if settings.pop("reward", None) == "coarse" else random_reward
    dataset = addition_dataset(addition_pairs(seed=0)[0][: settings.pop("prompts", 64)])
    args = DPPOConfig(output_dir=str(workdir / name), **settings, **float64_model())
    trainer = _recording_trainer()(model_dir, reward, args=args, train_dataset=dataset)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # TRL's rewards and their statistics too (float32 differs across CPUs)
    try:
        trainer.train()
    finally:
        torch.set_default_dtype(default_dtype)
    logs = [{k: v for k, v in entry.items() if not any(t in k for t in _TIMING) and k not in _NEWER}
            for entry in trainer.state.log_history]
    return {
        "batches": trainer.__dict__.get("golden_batches", []),
        "microbatches": trainer.__dict__.get("golden_microbatches", []),
        "logs": logs,
        "parameters": {n: _sketch(p) for n, p in trainer.model.named_parameters()},
    }


OLD_CHECKPOINT = GOLDEN_FILE.parent / "old_checkpoint"
# Runs with each kind of DPPO state (prompt pruning's sampler; the audit's records), checkpointed at step 4.
CHECKPOINTED = {
    "prompt_pruning": dict(prune_sampling="systematic", packing=True, prompt_keep_rate=0.5, prompts=4,
                           prompt_score="ema"),
    "audit": dict(prune_sampling="stratified", packing=True, audit_every=1, prompts=64),
}
_OLD_FILES = {"prompt_pruning": "dppo_prompt_sampler.json", "audit": "dppo_audit.pt"}


def checkpointed_trainer(kind: str, model_dir: str, output_dir: Path, **overrides):
    """The trainer of a checkpointed run (``CHECKPOINTED[kind]``, 8 steps, a checkpoint every 4), not trained."""
    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.tasks.toy import addition_dataset, addition_pairs

    settings = {**FIXED, **BASE, "max_steps": 8, "save_strategy": "steps", "save_steps": 4, **CHECKPOINTED[kind],
                **overrides}
    dataset = addition_dataset(addition_pairs(seed=0)[0][: settings.pop("prompts")])
    args = DPPOConfig(output_dir=str(output_dir), **settings, **float64_model())
    return DPPOTrainer(model_dir, random_reward, args=args, train_dataset=dataset)


def record_old_checkpoint(model_dir: str, workdir: Path) -> None:
    """DPPO's checkpoint files as the code before issue 29 wrote them (two files), for the resume test."""
    import shutil

    OLD_CHECKPOINT.mkdir(parents=True, exist_ok=True)
    for kind, name in _OLD_FILES.items():
        checkpointed_trainer(kind, model_dir, workdir / kind).train()
        shutil.copy(workdir / kind / "checkpoint-4" / name, OLD_CHECKPOINT / name)


def tiny_model(workdir: Path) -> str:
    from dppo_trl.tasks.toy import save_tiny_model

    return str(save_tiny_model(workdir / "tiny-model", hidden_size=32, num_layers=2))


def load() -> dict:
    return json.loads(GOLDEN_FILE.read_text())


def record() -> None:
    from support.exact import use_float64_kernels

    use_float64_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model_dir = tiny_model(workdir)
        records = {name: run(name, model_dir, workdir) for name in RUNS}
        if "--old-checkpoint" in sys.argv:
            record_old_checkpoint(model_dir, workdir)
    GOLDEN_FILE.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN_FILE.write_text(json.dumps(records, indent=None, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] != ["record"]:
        sys.exit("usage: cd tests && python -m support.golden record [--old-checkpoint]")
    record()
