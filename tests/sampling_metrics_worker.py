"""Run by tests/test_sampling_metrics_two_ranks.py under `torchrun --nproc_per_node 2`: one generation batch of
GRPOTrainer or of DPPOTrainer (every row kept, rows moved between ranks to balance their tokens: prompts of
uneven lengths), both with the simulated vLLM sampler of tests/support/sampler.py, `bnpo` with the entropy bonus
(TRL's per-micro-batch token counts), in float64. Rank 0 writes the logged history to OUT_DIR/log.json and the
optimizer's gradient to OUT_DIR/grad.pt.

    sampling_metrics_worker.py MODEL_DIR OUT_DIR grpo|dppo"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from support.configs import float64_settings, simulated_vllm_config  # noqa: E402
from support.exact import use_float64_kernels  # noqa: E402
from support.processes import leave_without_destructors  # noqa: E402
from support.recording import OptimizerGradients  # noqa: E402
from support.rewards import random_reward  # noqa: E402
from support.sampler import SimulatedVLLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dppo_trl import DPPOConfig, DPPOTrainer  # noqa: E402


class SimGRPO(SimulatedVLLM, GRPOTrainer):
    pass


class SimDPPO(SimulatedVLLM, DPPOTrainer):
    pass


def uneven_prompts():
    """Prompts of 3 to 40 characters, so the two ranks' token loads differ and rank balancing moves rows."""
    from datasets import Dataset

    lengths = [3 + (7919 * i) % 38 for i in range(64)]
    return Dataset.from_dict({"prompt": ["7" * (n - 2) + "+=" for n in lengths]})


def main(model_dir: str, out_dir: str, name: str) -> None:
    use_float64_kernels()  # float64 end to end, as the `exact_logprobs` fixture (tests/conftest.py) does in-process
    settings = dict(max_steps=1, loss_type="bnpo", entropy_coef=0.1, max_grad_norm=0.0, **float64_settings())
    if name == "grpo":
        cls, args = SimGRPO, simulated_vllm_config(Path(out_dir), "token_truncate", cls=GRPOConfig, **settings)
    else:
        cls = SimDPPO
        cls.RANK_BALANCE_TOLERANCE = 0.0  # move rows wherever a move evens the ranks' tokens
        # Rows repeated (no prefix sharing): with it whole groups move, and none fits the ranks' gap here.
        args = simulated_vllm_config(Path(out_dir), "token_truncate", cls=DPPOConfig, completion_keep_rate=1.0,
                                     prefix_sharing=False, **settings)
    gradients = OptimizerGradients()
    trainer = cls(model_dir, random_reward, args=args, train_dataset=uneven_prompts(), callbacks=[gradients])
    gradients.model = trainer.model
    trainer.train()
    (gradient,) = gradients.flat(missing_as_zeros=False)  # one optimizer step
    torch.save(gradient, Path(out_dir, "grad.pt"))
    if trainer.accelerator.is_main_process:
        Path(out_dir, "log.json").write_text(json.dumps(trainer.state.log_history))
    leave_without_destructors()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:])
