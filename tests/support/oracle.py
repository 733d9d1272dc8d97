"""The exact oracles on the tiny model: a DPPOTrainer in train mode (``make_trainer``), one synthetic generation
batch as TRL builds it (``synthetic_batch``), its loss and gradient through DPPO's own split and loss for a given
keep mask and weights (``dppo_loss_and_grad``), and expectations over every outcome of a design
(``expectation``, with ``support.outcomes``), compared to float64 rounding (``assert_exact``)."""

import pytest
import torch
from trl import GRPOTrainer

from dppo_trl import DPPOTrainer

from .configs import N_ROWS, oracle_config
from .rewards import random_reward


def make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, beta, spg, float64=False, **extra):
    """A DPPOTrainer on the tiny model in train mode (``support.configs.oracle_config``); ``float64``: the model
    in float64 (and TRL's float32 LM head cast off), for exact oracles."""
    if float64:
        extra["cast_lm_head_to_fp32"] = False
    args = oracle_config(tmp_path, loss_type, beta, spg, **extra)
    trainer = DPPOTrainer(tiny_model_dir, random_reward, args=args, train_dataset=train_dataset)
    if float64:
        trainer.model.double()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def synthetic_batch(trainer, seed=0):
    """A generation batch as TRL's `_generate_and_score_completions` returns it, with old and reference
    log-probs away from the current policy (so clipping is active) and one zero-advantage row."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    pad = trainer.processing_class.pad_token_id
    prompt_len, comp_len = 4, 5
    prompt_ids = torch.randint(10, vocab, (N_ROWS, prompt_len), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_ids[0, 0], prompt_mask[0, 0] = pad, 0  # left padding
    completion_ids = torch.randint(10, vocab, (N_ROWS, comp_len), generator=g)
    lengths = torch.tensor([5, 3, 4, 1, 5, 2])
    completion_mask = (torch.arange(comp_len)[None, :] < lengths[:, None]).long()
    completion_ids[completion_mask == 0] = pad
    advantages = torch.tensor([1.3, 0.0, -0.7, 0.2, -1.6, 0.9])
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad():
        logps, *_ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, input_ids, attention,
                                                                   comp_len)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "old_per_token_logps": logps + 0.5 * torch.randn(logps.shape, generator=g),
        "ref_per_token_logps": logps + 0.3 * torch.randn(logps.shape, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def as_float64(batch):
    """The batch's floating tensors in float64."""
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in batch.items()}


def generation_batch_of(batch, keep):
    """The ``GenerationBatch`` of one rank's ``batch`` (TRL's rows) with the rows ``keep`` kept: their token counts
    and kept rows, as ``hooks.keep_decision`` records them."""
    from dppo_trl.components.generation_batch import GenerationBatch

    prompt, completion = batch["prompt_mask"].sum(1), batch["completion_mask"].sum(1)
    return GenerationBatch(
        row_tokens=torch.stack([prompt, completion, completion], 1),
        kept_rows_per_rank=[keep.nonzero().flatten().tolist()],
    )


def dppo_loss_and_grad(trainer, batch, keep, weights):
    """Total loss and gradient of one generation batch through DPPOTrainer's own split and loss (TRL's split of
    the rows, whose micro-batch token counts ``bnpo`` and the entropy bonus divide by, drawn before the mask)."""
    b = dict(batch)
    state = generation_batch_of(batch, keep)
    b.update(trainer.placement.trl_split_of_rows(b, state))
    b["dppo_keep"] = keep
    b["dppo_weight"] = weights.to(batch["advantages"].dtype)
    trainer.model.zero_grad()
    total = 0.0
    for mb in trainer.placement.kept_microbatches(b, state):
        loss = trainer._compute_loss(trainer.model, mb)
        loss.backward()
        total += loss.item()
    return torch.tensor(total, dtype=torch.float64), flat_gradient(trainer.model)


def flat_gradient(model):
    """The gradient of ``model``'s trainable parameters as one float64 vector (zeros where none reached one)."""
    grads = [p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
             for p in model.parameters() if p.requires_grad]
    return torch.cat(grads).double()


def expectation(trainer, batch, outcomes):
    """The expected loss and gradient over ``outcomes`` (``(probability, keep, weights)``, whose probabilities
    must sum to 1)."""
    loss, grad, total_prob = 0.0, 0.0, 0.0
    for prob, keep, weights in outcomes:
        value, g = dppo_loss_and_grad(trainer, batch, keep, weights)
        loss, grad, total_prob = loss + prob * value, grad + prob * g, total_prob + prob
    assert total_prob == pytest.approx(1.0)
    return loss, grad


def assert_exact(value, reference):
    """Equal to float64 rounding: relative 1e-9 of the largest entry (float32 rounding would be ~1e-7)."""
    scale = float(reference.abs().max()) if reference.numel() > 1 else abs(float(reference))
    torch.testing.assert_close(value, reference, rtol=1e-9, atol=1e-9 * max(scale, 1e-12))


def padded_and_packed_loss_and_grad(trainer):
    """Loss and gradient of one synthetic generation batch (5 of 6 rows kept, unequal weights) through DPPO's
    split and loss, padded (``packing=False``) and packed."""
    batch = synthetic_batch(trainer, seed=2)
    keep = torch.tensor([True, True, False, True, True, True])
    weights = torch.where(keep, torch.tensor([1.5, 2.0, 0.0, 1.2, 4.0, 1.0]), torch.zeros(N_ROWS))
    results = {}
    for packing in (False, True):
        trainer.args.packing = packing
        results[packing] = dppo_loss_and_grad(trainer, batch, keep, weights)
    return results[False], results[True]
