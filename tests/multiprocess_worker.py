"""Run by tests/test_multiprocess.py under `torchrun --nproc_per_node 2`: trains DPPO on the offline tiny model
and writes, per rank, the global keep masks it drew, the rank-balance metrics, the prompts it generated for,
every forward call of its models, and its final parameters (whole, also when sharded).

    multiprocess_worker.py MODEL_DIR OUT_DIR SAMPLING RATE MAX_STEPS [TOLERANCE] [--prompt-keep-rate R --stop S]
                           [--steps-per-generation N] [--fsdp] [--perturb-rank R] [--beta B]
                           [--no-prefix-sharing] [--reference-passes] [--float64]

TOLERANCE is DPPOTrainer.RANK_BALANCE_TOLERANCE ('inf': never move rows). With --stop S the run saves a
checkpoint at step S and stops, and a second trainer resumes from it to MAX_STEPS. With --perturb-rank R, rank
R's scores are moved up by one ulp before each keep decision and before they enter its prompt history (as on a
rank whose math library rounds differently). With --fsdp the policy and the reference model are sharded with
FSDP2 (`fully_shard`) instead of the policy being wrapped in DDP. --beta B: the KL coefficient (default 0.05).
--audit-sketch K: the gradient audit on every generation batch through a K-direction sketch (no clipping), each
audit's two reduced sketches and the optimizer's gradient at every step saved per rank (audit{rank}.pt).
--reference-passes: each training batch's rows and reference log-probs kept, and after training compared with
TRL's padded pass over the rank's batch, and with that pass one column wider (``reference_pass_errors``).
--float64: the models and TRL's log-prob kernel in float64 (``support.exact``).
Every run records, per training batch, the kept rows that another rank generated (``foreign_kept``).

Every forward call of the policy and reference models is recorded (a forward pre-hook): which model, whether it
is a log-prob call (``labels`` or ``shift_labels`` among its kwargs; generation calls have neither), whether
grad is on, the generation batch it belongs to, and ``input_ids.numel()``."""

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from support.configs import cpu_config, float64_settings  # noqa: E402
from support.exact import use_float64_kernels  # noqa: E402
from support.models import addition_prompts  # noqa: E402
from support.processes import full_parameters, leave_without_destructors  # noqa: E402
from support.recording import OptimizerGradients, Recorder, append, wrap  # noqa: E402
from support.rewards import random_reward  # noqa: E402
from support.training import StopAt  # noqa: E402

from dppo_trl import DPPOTrainer  # noqa: E402


PASS_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "dppo_keep", "ref_per_token_logps")


