"""One training run with a real vLLM engine colocated on the CPU, for tests/test_vllm_engine.py (in a process of its
own: vLLM starts an engine per process, and a script that builds one needs the `__main__` guard).

    python tests/vllm_worker.py '<scenario as JSON>'

GRPOTrainer or DPPOTrainer on SmolLM2-135M-Instruct with LoRA, chat prompts from reasoning-gym's chain_sum, TRL's
defaults (dapo, beta 0, vLLM colocated with its importance-sampling correction), 2 optimizer steps per generation
batch. The scenario picks the trainer, DPPO's settings, the optimizer steps that take a step (SGD; the learning rate
is 0 in the others, so parameters, and with them vLLM's samples, stay the same from run to run), the IS mode of each
generation batch, and the batches whose reward is constant. It saves, with torch.save: per generation batch, what
the trainer built (samples, vLLM's and the trainer's log-probs, TRL's IS ratio, DPPO's keep mask and weights); per
optimizer step, the LoRA gradient the optimizer received (float64) and the rows of the passes without autograd;
the logs; the LoRA and base parameters before and after; with `audit_every`, each audit's two gradients.
"""

import json
import os
import sys
from pathlib import Path

RECORDED = ("completion_ids", "completion_mask", "old_per_token_logps", "sampling_per_token_logps",
            "importance_sampling_ratio", "advantages", "dppo_keep", "dppo_weight")  # fmt: skip


CONSTANT_REWARD = {"now": False}  # set per generation batch by Recording


def spread_reward(completions, **kwargs):
    """A deterministic reward with spread inside most groups (the completion text's length mod 5), or 0 for every
    completion in the batches the scenario names."""
    from dppo_trl.tasks.reasoning_gym import completion_text

    return [0.0 if CONSTANT_REWARD["now"] else float(len(completion_text(c)) % 5) for c in completions]


class Recording:
    """Sets the IS mode of each generation batch, makes the chosen batches' rewards constant, and records what
    ``_generate_and_score_completions`` returns (for DPPO: after pruning and its old-log-prob pass)."""

    scenario: dict

    def _generate_and_score_completions(self, inputs):
        batch = len(self.records)
        modes = self.scenario.get("modes")
        if modes:
            self.vllm_importance_sampling_mode = modes[batch % len(modes)]
        CONSTANT_REWARD["now"] = batch in self.scenario.get("constant_reward_batches", [])
        out = super()._generate_and_score_completions(inputs)
        record = {k: out[k].detach().clone() for k in RECORDED if k in out}
        record["mode"] = self.vllm_importance_sampling_mode
        self.records.append(record)
        return out

    def _record_audit(self, dppo, grpo, seconds):  # DPPO with audit_every: each audit's two gradients
        self.audits.append((dppo.clone(), grpo.clone()))
        super()._record_audit(dppo, grpo, seconds)


def lora_gradient(trainer):
    import torch

    grads = [p.grad.flatten() for n, p in trainer.model.named_parameters() if "lora_" in n and p.grad is not None]
    return torch.cat(grads).double().clone() if grads else None


def run(scenario: dict) -> None:
    import torch
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import vllm_cpu_shim
    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.smollm2 import ensure
    from dppo_trl.tasks.reasoning_gym import reasoning_gym_dataset
    from test_trainer import count_logprob_rows

    vllm_cpu_shim.apply()
    is_grpo = scenario["trainer"] == "grpo"
    base, config_cls = (GRPOTrainer, GRPOConfig) if is_grpo else (DPPOTrainer, DPPOConfig)
    trainer_cls = type("Recording" + base.__name__, (Recording, base), {"scenario": scenario, "records": None})
    args = config_cls(
        output_dir=scenario["out"] + ".run", bf16=False, use_cpu=True, gradient_checkpointing=False,
        per_device_train_batch_size=8, num_generations=4, steps_per_generation=2, gradient_accumulation_steps=1,
        max_completion_length=16, temperature=1.0, optim="sgd", learning_rate=scenario.get("learning_rate", 0.05),
        lr_scheduler_type="constant", max_grad_norm=0.0, max_steps=scenario["max_steps"], logging_steps=1,
        save_strategy="no", report_to=[], seed=0, disable_tqdm=True, use_vllm=True, vllm_mode="colocate",
        vllm_max_model_length=512, vllm_gpu_memory_utilization=0.3,
        vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1,
        **({} if is_grpo else scenario.get("dppo", {})),
    )  # fmt: skip
    data = reasoning_gym_dataset("chain_sum", size=16, seed=0, answer_format="last_number", min_terms=2,
                                 max_terms=2, min_digits=1, max_digits=2)  # fmt: skip
    torch.manual_seed(0)  # the LoRA A matrices' initialization
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trainer_cls(str(ensure()), spread_reward, args=args, train_dataset=data, peft_config=lora)
    trainer.records, trainer.audits = [], []
    counter = count_logprob_rows(trainer)
    steps = []
    trained = set(scenario.get("trained_steps", []))

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            step = state.global_step + 1
            for group in trainer.optimizer.param_groups:
                group["lr"] = args.learning_rate if step in trained else 0.0
            steps.append({"step": step, "gradient": lora_gradient(trainer), "no_grad_rows": counter["no_grad_rows"]})

    trainer.add_callback(Capture())
    params = lambda: {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}  # noqa: E731
    before = params()
    trainer.train()
    torch.save({"records": trainer.records, "audits": trainer.audits, "steps": steps, "logs": trainer.state.log_history, "before": before,
                "after": params(), "no_grad_rows": counter["no_grad_rows"]}, scenario["out"])  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run(json.loads(sys.argv[1]))
