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


# Tiny hybrid models whose layers carry a state along a row (convolutions, state-space and linear attention):
# (config class, model class, the settings that make them small and valid).
HYBRID_MODELS = {
    "bamba": ("BambaConfig", "BambaForCausalLM",
              dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                   mamba_expand=2, mamba_chunk_size=16)),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(layer_types=["linear_attention", "full_attention"], head_dim=8, linear_num_value_heads=4,
                        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention"])),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_expand=2,
                       mamba_chunk_size=16, mamba_d_ssm=64, head_dim=8)),
}


def _save_tiny(directory, config_class, model_class, **settings):
    """A random-init model of ``config_class``/``model_class`` (transformers names), hidden size 32, 2 layers, with
    the character tokenizer, saved in ``directory``."""
    import transformers
    from transformers import GenerationConfig

    from dppo_trl.tasks.toy import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        **settings,
    )
    model = getattr(transformers, model_class)(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return str(directory)


def save_tiny_hybrid(directory, kind):
    """The tiny hybrid model ``kind`` (a key of ``HYBRID_MODELS``), saved in ``directory``."""
    config_class, model_class, settings = HYBRID_MODELS[kind]
    return _save_tiny(directory, config_class, model_class, **settings)


# Rotary scalings whose frequencies follow the longest position of a call, from position 8 on.
LENGTH_DEPENDENT_ROPE = {
    "dynamic": dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0),
    "longrope": dict(rope_type="longrope", short_factor=[1.0, 1.2, 1.5, 2.0], long_factor=[3.0, 4.0, 5.0, 6.0],
                     original_max_position_embeddings=8, rope_theta=10000.0),
}


def save_tiny_rope(directory, rope_type):
    """A tiny Qwen2 (head dim 8) with the rotary scaling ``rope_type`` (a key of ``LENGTH_DEPENDENT_ROPE``), whose
    original context is 8 positions, saved in ``directory``."""
    rope = LENGTH_DEPENDENT_ROPE[rope_type]
    max_positions = 8 if rope_type == "dynamic" else 256
    directory = _save_tiny(directory, "Qwen2Config", "Qwen2ForCausalLM", rope_parameters=dict(rope))
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    config.max_position_embeddings = max_positions
    config.save_pretrained(directory)
    return directory