class Worker(Recorder, DPPOTrainer):
    # each training batch's global keep mask and local kept rows, its prompts, the audits, the prompt decisions
    record_masks = record_prompts = record_audits = record_prompt_decisions = True
    perturb_rank = None  # --perturb-rank R: rank R's scores moved by one ulp before its keep decision
    record_reference_passes = False  # --reference-passes: each training batch's rows and reference log-probs

    def _generate_and_score_completions(self, inputs):
        self.generation_index = getattr(self, "generation_index", -1) + 1
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            # the padded width of the batch the passes of this generation batch run on (after rank balancing)
            width = out["prompt_ids"].size(1) + out["completion_ids"].size(1)
            append(self, "widths", [self.generation_index, width])
            lengths = out["prompt_mask"].sum(1) + out["completion_mask"].sum(1)
            append(self, "local_kept_tokens", int(lengths[out["dppo_keep"]].sum()))
            # kept rows here that another rank generated (moved by the rank balancing)
            origin = out["dppo_origin_rank"][out["dppo_keep"]]
            append(self, "foreign_kept", int((origin != self.accelerator.process_index).sum()))
            if self.record_reference_passes:
                append(self, "reference_passes", {k: out[k].detach().clone() for k in PASS_KEYS})
        return out

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wrap(self.keep_decision, "decide", self._record_own_decision)
        wrap(self.keep_decision, "draw", self._record_draw)
        wrap(self.prompt_cutter, "decide", self._record_own_cut)
        wrap(self.prompt_cutter, "take_decision", self._perturbed_prompt_decision)

    def _record_own_decision(self, decide, scores, batch):
        decision = decide(scores, batch)
        append(self, "own_masks", decision[0].any(0).int().tolist())  # before the broadcast (rows some iteration keeps)
        return decision

    def _record_own_cut(self, decide, keys, probe, candidates_per_rank):
        cut = decide(keys, probe, candidates_per_rank)
        append(self, "own_q", cut.pi.tolist())  # this rank's own acceptance probabilities, before the broadcast
        return cut

    def _perturbed_prompt_decision(self, take_decision, scores, batch):
        if self.perturb_rank == self.accelerator.process_index:  # the history this rank keeps, one ulp off
            scores = torch.nextafter(scores, torch.full_like(scores, float("inf")))
        append(self, "generated_groups", int(batch.cut.local(self.accelerator.process_index).sum()))
        return take_decision(scores, batch)

    def _record_draw(self, draw, output, batch, advantages):
        if self.perturb_rank == self.accelerator.process_index:  # one ulp up: zeros become tiny positive scores
            advantages = torch.nextafter(advantages, torch.full_like(advantages, float("inf")))
        if "first_draw" not in self.__dict__:  # this rank's part of the first generation batch, for the oracle
            self.first_draw = {
                "advantages": advantages.tolist(),  # already gathered: the whole batch
                "completion_lengths": output["completion_mask"].sum(1).tolist(),
                "prompt_lengths": output["prompt_mask"].sum(1).tolist(),
            }
        draw(output, batch, advantages)
        append(self, "iteration_masks", (batch.iteration_weights > 0).int().tolist())  # each iteration's own draw


def record_forward_calls(trainer, calls, run):
    """Append ``[model, kind, grad, (run, generation batch), input_ids.numel()]`` to ``calls`` for every forward
    call of ``trainer``'s policy and reference models."""

    def hook(name):
        def pre_hook(module, args, kwargs):
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            kind = "logps" if "labels" in kwargs or "shift_labels" in kwargs else "generate"
            batch = [run, getattr(trainer, "generation_index", -1)]
            calls.append([name, kind, torch.is_grad_enabled(), batch, int(ids.numel())])

        return pre_hook

    trainer.model.register_forward_pre_hook(hook("policy"), with_kwargs=True)
    if trainer.ref_model is not None:
        trainer.ref_model.register_forward_pre_hook(hook("ref"), with_kwargs=True)


def forward_passes(calls) -> list:
    """The recorded calls as runs of one kind ``[model, kind, grad, (run, generation batch), number of calls]``:
    a generation, a deferred log-prob pass, the micro-batch forwards of training."""
    return [[*key, len(list(group))] for key, group in itertools.groupby(calls, key=lambda call: call[:4])]


@torch.no_grad()
def reference_pass_errors(trainer, passes) -> dict:
    """The reference log-probs DPPO's deferred passes gave this rank's kept rows of each training batch
    (``passes``) against TRL's padded pass over the rank's whole batch: per batch, the largest difference over the
    kept rows' completion tokens (``padded``); and, to show what this can tell, the same for TRL's pass one column
    wider, as a row moved to a rank of wider rows is padded (``wider``). Each is replayed in the run's order from
    the reference model's first state: a dynamic rotary keeps the longest position it has seen (transformers'
    ``dynamic_rope_update``) until a call shorter than its original context (here, of one position) resets it."""
    from trl import GRPOTrainer

    model, errors = trainer.ref_model, {}
    for name, extra in (("padded", 0), ("wider", 1)):
        model(input_ids=passes[0]["prompt_ids"][:1, :1])  # the rotary's first state
        errors[name] = []
        for batch in passes:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            pad = torch.full_like(ids[:, :extra], trainer.processing_class.pad_token_id)
            ids, mask = torch.cat([pad, ids], 1), torch.cat([torch.zeros_like(pad), mask], 1)
            width, kept = batch["completion_ids"].size(1), batch["dppo_keep"]
            logps = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, model, ids, mask, width, batch_size=trainer.args.per_device_train_batch_size)[0]
            difference = (logps - batch["ref_per_token_logps"])[kept][batch["completion_mask"][kept].bool()]
            errors[name].append(float(difference.abs().max()) if difference.numel() else 0.0)
    return errors


