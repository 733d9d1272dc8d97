"""The training setups more than one benchmark trains on (what ``run_one`` takes): the countdown task from a
warm-started tiny Qwen2, and SmolLM2-135M-Instruct with LoRA on a reasoning-gym task; the held-out evaluation of
each; TRL's group advantages of simulated rewards; and what the benchmarks read from the package's configuration
and the test suite's helpers."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from .training import data_progress

TESTS = Path(__file__).resolve().parent.parent.parent / "tests"
LORA = dict(r=16, lora_alpha=32, target_modules="all-linear")
TASK_OPTIONS = {"chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2)}


def config_default(name: str):
    """``DPPOConfig``'s default of its field ``name`` (e.g. ``keep_floor``)."""
    from dppo_trl import DPPOConfig

    return next(f.default for f in dataclasses.fields(DPPOConfig) if f.name == name)


def suite_helper(name: str):
    """The test suite's helper module ``tests/NAME.py`` (e.g. ``vllm_cpu_shim``), loaded from its file."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """TRL's ``scale_rewards="group"``: ``(r - mean) / (std + 1e-4)`` per group of ``group_size`` consecutive
    rows (unbiased std), in the rewards' dtype, flat; exactly 0 on a group whose rewards are all equal."""
    from dppo_trl.core.pruning import zero_spread_rows

    groups = rewards.view(-1, group_size)
    a = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    return torch.where(zero_spread_rows(rewards.flatten(), group_size), 0.0, a)


# --------------------------------------------------------------------------------- countdown, tiny Qwen2
def countdown_accuracy(model, tokenizer, starts, samples, seed=1234):
    """Held-out accuracy over ``starts`` (draws from the held-out starts under the training law): sampled (the
    mean over ``samples`` completions per draw at temperature 1, what GRPO optimizes; the main figure) and
    greedy. The sampling uses its own seed (the same in every run: common random numbers across methods) and
    leaves the training's random state untouched."""
    from dppo_trl.tasks.countdown import heldout_accuracy

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        sampled = heldout_accuracy(model, tokenizer, starts, greedy=False, samples=samples)
    return {"accuracy": sampled, "greedy_accuracy": heldout_accuracy(model, tokenizer, starts)}


def countdown_setup(*, train_prompts, heldout, eval_samples, eval_every, epochs, batch_size,
                    gradient_accumulation_steps, steps_per_generation, learning_rate, sft_steps, hidden_size, layers,
                    model_cache, max_completion_length=None) -> dict:
    """The countdown task (``dppo_trl.tasks.countdown``) from a tiny Qwen2 of ``hidden_size`` x ``layers`` warm-started
    with ``sft_steps`` supervised steps (cached under ``model_cache``), TRL's defaults where they matter
    (``loss_type="dapo"``, ``beta=0``, 8 generations), ``epochs`` over ``train_prompts`` prompts, the held-out
    accuracy (``countdown_accuracy`` on ``heldout`` draws) every ``eval_every`` epochs of data progress; completions
    of at most ``max_completion_length`` tokens (default: the longest correct chain's, ``max_completion_tokens``)."""
    from dppo_trl.tasks.countdown import (
        countdown_dataset,
        countdown_reward,
        countdown_splits,
        max_completion_tokens,
        training_draws,
        warm_start,
    )

    train, held_out = countdown_splits(train_size=train_prompts, seed=0)
    heldout_set = training_draws(held_out, heldout, random.Random(1))
    model_dir = Path(model_cache) / f"warm-start-{hidden_size}x{layers}-{sft_steps}"
    warm = {}
    if not (model_dir / "config.json").exists():
        start = time.perf_counter()
        warm = warm_start(model_dir, held_out, sft_steps, hidden_size, layers)
        warm["seconds"] = time.perf_counter() - start
        print(f"warm start: {sft_steps} supervised steps in {warm['seconds']:.0f} s, loss {warm['loss']:.3f}, "
              f"greedy held-out {warm['heldout_accuracy']:.3f}", flush=True)
    prompts_per_step = batch_size * gradient_accumulation_steps // 8
    steps_per_epoch = len(train) // prompts_per_step
    return {
        "model_dir": str(model_dir),
        "warm_start": warm,
        "train_dataset": countdown_dataset(train),
        "reward_funcs": countdown_reward,
        "evaluate": functools.partial(countdown_accuracy, starts=heldout_set, samples=eval_samples),
        "eval_every": max(1, round(steps_per_epoch * eval_every)),
        "epochs": epochs,
        "progress": data_progress,
        "trainer_args": dict(
            bf16=False,
            use_cpu=True,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=steps_per_generation,
            num_generations=8,
            max_completion_length=max_completion_length or max_completion_tokens(),
            temperature=1.0,
            loss_type="dapo",
            beta=0.0,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
        ),
    }


