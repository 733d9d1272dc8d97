"""Run by tests/test_multiprocess.py under `torchrun --nproc_per_node 2`: trains DPPO on the offline tiny model
and writes, per rank, the global keep masks it drew, the rank-balance metrics, the prompts it generated for,
and its final parameters.

    multiprocess_worker.py MODEL_DIR OUT_DIR SAMPLING RATE MAX_STEPS [TOLERANCE] [--prompt-keep-rate R --stop S]

TOLERANCE is DPPOTrainer.RANK_BALANCE_TOLERANCE ('inf': never move rows). With --stop S the run saves a
checkpoint at step S and stops, and a second trainer resumes from it to MAX_STEPS."""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from conftest import StopAt, cpu_config, random_reward  # noqa: E402

from dppo_trl import DPPOTrainer  # noqa: E402
from dppo_trl.toy import addition_dataset, addition_pairs  # noqa: E402


class Worker(DPPOTrainer):
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.__dict__.setdefault("masks", []).append(self.last_global_keep.int().tolist())
            self.__dict__.setdefault("local_kept", []).append(int(out["dppo_keep"].sum()))
            self.__dict__.setdefault("prompts", []).append([x["prompt"] for x in inputs])
        return out

    def _draw_keep_mask(self, output, advantages):
        if "first_draw" not in self.__dict__:  # this rank's part of the first generation batch, for the oracle
            self.first_draw = {
                "advantages": advantages.tolist(),  # already gathered: the whole batch
                "completion_lengths": output["completion_mask"].sum(1).tolist(),
                "prompt_lengths": output["prompt_mask"].sum(1).tolist(),
            }
        return super()._draw_keep_mask(output, advantages)


def main(argv):
    parser = argparse.ArgumentParser()
    for name in ("model_dir", "out_dir", "sampling", "rate"):
        parser.add_argument(name)
    parser.add_argument("max_steps", type=int)
    parser.add_argument("tolerance", type=float, nargs="?", default=DPPOTrainer.RANK_BALANCE_TOLERANCE)
    parser.add_argument("--prompt-keep-rate", type=float, default=1.0)
    parser.add_argument("--stop", type=int, default=None)
    a = parser.parse_args(argv)
    Worker.RANK_BALANCE_TOLERANCE = a.tolerance
    args = cpu_config(
        Path(a.out_dir),
        max_steps=a.max_steps,
        beta=0.05,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        completion_keep_rate=float(a.rate),
        prune_sampling=a.sampling,
        prompt_keep_rate=a.prompt_keep_rate,
    )
    dataset = addition_dataset(addition_pairs()[0][: 16 if a.prompt_keep_rate < 1 else 64])
    if a.stop is None:
        trainer = Worker(a.model_dir, random_reward, args=args, train_dataset=dataset)
        trainer.train()
        trainers = [trainer]
    else:
        first = Worker(a.model_dir, random_reward, args=args, train_dataset=dataset, callbacks=[StopAt(a.stop)])
        first.train()
        second = Worker(a.model_dir, random_reward, args=args, train_dataset=dataset)
        second.train(resume_from_checkpoint=str(Path(args.output_dir) / f"checkpoint-{a.stop}"))
        trainers = [first, second]
    trainer = trainers[-1]
    rank = trainer.accelerator.process_index
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    torch.save(params, Path(a.out_dir, f"params{rank}.pt"))
    logs = [h for t in trainers for h in t.state.log_history if "dppo/rank_imbalance" in h]
    record = {
        "world": trainer.accelerator.num_processes,
        "steps": trainer.state.global_step,
        "masks": [m for t in trainers for m in t.masks],
        "local_kept": [k for t in trainers for k in t.local_kept],
        "prompts": [p for t in trainers for p in t.prompts],
        "rank_imbalance": [h["dppo/rank_imbalance"] for h in logs],
        "rank_imbalance_before": [h["dppo/rank_imbalance_before"] for h in logs],
        "finite": all(bool(p.isfinite().all()) for p in params.values()),
        "first_draw": trainers[0].first_draw,
        "first_log": next(h for h in trainers[0].state.log_history if "dppo/kept_fraction" in h),
    }
    Path(a.out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    # Leave without running destructors: freeing DDP's reducer frees its gloo process group, whose destructor
    # joins gloo's worker thread while holding the GIL, and that thread may still need the GIL to free the last
    # gather's tensors. Depending on when that happens, a finished rank hangs or aborts at exit (a torch race:
    # pytorch/pytorch#56297, #179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1:])
