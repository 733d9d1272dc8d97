"""Training configurations of the tests: the CPU settings every tiny-model run shares (``CPU``, through
``cpu_config``) and named presets over them."""

from pathlib import Path

# TRL 1.16's loss types (tests/test_differential.py checks that TRL's own help lists exactly these).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")

# DPPOConfig's own fields (those GRPOConfig lacks).
DPPO_FIELDS = {
    "prompt_probe_generations",
    "completion_keep_rate",
    "keep_floor",
    "prune_sampling",
    "prune_seed",
    "keep_budget",
    "score_length_exponent",
    "adaptive_keep_error",
    "adaptive_keep_error_source",
    "audit_every",
    "audit_sketch_dim",
    "audit_exact_params",
    "speed_check",
    "packing",
    "max_packed_tokens",
    "prefix_sharing",
    "prompt_keep_rate",
    "prompt_keep_floor",
    "prompt_history_decay",
    "prompt_score",
}

# A few CPU steps on the offline tiny model: 8 rows (2 prompts x 4 completions) of up to 6 tokens per device step.
CPU = dict(
    bf16=False,
    use_cpu=True,
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=6,
    learning_rate=1e-3,
    gradient_checkpointing=False,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    max_steps=2,
    seed=0,
    temperature=1.0,
    dataloader_num_workers=0,
)

# One generation batch per optimizer step, taken in two micro-steps (GA == steps_per_generation).
TWO_MICRO_STEPS = dict(steps_per_generation=2, gradient_accumulation_steps=2)

# The exact oracles' batch (tests/support/oracle.py): N_ROWS rows, groups of 2, completions of up to 5 tokens.
N_ROWS = 6


def cpu_config(tmp_path, cls=None, **overrides):
    """``cls`` (DPPOConfig by default, or GRPOConfig) with ``CPU``'s settings and ``overrides``; the output in
    ``tmp_path/out``."""
    from dppo_trl import DPPOConfig

    cls = cls or DPPOConfig
    return cls(**{"output_dir": str(Path(tmp_path) / "out"), **CPU, **overrides})


# For configurations that are only validated: nothing is trained with them, no output is written.
VALIDATION = dict(output_dir="unused", bf16=False, use_cpu=True, report_to=[])


def validation_config(**overrides):
    """A DPPOConfig of ``VALIDATION``'s settings and ``overrides``, for tests of its validation."""
    from dppo_trl import DPPOConfig

    return DPPOConfig(**{**VALIDATION, **overrides})


def oracle_config(tmp_path, loss_type, beta, spg, **extra):
    """The exact oracles' setting: ``N_ROWS`` rows in ``spg`` micro-batches (gradient_accumulation_steps ``spg``
    unless given), groups of 2, clipping at 0.2, completion pruning at 0.5 with floor 0.1."""
    settings = dict(
        loss_type=loss_type,
        beta=beta,
        per_device_train_batch_size=N_ROWS // spg,
        steps_per_generation=spg,
        gradient_accumulation_steps=extra.pop("gradient_accumulation_steps", spg),
        num_generations=2,
        max_completion_length=5,
        epsilon=0.2,
        completion_keep_rate=0.5,
        keep_floor=0.1,
    )
    return cpu_config(tmp_path, **{**settings, **extra})


def simulated_vllm_config(tmp_path, mode, cls=None, **overrides):
    """TRL's vLLM importance-sampling correction in ``mode``, with clips (0.9, 1.2) that bite, for a trainer with
    ``support.sampler.SimulatedVLLM`` (beta 0.05 unless given)."""
    settings = dict(
        beta=0.05,
        **TWO_MICRO_STEPS,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=1.2,
        vllm_importance_sampling_clip_min=0.9,
    )
    return cpu_config(tmp_path, cls=cls, **{**settings, **overrides})


def float64_settings() -> dict:
    """Overrides that load the model in float64 and keep TRL from casting its LM head to float32 (fresh each call:
    TRL may edit ``model_init_kwargs``). With ``support.exact.use_float64_kernels`` the run is float64 end to end."""
    import torch

    return dict(cast_lm_head_to_fp32=False, model_init_kwargs={"dtype": torch.float64})


def smollm2_config(cls, output_dir, **overrides):
    """SmolLM2-135M-Instruct on the CPU: 8 rows (2 prompts x 4), SGD at a constant learning rate (an update is the
    learning rate times the gradient), beta 0, one step, nothing saved."""
    kwargs = dict(
        output_dir=str(output_dir),
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        temperature=1.0,
        beta=0.0,
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return cls(**kwargs)
