"""The offline tiny models and datasets of the tests (built from ``dppo_trl.tasks.toy``), and LoRA settings."""

from dppo_trl.tasks.toy import addition_dataset, addition_pairs, save_tiny_model


def save_tiny_dense(directory):
    """The dense tiny Qwen2 (hidden size 32, 2 layers) with the character tokenizer, saved in ``directory``."""
    return save_tiny_model(directory, hidden_size=32, num_layers=2)


def save_tiny_moe(directory):
    """A tiny Qwen3-MoE (4 experts, top-2) with the router settings of the released configs: the
    ``output_router_logits`` field present (False) and ``router_aux_loss_coef=0.001``, so TRL turns its
    load-balancing loss on."""
    return save_tiny_model(directory, hidden_size=32, num_layers=2, moe=True)


def addition_prompts(count=64):
    """The first ``count`` training prompts of the addition task (seed 0), as a prompt/answer dataset."""
    train, _ = addition_pairs(seed=0)
    return addition_dataset(train[:count])


def lora_config(**overrides):
    """LoRA rank 4 (alpha 8) on the attention's q and v projections of a causal LM."""
    from peft import LoraConfig

    settings = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return LoraConfig(**{**settings, **overrides})
