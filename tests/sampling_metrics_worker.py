"""Run by tests/test_sampling_metrics_two_ranks.py under `torchrun --nproc_per_node 2`: one generation batch of
GRPOTrainer or of DPPOTrainer (every row kept, rows moved between ranks to balance their tokens: prompts of
uneven lengths), both with the simulated vLLM sampler of tests/test_vllm_path.py, `bnpo` with the entropy bonus
(TRL's per-micro-batch token counts), in float64. Rank 0 writes the logged history to OUT_DIR/log.json and the
optimizer's gradient to OUT_DIR/grad.pt.

    sampling_metrics_worker.py MODEL_DIR OUT_DIR grpo|dppo"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import trl.trainer.utils  # noqa: E402
from test_vllm_path import SimDPPO, SimGRPO, run  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from conftest import Float64LogProbs, leave_without_destructors, random_reward, rms_norm_in_input_dtype  # noqa: E402
from dppo_trl import DPPOConfig  # noqa: E402


def uneven_prompts():
    """Prompts of 3 to 40 characters, so the two ranks' token loads differ and rank balancing moves rows."""
    from datasets import Dataset

    lengths = [3 + (7919 * i) % 38 for i in range(64)]
    return Dataset.from_dict({"prompt": ["7" * (n - 2) + "+=" for n in lengths]})


class SaveGradient(TrainerCallback):
    def __init__(self, path):
        self.path, self.model = path, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        torch.save(torch.cat([p.grad.flatten() for p in self.model.parameters() if p.requires_grad]), self.path)


def main(model_dir: str, out_dir: str, name: str) -> None:
    # float64 end to end, as the `exact_logprobs` fixture (tests/conftest.py) does in-process
    trl.trainer.utils._ChunkedLogProbFunction = Float64LogProbs
    modeling_qwen2.Qwen2RMSNorm.forward = rms_norm_in_input_dtype
    settings = dict(max_steps=1, loss_type="bnpo", entropy_coef=0.1, max_grad_norm=0.0, cast_lm_head_to_fp32=False,
                    model_init_kwargs={"dtype": torch.float64})  # fmt: skip
    if name == "grpo":
        cls, args = SimGRPO, run(SimGRPO, GRPOConfig, Path(out_dir), "token_truncate", **settings)
    else:
        cls = SimDPPO
        cls.RANK_BALANCE_TOLERANCE = 0.0  # move rows wherever a move evens the ranks' tokens
        args = run(cls, DPPOConfig, Path(out_dir), "token_truncate", completion_keep_rate=1.0, **settings)
    gradient = SaveGradient(Path(out_dir, "grad.pt"))
    trainer = cls(model_dir, random_reward, args=args, train_dataset=uneven_prompts(), callbacks=[gradient])
    gradient.model = trainer.model
    trainer.use_vllm = True
    trainer.train()
    if trainer.accelerator.is_main_process:
        Path(out_dir, "log.json").write_text(json.dumps(trainer.state.log_history))
    leave_without_destructors()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*sys.argv[1:])
