"""Run by tests/test_multiprocess.py under `torchrun --nproc_per_node 2`: trains DPPO on the offline tiny model
and writes, per rank, the global keep masks it drew and a fingerprint of its final parameters."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import cpu_config, random_reward  # noqa: E402

from dppo_trl import DPPOTrainer  # noqa: E402
from dppo_trl.toy import addition_dataset, addition_pairs  # noqa: E402


class Worker(DPPOTrainer):
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.__dict__.setdefault("masks", []).append(self.last_global_keep.int().tolist())
            self.__dict__.setdefault("local_kept", []).append(int(out["dppo_keep"].sum()))
        return out


def main(model_dir, out_dir, sampling, rate):
    args = cpu_config(
        Path(out_dir),
        max_steps=4,
        beta=0.05,
        steps_per_generation=2,
        gradient_accumulation_steps=2,
        num_iterations=2,
        completion_keep_rate=float(rate),
        prune_sampling=sampling,
    )
    trainer = Worker(model_dir, random_reward, args=args, train_dataset=addition_dataset(addition_pairs()[0][:64]))
    trainer.train()
    params = [p.detach().double() for p in trainer.model.parameters()]
    rank = trainer.accelerator.process_index
    record = {
        "world": trainer.accelerator.num_processes,
        "masks": trainer.masks,
        "local_kept": trainer.local_kept,
        "fingerprint": [float(sum(p.sum() for p in params)), float(sum((p * p).sum() for p in params))],
        "finite": all(bool(p.isfinite().all()) for p in params),
    }
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:])
