"""Prefix sharing (docs/packing.md): a group's kept completions forward their prompt once in the packed passes.

The oracle: the same per-token log-probs, entropies, losses and gradients as repeated rows (``prefix_sharing=False``,
today's packing), in float64 to 1e-10, for every loss type, beta 0 and > 0, LoRA, sdpa and eager, completions
that end at eos (pad == eos), groups with one kept completion and with all kept. GRPOTrainer's step with every row
kept is in tests/test_differential.py and tests/test_trl_microbatch_statistics.py, which run with the default
(sharing on for the tiny model's sdpa)."""

import logging

import pytest
import torch
from support.configs import LOSS_TYPES, N_ROWS
from support.marks import FAST_LOSS_TYPES, slow_unless
from support.oracle import dppo_loss_and_grad, make_trainer, synthetic_batch
from support.recording import RecordingTrainer
from support.training import train

from dppo_trl.core.packing import pack_call, packed_inputs
from dppo_trl.core.prefix import (
    attention_pair_cost,
    group_units,
    prefix_attention_mask,
    prefix_sharing_refusal,
    prompt_segments,
    segment_length,
    sharing_pays,
)

PROMPTS_OF_ROWS = (0, 0, 0, 3, 3, 5)  # rows 0-2 share row 0's prompt (left-padded), rows 3-4 row 3's; row 5 alone


def grouped(batch, prompts_of_rows=PROMPTS_OF_ROWS, eos_at_end=False, pad=None):
    """``batch`` with row ``i`` given the prompt of row ``prompts_of_rows[i]``; with ``eos_at_end`` each completion's
    last real token is ``pad`` (pad == eos, as on the real model)."""
    out = dict(batch)
    source = torch.tensor(prompts_of_rows)
    out["prompt_ids"], out["prompt_mask"] = batch["prompt_ids"][source], batch["prompt_mask"][source]
    if eos_at_end:
        ids = batch["completion_ids"].clone()
        last = batch["completion_mask"].sum(1) - 1
        ids[torch.arange(ids.size(0)), last] = pad
        out["completion_ids"] = ids
    return out


def logps_shared_and_repeated(trainer, batch):
    """``_packed_logps_and_entropies`` with prefix sharing, then without; the shared call's segments are checked to
    be the rows of each prompt (else the comparison would be of repeated rows with themselves)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].size(1)
    trainer.prefix_sharing.enabled = True
    segments, _ = trainer.prefix_sharing.call_segments(ids, mask, width)
    prompts = batch["prompt_ids"].masked_fill(batch["prompt_mask"] == 0, -1).tolist()
    assert all(len({tuple(prompts[b]) for b in s}) == 1 for s in segments)
    assert len(segments) == len({tuple(p) for p in prompts}) < len(prompts)
    results = []
    for sharing in (True, False):
        trainer.prefix_sharing.enabled = sharing
        results.append(trainer._packed_logps_and_entropies(trainer.model, ids, mask, width, compute_entropy=True))
    return results


def assert_float64_equal(value, reference, tolerance=1e-10):
    scale = max(float(reference.abs().max()), 1.0)
    assert float((value - reference).abs().max()) <= tolerance * scale


# ------------------------------------------------------------------ the layout (core)
def test_prompt_segments_group_rows_by_their_real_prompt_tokens():
    ids = torch.tensor([[0, 5, 6, 1], [5, 6, 0, 2], [0, 5, 6, 3], [7, 5, 6, 4]])  # prompt width 3
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    # Row 1's prompt is [5, 6] padded on the right of the prompt columns: equal real tokens share.
    assert prompt_segments(ids, mask, 3) == [[0, 1, 2], [3]]


def test_segment_length_counts_the_shared_prefix_once():
    assert segment_length([10, 12, 9], 6) == 31 - 2 * 5
    assert segment_length([10], 6) == 10
    assert segment_length([3, 4], 1) == 7  # a one-token prompt: nothing to share (its token predicts each row)


def test_sharing_pays_where_the_positions_saved_outweigh_the_attention_pairs_added():
    """SmolLM2-135M's layer shapes: one pair costs 3 x (4 x 576) / 7,077,888 = 1/1024 of a token. Measured on CPU
    (benchmarks/bench_prefix.py): a long prompt before short completions pays, long completions behind a short prompt
    do not (their segment's one row attends over many more pairs)."""
    from transformers import LlamaConfig

    smollm2 = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    cost = attention_pair_cost(smollm2)
    assert cost == 1 / 1024
    assert sharing_pays([50 + 16] * 7, 50, cost)  # the real-model benchmark's groups
    assert sharing_pays([1024 + 128] * 8, 1024, cost)
    assert not sharing_pays([32 + 512] * 4, 32, cost)
    assert not sharing_pays([1024 + 16], 1024, cost)  # one row: nothing to share
    assert sharing_pays([32 + 512] * 4, 32, 0.0)  # attention for free: any shared token pays


def test_group_units_keep_a_groups_rows_together_in_pieces_of_at_most_max_rows():
    assert group_units([4, 4, 1, 4, 1]) == [[0, 1, 3], [2, 4]]
    assert group_units([4, 4, 1, 4, 1], max_rows=2) == [[0, 1], [3], [2, 4]]


def test_shared_layout_positions_labels_and_mask():
    """Two rows of one prompt [5, 6, 7] and completions [8, 9] and [10]: the prefix [5, 6] once, then [7, 8, 9]
    and [7, 10], each branch at its own positions, each completion token the label of the token before it."""
    pad = 0
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 10, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    packed = packed_inputs(ids, mask, 2, [[[0, 1]]], pad)
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 7, 10]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    assert packed["shift_labels"].tolist() == [[-100, -100, 8, 9, -100, 10, -100]]
    segment_ids, branch_ids = packed["layout"]
    assert segment_ids.tolist() == [[0] * 7] and branch_ids.tolist() == [[0, 0, 1, 1, 1, 2, 2]]
    visible = prefix_attention_mask(segment_ids, branch_ids)[0, 0].int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],  # the second branch sees the prefix and itself, not the first branch
        [1, 1, 0, 0, 0, 1, 1],
    ]
    r, c, b, j = packed["index"]
    assert sorted(zip(b.tolist(), j.tolist(), c.tolist())) == [(0, 0, 3), (0, 1, 4), (1, 0, 6)]