def fsdp_units(model) -> list[str]:
    """The modules that are FSDP2 units (``fully_shard`` applied), by name ('' for the root)."""
    from torch.distributed.fsdp import FSDPModule

    return [name for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def main(argv):
    parser = argparse.ArgumentParser()
    for name in ("model_dir", "out_dir", "sampling", "rate"):
        parser.add_argument(name)
    parser.add_argument("max_steps", type=int)
    parser.add_argument("tolerance", type=float, nargs="?", default=DPPOTrainer.RANK_BALANCE_TOLERANCE)
    parser.add_argument("--prompt-keep-rate", type=float, default=1.0)
    parser.add_argument("--prompt-score", default="probe")
    parser.add_argument("--stop", type=int, default=None)
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--perturb-rank", type=int, default=None)
    parser.add_argument("--beta", type=float, default=0.05)
    parser.add_argument("--audit-sketch", type=int, default=None)
    parser.add_argument("--no-prefix-sharing", action="store_true")
    parser.add_argument("--top-entropy-quantile", type=float, default=1.0)
    parser.add_argument("--no-speed-check", action="store_true")
    parser.add_argument("--reference-passes", action="store_true")
    parser.add_argument("--float64", action="store_true")
    a = parser.parse_args(argv)
    if a.float64:
        use_float64_kernels()
    Worker.perturb_rank = a.perturb_rank
    Worker.record_reference_passes = a.reference_passes
    Worker.RANK_BALANCE_TOLERANCE = a.tolerance
    sharding = {}
    if a.fsdp:
        # FSDP2 on CPU: accelerate's FSDP plugin (TrainingArguments fsdp/fsdp_config, or ACCELERATE_USE_FSDP=true)
        # is silently dropped on CPU (AcceleratorState turns on DistributedType.FSDP only from the multi-GPU/XPU/
        # NPU/... types, never from MULTI_CPU) and the run trains under DDP. transformers' own FSDP2 does run here:
        # TRL loads the policy and the reference with `distributed_config`, which applies `fully_shard` to the
        # embeddings (with the tied head), every decoder layer, the final norm and the root, on a CPU/gloo mesh,
        # and the Trainer then takes its path for models sharded at load time: no DDP on top, gradient reduction
        # (reduce-scatter) deferred to the last micro-batch of each accumulation window.
        from transformers.distributed import DistributedConfig

        sharding = {"model_init_kwargs": {"distributed_config": DistributedConfig(fsdp_size=2)}}
    args = cpu_config(
        Path(a.out_dir),
        max_steps=a.max_steps,
        beta=a.beta,
        steps_per_generation=a.steps_per_generation,
        gradient_accumulation_steps=2,
        num_iterations=2,
        completion_keep_rate=float(a.rate),
        prune_sampling=a.sampling,
        prompt_keep_rate=a.prompt_keep_rate,
        prompt_score=a.prompt_score,
        prefix_sharing=False if a.no_prefix_sharing else None,
        top_entropy_quantile=a.top_entropy_quantile,
        speed_check=not a.no_speed_check,
        **sharding,
        **(float64_settings() if a.float64 else {}),
        **({} if a.audit_sketch is None else
           dict(audit_every=1, audit_sketch_dim=a.audit_sketch, audit_exact_params=0, max_grad_norm=0.0)),
    )
    # A history score needs revisits (16 prompts); the probe resumes within one epoch (after a resume in a later
    # epoch the data order is TRL's, which differs from an uninterrupted run for GRPO too).
    dataset = addition_prompts(16 if a.prompt_keep_rate < 1 and a.prompt_score != "probe" else 64)
    calls = []
    if a.stop is None:
        gradients = OptimizerGradients()
        trainer = Worker(a.model_dir, random_reward, args=args, train_dataset=dataset, callbacks=[gradients])
        gradients.model = trainer.model
        record_forward_calls(trainer, calls, 0)
        trainer.train()
        trainers = [trainer]
    else:
        first = Worker(a.model_dir, random_reward, args=args, train_dataset=dataset, callbacks=[StopAt(a.stop)])
        record_forward_calls(first, calls, 0)
        first.train()
        second = Worker(a.model_dir, random_reward, args=args, train_dataset=dataset)
        record_forward_calls(second, calls, 1)
        second.train(resume_from_checkpoint=str(Path(args.output_dir) / f"checkpoint-{a.stop}"))
        trainers = [first, second]
    trainer = trainers[-1]
    rank = trainer.accelerator.process_index
    params = full_parameters(trainer.model)
    torch.save(params, Path(a.out_dir, f"params{rank}.pt"))
    logs = [h for t in trainers for h in t.state.log_history if "dppo/rank_imbalance" in h]
    calls = list(calls)  # the run's calls, not the reference passes' below
    passes = [p for t in trainers for p in t.__dict__.get("reference_passes", [])]
    record = {
        "world": trainer.accelerator.num_processes,
        "steps": trainer.state.global_step,
        "masks": [m for t in trainers for m in t.masks],
        "own_masks": [m for t in trainers for m in t.own_masks],
        "iteration_masks": [m for t in trainers for m in t.iteration_masks],
        "prompt_decisions": [
            [w.tolist(), None if n is None else float(n), cut.accepted.tolist()] for t in trainers
            for w, n, cut in t.__dict__.get("prompt_decisions", [])
        ],
        "generated_groups": [g for t in trainers for g in t.__dict__.get("generated_groups", [])],
        "own_q": [q for t in trainers for q in t.__dict__.get("own_q", [])],
        "local_kept": [k for t in trainers for k in t.local_kept],
        "local_kept_tokens": [k for t in trainers for k in t.local_kept_tokens],
        "foreign_kept": [k for t in trainers for k in t.foreign_kept],
        "packing": trainer.args.packing,
        "reference_pass_errors": reference_pass_errors(trainer, passes) if passes else None,
        "prompts": [p for t in trainers for p in t.prompts_seen],
        "rank_imbalance": [h["dppo/rank_imbalance"] for h in logs],
        "rank_imbalance_before": [h["dppo/rank_imbalance_before"] for h in logs],
        "finite": all(bool(p.isfinite().all()) for p in params.values()),
        "first_draw": trainers[0].first_draw,
        "first_log": next(h for h in trainers[0].state.log_history if "dppo/kept_fraction" in h),
        "widths": [[[run, k], w] for run, t in enumerate(trainers) for k, w in t.widths],
        "forward_calls": calls,
        "forward_passes": forward_passes(calls),
        "speed_check_at": trainers[-1].audit_ledger.records["speed_check_at"],
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "beta": args.beta,
        "wrapped": type(trainer.model_wrapped).__name__,
        "fsdp_units": {
            name: fsdp_units(model) for name, model in (("policy", trainer.model), ("ref", trainer.ref_model)) if model
        },
    }
    Path(a.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if a.audit_sketch is not None:
        torch.save({"audits": trainer.audits, "steps": gradients.steps, "sketch": trainer._audit_sketch},
                   Path(a.out_dir, f"audit{rank}.pt"))
    leave_without_destructors()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1:])