# ------------------------------------------------------------------ SmolLM2 + LoRA on reasoning-gym
def reasoning_gym_score(model, tokenizer, dataset, max_new_tokens, batch=32, seed=1234):
    """Mean task score of one sampled completion (temperature 1) per held-out prompt; its own seed (the same
    draws for every method: common random numbers) and the training's random state left untouched."""
    from dppo_trl.tasks.reasoning_gym import reasoning_gym_reward

    scores, padding_side = [], tokenizer.padding_side
    tokenizer.padding_side = "left"
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(dataset), batch):
            rows = dataset[start : start + batch]
            texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                     for p in rows["prompt"]]
            encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**encoded, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)
            completions = tokenizer.batch_decode(out[:, encoded["input_ids"].size(1) :], skip_special_tokens=True)
            scores += reasoning_gym_reward(completions, **rows)  # the columns by name, as TRL passes them
    tokenizer.padding_side = padding_side
    return {"accuracy": statistics.mean(scores)}


def vllm_on_cpu() -> dict:
    """GRPOConfig fields for TRL's colocated vLLM; on a CPU, after the shim that keeps the engine's linear weights
    loadable (tests/vllm_cpu_shim.py says why). vLLM compiles its model at each engine start, outside the clock."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: 4 x 8 rows of at most 512 tokens need far less
    if not torch.cuda.is_available():
        suite_helper("vllm_cpu_shim").apply()
    return dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512, vllm_gpu_memory_utilization=0.3)


def reasoning_gym_setup(*, task, answer_format, task_seed, train_prompts, heldout, eval_every, steps,
                        prompts_per_step, max_completion_length, learning_rate, vllm, lora_dropout=None,
                        generations=8) -> dict:
    """SmolLM2-135M-Instruct (``dppo-trl-smollm2``) with LoRA (``LORA``, and ``lora_dropout`` where given) on the
    reasoning-gym ``task``: ``train_prompts`` prompts from generator seed ``task_seed``, ``prompts_per_step``
    prompts x ``generations`` completions per optimizer step, ``dapo``, ``beta=0``, ``steps`` steps; the sampled
    held-out score (``reasoning_gym_score`` on ``heldout`` prompts of seed ``task_seed + 1``) every ``eval_every``
    steps; vLLM colocated generating with ``vllm``."""
    from peft import LoraConfig

    from dppo_trl.smollm2 import ensure
    from dppo_trl.tasks.reasoning_gym import reasoning_gym_dataset, reasoning_gym_reward

    make = functools.partial(reasoning_gym_dataset, task, answer_format=answer_format, **TASK_OPTIONS.get(task, {}))
    dropout = {} if lora_dropout is None else {"lora_dropout": lora_dropout}
    held_out = make(size=heldout, seed=task_seed + 1)
    return {
        "model_dir": str(ensure()),
        "train_dataset": make(size=train_prompts, seed=task_seed),
        "reward_funcs": reasoning_gym_reward,
        "evaluate": functools.partial(reasoning_gym_score, dataset=held_out, max_new_tokens=max_completion_length),
        "eval_every": eval_every,
        "steps": steps,
        "extension": 0,
        "trainer_kwargs": {"peft_config": LoraConfig(**LORA, **dropout, task_type="CAUSAL_LM")},
        "trainer_args": dict(
            bf16=False,
            use_cpu=True,
            per_device_train_batch_size=prompts_per_step * generations,
            num_generations=generations,
            max_completion_length=max_completion_length,
            temperature=1.0,
            loss_type="dapo",
            beta=0.0,
            learning_rate=learning_rate,
            lr_scheduler_type="constant",
            **(vllm_on_cpu() if vllm else {}),
        ),
    }