def test_a_rows_pad_tail_is_a_segment_of_its_own():
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9], [1, 2, 3, 4]])
    mask = torch.ones_like(ids)
    packed = packed_inputs(ids, mask, 1, [[[0, 1]], [[2]]], 0)  # row 0: 4 + 2 tokens; row 1: 4 and 2 pads
    segment_ids, branch_ids = packed["layout"]
    assert segment_ids[1].tolist() == [0, 0, 0, 0, 1, 1]
    visible = prefix_attention_mask(segment_ids, branch_ids)
    assert bool(visible.any(-1).all())  # every query sees a key: no row of the softmax is empty


def test_a_segment_longer_than_the_row_budget_raises_it_and_the_call_stays_within_trls():
    lengths = [30, 9, 9]  # one shared segment of 30 tokens and two rows; the row budget is the padded width, 12
    rows = pack_call(lengths, 12, 6 * 12, fit_longest=True)
    assert sorted(map(sorted, rows)) == [[0], [1, 2]]  # the budget rises to the segment: 2 rows of 30 <= 72
    assert pack_call(lengths, 12, 4 * 12, fit_longest=True) == [[0, 1, 2]]  # else one row: 48 real tokens <= 48


# ------------------------------------------------------------------ shared == repeated (float64)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("use_peft", [False, True])
@pytest.mark.parametrize("eos_at_end", [False, True])
def test_shared_logprobs_equal_repeated_in_float64(tmp_path, tiny_model_dir, train_dataset, exact_logprobs, attn,
                                                   use_peft, eos_at_end):
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, "dapo", 0.0, 1, float64=True,
                           model_init_kwargs={"attn_implementation": attn, "dtype": torch.float64})
    if use_peft:
        from peft import LoraConfig, get_peft_model

        trainer.model = get_peft_model(trainer.model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                 lora_dropout=0.0))
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.3)
    batch = grouped(synthetic_batch(trainer), eos_at_end=eos_at_end, pad=trainer.processing_class.pad_token_id)
    with torch.no_grad():
        (logps, entropies, _), (repeated, repeated_entropies, _) = logps_shared_and_repeated(trainer, batch)
    m = batch["completion_mask"].bool()
    assert logps.dtype == torch.float64
    assert_float64_equal(logps[m], repeated[m])
    assert_float64_equal(entropies[m], repeated_entropies[m])
    assert torch.all(logps[~m] == 0)


def test_a_model_with_learned_absolute_positions_shares_exactly(tmp_path, tiny_gpt2_dir, train_dataset):
    """GPT-2: every branch keeps its tokens' positions (generation's), so shared == repeated here too."""
    trainer = make_trainer(tmp_path, tiny_gpt2_dir, train_dataset, "dapo", 0.0, 1)
    assert trainer.prefix_sharing.enabled
    batch = grouped(synthetic_batch(trainer))
    with torch.no_grad():
        (logps, _, _), (repeated, _, _) = logps_shared_and_repeated(trainer, batch)
    m = batch["completion_mask"].bool()
    assert (logps[m] - repeated[m]).abs().max() < 1e-5  # float32


