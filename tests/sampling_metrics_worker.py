"""Run by tests/test_sampling_metrics_two_ranks.py under `torchrun --nproc_per_node 2`: one generation batch of
GRPOTrainer or of DPPOTrainer (every row kept, rows moved between ranks to balance their tokens: prompts of
uneven lengths), both with the
simulated vLLM sampler of tests/test_vllm_path.py; rank 0 writes the logged history to OUT_DIR/log.json.

    sampling_metrics_worker.py MODEL_DIR OUT_DIR grpo|dppo"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_vllm_path import SimDPPO, SimGRPO, run  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from conftest import random_reward  # noqa: E402
from dppo_trl import DPPOConfig  # noqa: E402


def uneven_prompts():
    """Prompts of 3 to 40 characters, so the two ranks' token loads differ and rank balancing moves rows."""
    from datasets import Dataset

    lengths = [3 + (7919 * i) % 38 for i in range(64)]
    return Dataset.from_dict({"prompt": ["7" * (n - 2) + "+=" for n in lengths]})


def main(model_dir: str, out_dir: str, name: str) -> None:
    if name == "grpo":
        cls, args = SimGRPO, run(SimGRPO, GRPOConfig, Path(out_dir), "token_truncate", max_steps=1)
    else:
        cls = SimDPPO
        cls.RANK_BALANCE_TOLERANCE = 0.0  # move rows wherever a move evens the ranks' tokens
        args = run(cls, DPPOConfig, Path(out_dir), "token_truncate", max_steps=1, completion_keep_rate=1.0)
    trainer = cls(model_dir, random_reward, args=args, train_dataset=uneven_prompts())
    trainer.use_vllm = True
    trainer.train()
    if trainer.accelerator.is_main_process:
        Path(out_dir, "log.json").write_text(json.dumps(trainer.state.log_history))
    # As tests/multiprocess_worker.py: leave without destructors (gloo's exit race, pytorch/pytorch#56297).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:])
