"""The offline tiny models and datasets of the tests (built from ``dppo_trl.tasks.toy``), and LoRA settings."""

import torch

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


def save_tiny_gpt2(directory):
    """A tiny GPT-2 (learned absolute positions) with the character tokenizer, saved in ``directory``."""
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel

    from dppo_trl.tasks.toy import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():  # positions that matter: the random init's position embeddings are tiny (std 0.01)
        model.transformer.wpe.weight.normal_(0, 1.0)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)