KEEPS = {
    "all": [True] * N_ROWS,
    "one_per_prompt": [True, False, False, False, True, True],  # every segment of one row: nothing shared
    "mixed": [True, False, True, True, True, False],
}


def assert_shared_loss_and_gradient_equal_repeated(trainer, keep):
    """DPPO's loss and gradient of one synthetic generation batch (the trainer's groups of 2 rows) with the rows of
    ``keep`` kept, through its own split, with and without sharing: equal in float64."""
    batch = grouped(synthetic_batch(trainer), prompts_of_rows=(0, 0, 2, 2, 4, 4))
    mask = torch.tensor(keep)
    weights = torch.where(mask, torch.tensor([1.5, 2.0, 1.1, 1.2, 4.0, 1.0]), torch.zeros(N_ROWS)).double()
    results = {}
    for sharing in (True, False):
        trainer.prefix_sharing.enabled = sharing
        results[sharing] = dppo_loss_and_grad(trainer, batch, mask, weights)
    (loss, grad), (repeated_loss, repeated_grad) = results[True], results[False]
    assert repeated_grad.abs().sum() > 0
    assert_float64_equal(loss, repeated_loss)
    assert_float64_equal(grad, repeated_grad)


@pytest.mark.parametrize(
    "loss_type, beta, spg",
    [slow_unless(loss_type in FAST_LOSS_TYPES, loss_type, beta, spg)
     for loss_type in LOSS_TYPES for beta in (0.0, 0.05) for spg in (1, 3)],
)
@pytest.mark.parametrize("keep", list(KEEPS))
def test_shared_loss_and_gradient_equal_repeated(tmp_path, tiny_model_dir, train_dataset, exact_logprobs,
                                                 loss_type, beta, spg, keep):
    """DPPO's loss and gradient of one generation batch through its own split, with and without sharing: the
    micro-batches differ (sharing places a group's rows together) and the result does not."""
    trainer = make_trainer(tmp_path, tiny_model_dir, train_dataset, loss_type, beta, spg, float64=True,
                           model_init_kwargs={"dtype": torch.float64})
    assert_shared_loss_and_gradient_equal_repeated(trainer, KEEPS[keep])


def test_a_moe_model_without_its_router_loss_shares_exactly(tmp_path, tiny_moe_dir, train_dataset, exact_logprobs):
    """A MoE layer routes each token by its own hidden state, so a shared prefix token is routed as its repeated
    copies are. With the router loss off (``router_aux_loss_coef=0``) sharing is on, and DPPO's loss and gradient
    equal repeated rows'; with the released configs' router loss on, sharing is off."""
    assert not make_trainer(tmp_path / "router-loss", tiny_moe_dir, train_dataset, "dapo", 0.0, 1).prefix_sharing.enabled
    trainer = make_trainer(tmp_path, tiny_moe_dir, train_dataset, "dapo", 0.0, 1, float64=True,
                           router_aux_loss_coef=0.0,
                           model_init_kwargs={"dtype": torch.float64, "experts_implementation": "eager"})
    assert trainer.prefix_sharing.enabled and not trainer.aux_loss_enabled
    assert_shared_loss_and_gradient_equal_repeated(trainer, KEEPS["mixed"])


# ------------------------------------------------------------------ where it is on, and the tokens saved
def test_on_by_default_where_exact_and_off_where_not(tmp_path, tiny_model_dir, train_dataset, caplog):
    import varlen_reference

    flash_name = varlen_reference.register()  # the CPU stand-in of flash attention's varlen kernel

    assert make_trainer(tmp_path / "a", tiny_model_dir, train_dataset, "dapo", 0.0, 1).prefix_sharing.enabled
    with caplog.at_level(logging.WARNING, logger="dppo_trl.components.prefix_sharing"):
        flash = make_trainer(tmp_path / "b", tiny_model_dir, train_dataset, "dapo", 0.0, 1,
                             model_init_kwargs={"attn_implementation": flash_name})
    assert not flash.prefix_sharing.enabled
    assert "Prefix sharing is off" in caplog.text and "varlen_reference" in caplog.text
    with pytest.raises(ValueError, match="prefix_sharing=True is not exact"):
        make_trainer(tmp_path / "c", tiny_model_dir, train_dataset, "dapo", 0.0, 1, prefix_sharing=True,
                     model_init_kwargs={"attn_implementation": flash_name})
    off = make_trainer(tmp_path / "d", tiny_model_dir, train_dataset, "dapo", 0.0, 1, prefix_sharing=False)
    assert not off.prefix_sharing.enabled


