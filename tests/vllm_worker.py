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
the logs; with `record_params`, the LoRA and base parameters before and after (as they are, float32: 1 GB for both,
so only the run whose test reads them saves them); with `audit_every`, each audit's two gradients.
"""

import json
import os
import sys
from pathlib import Path

RECORDED = ("completion_ids", "completion_mask", "old_per_token_logps", "sampling_per_token_logps",
            "importance_sampling_ratio", "advantages", "dppo_keep", "dppo_weight")


CONSTANT_REWARD = {"now": False}  # set per generation batch by Recording


def spread_reward(completions, **kwargs):
    """A deterministic reward with spread inside most groups (the completion text's length mod 5), or 0 for every
    completion in the batches the scenario names."""
    from dppo_trl.tasks.reasoning_gym import completion_text

    return [0.0 if CONSTANT_REWARD["now"] else float(len(completion_text(c)) % 5) for c in completions]


class Scenario:
    """Sets the IS mode of each generation batch and makes the chosen batches' rewards constant (put before
    ``support.recording.Recorder``, which records what ``_generate_and_score_completions`` returns: for DPPO, after
    pruning and its old-log-prob pass); each record also says the batch's IS mode."""

    scenario: dict

    def _generate_and_score_completions(self, inputs):
        batch = len(self.__dict__.get("records", []))
        modes = self.scenario.get("modes")
        if modes:
            self.vllm_importance_sampling_mode = modes[batch % len(modes)]
        CONSTANT_REWARD["now"] = batch in self.scenario.get("constant_reward_batches", [])
        out = super()._generate_and_score_completions(inputs)
        self.records[-1]["mode"] = self.vllm_importance_sampling_mode
        return out


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
    from support.configs import smollm2_config
    from support.recording import count_logprob_rows, recording

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.smollm2 import ensure
    from dppo_trl.tasks.reasoning_gym import reasoning_gym_dataset

    vllm_cpu_shim.apply()
    is_grpo = scenario["trainer"] == "grpo"
    base, config_cls = (GRPOTrainer, GRPOConfig) if is_grpo else (DPPOTrainer, DPPOConfig)
    trainer_cls = recording(base, Scenario, batch_keys=RECORDED, record_audits=True)
    trainer_cls.scenario = scenario
    args = smollm2_config(
        config_cls, scenario["out"] + ".run", steps_per_generation=2, gradient_accumulation_steps=1,
        max_completion_length=16, learning_rate=scenario.get("learning_rate", 0.05), max_grad_norm=0.0,
        max_steps=scenario["max_steps"], use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512,
        vllm_gpu_memory_utilization=0.3, vllm_importance_sampling_clip_min=0.9, vllm_importance_sampling_clip_max=1.1,
        **({} if is_grpo else scenario.get("dppo", {})),
    )
    data = reasoning_gym_dataset("chain_sum", size=16, seed=0, answer_format="last_number", min_terms=2,
                                 max_terms=2, min_digits=1, max_digits=2)
    torch.manual_seed(0)  # the LoRA A matrices' initialization
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = trainer_cls(str(ensure()), spread_reward, args=args, train_dataset=data, peft_config=lora)
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
    record_params = scenario.get("record_params", False)
    params = lambda: {n: p.detach().clone() for n, p in trainer.model.named_parameters()}  # noqa: E731
    before = params() if record_params else None
    trainer.train()
    saved = {"records": trainer.__dict__.get("records", []), "audits": trainer.__dict__.get("audits", []),
             "steps": steps, "logs": trainer.state.log_history, "before": before,
             "after": params() if record_params else None, "no_grad_rows": counter["no_grad_rows"]}
    torch.save(saved, scenario["out"])


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run(json.loads(sys.argv[1]))