def test_models_where_a_shared_prefix_is_not_exact_are_refused():
    from transformers import MistralConfig, Qwen2Config, Qwen3MoeConfig

    assert prefix_sharing_refusal(Qwen2Config(), "sdpa", False) is None
    assert "sliding" in prefix_sharing_refusal(MistralConfig(sliding_window=16), "sdpa", False)
    assert "sliding" in prefix_sharing_refusal(Qwen2Config(use_sliding_window=True, sliding_window=16,
                                                           max_window_layers=1, num_hidden_layers=2), "eager", False)
    assert "router loss" in prefix_sharing_refusal(Qwen3MoeConfig(), "sdpa", True)
    assert prefix_sharing_refusal(Qwen3MoeConfig(), "sdpa", False) is None  # MoE without its router loss
    assert "attention mask" in prefix_sharing_refusal(Qwen2Config(), "flash_attention_2", False)


def test_the_tokens_saved_are_logged_as_counted(tmp_path, tiny_model_dir, train_dataset):
    """``dppo/prefix_tokens_saved`` is 1 - (the segments' tokens / the kept rows' tokens), counted by hand from the
    recorded kept rows (a group's kept rows on the rank share their prompt where ``sharing_pays``)."""
    trainer = train(RecordingTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=2, logging_steps=1,
                    steps_per_generation=2, gradient_accumulation_steps=2)
    logged = [h["dppo/prefix_tokens_saved"] for h in trainer.state.log_history if "dppo/prefix_tokens_saved" in h]
    expected = []
    for record in trainer.records:
        keep = record["dppo_keep"].bool()
        prompt, completion = record["prompt_mask"].sum(1), record["completion_mask"].sum(1)
        groups = (torch.arange(keep.numel()) // trainer.num_generations)[keep].tolist()
        units = group_units(groups, trainer.args.per_device_train_batch_size)
        lengths = (prompt + completion)[keep].tolist()
        kept_prompt = prompt[keep].tolist()
        cost = attention_pair_cost(trainer.model.config)
        shared = sum(segment_length([lengths[i] for i in u], kept_prompt[u[0]])
                     if sharing_pays([lengths[i] for i in u], kept_prompt[u[0]], cost) else sum(lengths[i] for i in u)
                     for u in units)
        expected.append(1 - shared / sum(lengths))
    assert len(logged) == len(expected) and max(expected) > 0.2
    assert logged == pytest.approx(expected, abs=1e-6)


# ------------------------------------------------------------------ the planners over units
def random_units(generator, width, per_call, groups=6, group_size=4):
    """One rank's units: a few groups' kept rows (lengths up to ``width``, a shared prompt), cut at ``per_call``."""
    units, lengths, rows = [], [], []
    for _ in range(int(torch.randint(0, groups + 1, (), generator=generator))):
        prompt = int(torch.randint(1, width, (), generator=generator))
        kept = int(torch.randint(1, group_size + 1, (), generator=generator))
        row_lengths = torch.randint(prompt + 1, width + 1, (kept,), generator=generator).tolist()
        for piece in range(0, kept, per_call):
            members = row_lengths[piece : piece + per_call]
            lengths.append(segment_length(members, prompt))
            rows.append(len(members))
    return lengths, rows


def test_unit_plans_stay_within_trls_call_and_agree_across_ranks():
    """Deferred passes over units (one unit per call at most): every call allocates at most TRL's largest
    (``rows_per_call x width``) and every rank makes as many calls. Micro-batches over units: every unit placed
    once, and each rank's row counts per micro-batch, computed from the gathered units alone, are what the rank
    itself gets."""
    from dppo_trl.core.packing import microbatch_plan, packed_allocation, plan_calls_per_rank

    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        world, per_call, spg = (int(torch.randint(1, 4, (), generator=generator)), 2, 3)
        widths = torch.randint(4, 40, (world,), generator=generator).tolist()
        ranks = [random_units(generator, w, per_call) for w in widths]
        plans = plan_calls_per_rank([r[0] for r in ranks], widths, per_call, lambda w: w, items_per_call=1,
                                    fit_longest=True)
        assert len({len(p) for p in plans}) == 1
        for (lengths, _), width, plan in zip(ranks, widths, plans):
            assert sorted(i for call in plan for i in call) == list(range(len(lengths)))
            for call in plan:
                allocated = packed_allocation([lengths[i] for i in call], width, per_call * width, True)
                assert allocated <= per_call * width
        for me, (lengths, rows) in enumerate(ranks):
            order = torch.Generator().manual_seed(1)
            bins, sizes = microbatch_plan(lengths, [r[0] for r in ranks], spg, per_call, True, order,
                                          own_unit_rows=rows, unit_rows_per_rank=[r[1] for r in ranks])
            assert sorted(u for b in bins for u in b) == list(range(len(lengths)))
            assert len(sizes) == spg and all(sum(rows[u] for u in b) <= s for b, s in zip(bins, sizes))
