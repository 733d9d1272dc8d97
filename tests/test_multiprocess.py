"""Two processes on CPU (torchrun, gloo): DPPO with pruning and packing finishes without hanging, every rank
draws the same global masks, both ranks end with the same parameters (also when a rank keeps nothing), rows
moved between ranks to balance them train exactly as they would have where they were, and a run killed and
resumed with prompt pruning on ends where an uninterrupted one does, and with a length-dependent rotary no row
leaves its rank and the passes are TRL's padded ones. In every run both ranks make the same
forward calls, pass by pass (what a sharded model, which gathers its parameters in every forward, needs), and
no log-prob call is larger than GRPOTrainer's. Under FSDP2 (both models sharded) DPPO finishes, also with a
rank that keeps nothing, and ends where DDP does."""

import json
from pathlib import Path

import pytest
import torch
from support.configs import cpu_config
from support.models import save_tiny_rope
from support.processes import run_two_processes
from support.rewards import random_reward

from dppo_trl import DPPOTrainer
from dppo_trl.components.generation_batch import GenerationBatch

pytestmark = pytest.mark.subprocess  # torchrun

WORKER = Path(__file__).parent / "multiprocess_worker.py"


def assert_same_forward_calls(ranks):
    """Both ranks made the same forward calls of the policy and the reference model, in the same order: the same
    passes (generation, deferred old-policy / reference log-probs, training micro-batches), each with as many
    calls, whatever rows each rank kept. And no log-prob call (``labels`` / ``shift_labels``) held more tokens
    than GRPOTrainer's largest: ``per_device_train_batch_size`` rows of the generation batch's padded width.
    Generation calls count too: under FSDP ``generate`` keeps the ranks in step itself (``synced_gpus``); under DDP
    both ranks decode to max_completion_length because some row of each rank's 16+ rows always does."""
    assert ranks[0]["forward_passes"] == ranks[1]["forward_passes"]
    assert [c[:4] for c in ranks[0]["forward_calls"]] == [c[:4] for c in ranks[1]["forward_calls"]]
    for rank in ranks:
        kinds = {(model, kind) for model, kind, *_ in rank["forward_passes"]}
        assert {("policy", "generate"), ("policy", "logps")} | ({("ref", "logps")} if rank["beta"] else set()) <= kinds
        widths = {tuple(batch): width for batch, width in rank["widths"]}
        trl_call = {batch: rank["per_device_train_batch_size"] * width for batch, width in widths.items()}
        for model, kind, grad, batch, numel in rank["forward_calls"]:
            if kind == "logps":
                assert numel <= trl_call[tuple(batch)], (model, grad, batch, numel, trl_call[tuple(batch)])


def torchrun(out_dir, model_dir, *worker_args, timeout=300):
    """Run the worker on 2 CPU processes; return each rank's record and the parameters of rank 0 and 1."""
    run_two_processes(WORKER, model_dir, out_dir, *worker_args, timeout=timeout)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    params = [torch.load(out_dir / f"params{r}.pt") for r in range(2)]
    assert all(r["world"] == 2 and r["finite"] for r in ranks)
    assert ranks[0]["masks"] == ranks[1]["masks"] and ranks[0]["masks"]
    assert ranks[0]["iteration_masks"] == ranks[1]["iteration_masks"]  # each iteration's draw, on both ranks
    assert_same_forward_calls(ranks)
    for name, p in params[0].items():  # DDP kept the ranks in step
        torch.testing.assert_close(params[1][name], p, rtol=1e-6, atol=1e-7)
    return ranks, params[0]


@pytest.mark.parametrize("sampling,rate", [("systematic", 0.5), ("topk", 0.03)])
def test_two_ranks_agree_and_finish(tmp_path, tiny_model_dir, train_dataset, sampling, rate):
    ranks, _ = torchrun(tmp_path, tiny_model_dir, sampling, rate, 4)
    assert ranks[0]["speed_check_at"] == ranks[1]["speed_check_at"] == 2  # timed on both ranks, the same batch
    if sampling == "topk":  # one row kept in a batch of 32: one rank has nothing to train on
        assert any(0 in pair for pair in zip(ranks[0]["local_kept"], ranks[1]["local_kept"]))
    # Oracle: one process holding the same global batch (twice the rows per device) draws the same mask and
    # logs the same pruning metrics.
    args = cpu_config(tmp_path / "single", per_device_train_batch_size=16, beta=0.05, steps_per_generation=2,
                      gradient_accumulation_steps=2, num_iterations=2, completion_keep_rate=rate,
                      prune_sampling=sampling)
    single = DPPOTrainer(tiny_model_dir, random_reward, args=args, train_dataset=train_dataset)
    draw = ranks[0]["first_draw"]
    advantages = torch.tensor(draw["advantages"])
    lengths = {k: torch.tensor(ranks[0]["first_draw"][k] + ranks[1]["first_draw"][k]) for k in
               ("completion_lengths", "prompt_lengths")}
    columns = torch.arange(int(max(lengths["completion_lengths"].max(), lengths["prompt_lengths"].max())))
    output = {
        "advantages": advantages,
        "completion_mask": (columns[None] < lengths["completion_lengths"][:, None]).long(),
        "prompt_mask": (columns.flip(0)[None] < lengths["prompt_lengths"][:, None]).long(),
    }
    batch = GenerationBatch()
    single.keep_decision.draw(output, batch, advantages)
    single.keep_decision.log_metrics(batch, advantages)
    assert single.last_global_keep.int().tolist() == ranks[0]["masks"][0]
    # num_iterations 2: each iteration's own draw, the single process's too
    assert (batch.iteration_weights > 0).int().tolist() == ranks[0]["iteration_masks"][0]
    if sampling == "systematic":
        assert any(m[0] != m[1] for m in ranks[0]["iteration_masks"])  # not one mask reused
    logged = ranks[0]["first_log"]
    assert {"dppo/kept_fraction", "dppo/kept_token_fraction", "dppo/ess", "dppo/compute_saved"} <= set(
        single._metrics["train"]
    )
    for key, values in single._metrics["train"].items():  # one entry per iteration, averaged by TRL's log
        assert logged[key] == pytest.approx(sum(values) / len(values), rel=1e-6, abs=1e-9), key


@pytest.mark.slow
@pytest.mark.parametrize("sharing", [False, True])
def test_rows_moved_between_ranks_train_as_where_they_were(tmp_path, tiny_model_dir, sharing):
    """One generation batch (2 optimizer steps), balanced vs never balanced: the same masks and, up to float
    summation order, the same parameters. Without prefix sharing the balanced run moved rows and ended within 10%
    of the mean load wherever the unbalanced one was outside it; with it, groups move whole and the load (shared
    tokens) never grows."""
    flags = () if sharing else ("--no-prefix-sharing",)
    balanced, params = torchrun(tmp_path / "balanced", tiny_model_dir, "systematic", 0.3, 2, *flags)
    unbalanced, reference = torchrun(tmp_path / "unbalanced", tiny_model_dir, "systematic", 0.3, 2, "inf", *flags)
    assert balanced[0]["masks"] == unbalanced[0]["masks"]
    before, after = balanced[0]["rank_imbalance_before"], balanced[0]["rank_imbalance"]
    assert before == unbalanced[0]["rank_imbalance"]
    if sharing:
        assert all(a <= b for a, b in zip(after, before))
    else:
        assert max(before) > 1.1  # rows had to move
        assert all(a <= 1.1 for a in after) and balanced[0]["local_kept"] != unbalanced[0]["local_kept"]
    for name, p in reference.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6)


def test_a_length_dependent_rotary_keeps_rows_on_their_rank_and_runs_trls_padded_passes(tmp_path):
    """A dynamic NTK rotary (its frequencies follow a call's longest position, as Phi-3's longrope does) with
    pruning and packing asked for, in float64. Packing is off on both ranks, and no kept row leaves its rank
    although the ranks' loads differ enough that rows would move (by more than RANK_BALANCE_TOLERANCE); so each
    deferred pass runs at the rank's own padded width, and the kept rows' reference log-probs are TRL's padded
    pass over the rank's batch to float64 rounding, the oracle of the single-process test
    (tests/test_packing_models.py). The same pass one column wider, as a row moved to a wider rank is padded,
    differs by over 1e-9: the comparison can tell."""
    model_dir = save_tiny_rope(tmp_path / "model", "dynamic")
    ranks, _ = torchrun(tmp_path, model_dir, "systematic", 0.3, 4, "--reference-passes", "--float64")
    assert max(ranks[0]["rank_imbalance_before"]) > 1 + DPPOTrainer.RANK_BALANCE_TOLERANCE  # rows would move
    for rank in ranks:
        assert rank["packing"] is False
        assert len(rank["foreign_kept"]) == 2 and not any(rank["foreign_kept"])
        assert rank["rank_imbalance"] == rank["rank_imbalance_before"]
        errors = rank["reference_pass_errors"]
        assert len(errors["padded"]) == 2 and max(errors["padded"]) <= 1e-12, errors
        assert min(errors["wider"]) > 1e-9, errors


@pytest.mark.slow
def test_two_ranks_resume_with_prompt_pruning_as_if_never_stopped(tmp_path, tiny_model_dir):
    """The cut with the probe on two ranks, 12 steps uninterrupted vs 6 steps, checkpoint, stop, resume to 12: every
    rank generates the same number of groups at each step (m of its P candidates), both ranks share one decision,
    and the resumed run has the same candidates, acceptance sets, masks and parameters."""
    whole, params = torchrun(tmp_path / "whole", tiny_model_dir, "systematic", 0.5, 12, "--prompt-keep-rate", 0.5)
    split, resumed = torchrun(tmp_path / "split", tiny_model_dir, "systematic", 0.5, 12, "--prompt-keep-rate", 0.5,
                              "--stop", 6)
    assert whole[0]["steps"] == split[0]["steps"] == 12
    assert whole[0]["generated_groups"] == whole[1]["generated_groups"] == [2] * len(whole[0]["generated_groups"])
    assert whole[0]["prompt_decisions"] == whole[1]["prompt_decisions"]
    for rank in range(2):
        assert split[rank]["prompts"] == whole[rank]["prompts"] and split[rank]["masks"] == whole[rank]["masks"]
        assert split[rank]["prompt_decisions"] == whole[rank]["prompt_decisions"]
    for name, p in params.items():
        torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6)


# steps_per_generation 4 > gradient_accumulation_steps 2: a generation batch of 32 rows per rank, about 16 kept
# at rate 0.5, twice per_device_train_batch_size (8), so each deferred pass takes several forward calls. 8 steps:
# two generation batches (each trained num_iterations=2 times).
# Rows repeated (no prefix sharing): with it, whole groups move between ranks, and on this seed both ranks then
# keep as many rows, which would leave the check below nothing to catch. The other two-rank runs share prefixes.
SPG4 = ("--steps-per-generation", 4, "--no-prefix-sharing")
SPG4_RUN = ("systematic", 0.5, 8, *SPG4)


@pytest.fixture(scope="module")
def ddp_spg4(tmp_path_factory, tiny_model_dir):
    return torchrun(tmp_path_factory.mktemp("ddp-spg4"), tiny_model_dir, *SPG4_RUN, timeout=120)


@pytest.mark.slow
def test_ranks_keeping_different_rows_make_the_same_forward_calls(ddp_spg4):
    """torchrun checked that both ranks made the same calls and none larger than TRL's; here, that the check had
    something to catch: the ranks kept different numbers of rows, a deferred pass took more than one call, and
    one call holding all of a rank's kept rows would have been larger than TRL's."""
    ranks, _ = ddp_spg4
    assert any(a != b for a, b in zip(ranks[0]["local_kept"], ranks[1]["local_kept"]))
    deferred = [p for p in ranks[0]["forward_passes"] if p[1] == "logps" and not p[2]]
    assert deferred and all(p[-1] > 1 for p in deferred)
    per_device = ranks[0]["per_device_train_batch_size"]
    assert any(tokens > per_device * width for rank in ranks
               for tokens, (_, width) in zip(rank["local_kept_tokens"], rank["widths"], strict=True))


def test_fsdp2_rank_keeping_nothing_finishes(tmp_path, tiny_model_dir):
    """FSDP2 gathers parameters in every forward: with one row kept of 64 one rank has nothing to forward, and
    it makes its share of the calls with fillers (a missing call would hang the other rank's all-gather)."""
    ranks, _ = torchrun(tmp_path, tiny_model_dir, "topk", 0.01, 4, "--steps-per-generation", 4, "--fsdp", timeout=120)
    assert all(r["wrapped"].startswith("FSDP") for r in ranks)
    assert [sorted(kept) for kept in zip(ranks[0]["local_kept"], ranks[1]["local_kept"])] == [[0, 1]]


def test_fsdp2_entropy_filter_under_pruning_forwards_the_unkept_rows_in_step(tmp_path, tiny_model_dir):
    """Under the entropy filter each micro-step also forwards, without gradient, the rows of TRL's micro-batch that
    were not kept (for TRL's quantile): a rank with none forwards a filler, so both ranks make the same calls under
    FSDP2 (checked by ``torchrun``) and finish."""
    ranks, _ = torchrun(tmp_path, tiny_model_dir, "systematic", 0.5, 4, "--fsdp", "--top-entropy-quantile", 0.5,
                        "--no-speed-check", timeout=120)
    passes = ranks[0]["forward_passes"]
    before_a_micro_step = [a for a, b in zip(passes, passes[1:]) if a[1] == b[1] == "logps" and not a[2] and b[2]]
    assert len(before_a_micro_step) == 8  # every micro-step (2 batches x 2 micro-batches x 2 iterations)


@pytest.mark.slow
def test_fsdp2_trains_as_ddp(ddp_spg4, tmp_path, tiny_model_dir):
    """The same run (pruning, packing, rank balancing, spg 4 > GA 2, 8 steps) with the policy and the reference
    sharded by FSDP2 instead of DDP: the same masks, kept rows and forward calls, and the same parameters up to
    float summation order. FSDP2 reduce-scatters where DDP all-reduces (another order of the same sums): measured
    max |FSDP - DDP| = 9.4e-8 over all parameters, about one float32 ulp at 1, where training moved every
    parameter tensor by >= 3.6e-3; atol 1e-6, rtol 1e-4 leave 10x room and are still 1000x below the moves."""
    from transformers import AutoModelForCausalLM

    reference_ranks, reference = ddp_spg4
    ranks, params = torchrun(tmp_path, tiny_model_dir, *SPG4_RUN, "--fsdp", timeout=120)
    for rank in ranks:  # sharded by FSDP2 and not wrapped in DDP on top
        assert rank["wrapped"].startswith("FSDP") and "DistributedDataParallel" not in rank["wrapped"]
        for model in ("policy", "ref"):
            units = rank["fsdp_units"][model]
            assert "" in units and {"model.layers.0", "model.layers.1"} <= set(units), (model, units)
    assert (
        reference_ranks[0]["wrapped"] == "DistributedDataParallel" and reference_ranks[0]["fsdp_units"]["policy"] == []
    )
    for key in ("masks", "local_kept", "forward_passes"):
        assert [r[key] for r in ranks] == [r[key] for r in reference_ranks], key
    initial = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert set(params) == set(reference) == set(initial)
    for name, p in reference.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-6)
        assert (p - initial[name].detach()).abs().max() > 1e-3, name  # training moved it far past the tolerance


@pytest.mark.slow
def test_ranks_whose_floats_differ_in_the_last_bit_share_one_decision(tmp_path, tiny_model_dir):
    """Rank 1's scores moved up by one ulp before its keep decision and before they enter its prompt history (as
    on a machine whose math library rounds differently; it also turns the exact zeros of zero-spread groups into
    tiny positive scores, which changes which rows are eligible), under the ``balanced`` design and prompt
    pruning, ``beta=0``, 12 steps (the second epoch prunes prompts): rank
    1's own keep draw and its own acceptance probabilities differ from rank 0's, yet both ranks train on rank 0's
    decisions: the same masks, prompts, prompt weights and normalizers bit for bit, the same forward calls, no
    hang, the same parameters (torchrun checks masks, calls and parameters)."""
    ranks, _ = torchrun(tmp_path, tiny_model_dir, "balanced", 0.5, 12, "--prompt-keep-rate", 0.5, "--perturb-rank", 1,
                        "--beta", 0, "--prompt-score", "ema", timeout=180)
    assert ranks[0]["own_masks"] == ranks[0]["masks"]  # the main process's own decision is the shared one
    assert ranks[1]["own_masks"] != ranks[0]["own_masks"]  # one ulp changed rank 1's own draw
    assert ranks[1]["own_q"] != ranks[0]["own_q"]  # and its own acceptance probabilities
    assert ranks[0]["prompt_decisions"] == ranks[1]["prompt_decisions"] and ranks[0]["prompt_decisions"]
    assert max(w for weights, *_ in ranks[0]["prompt_decisions"] for w in weights) > 1.0  # prompts were cut


def test_two_ranks_audit_the_same_batches_with_the_same_sketch(tmp_path, tiny_model_dir):
    """The gradient audit on two ranks (every generation batch, a 256-direction sketch): both ranks hold the same
    reduced sketches, bit for bit, and the audited DPPO gradient is the sketch of what DDP's optimizer receives at
    the batch's first step (GA == steps_per_generation: that step takes the whole batch)."""
    from dppo_trl.core.audit import sketch_gradients

    torchrun(tmp_path, tiny_model_dir, "stratified", 0.5, 4, "--audit-sketch", 256)
    ranks = [torch.load(tmp_path / f"audit{r}.pt", weights_only=False) for r in range(2)]
    assert len(ranks[0]["audits"]) == 2 and not ranks[0]["sketch"].exact
    for (dppo0, grpo0), (dppo1, grpo1) in zip(ranks[0]["audits"], ranks[1]["audits"]):
        assert torch.equal(dppo0, dppo1) and torch.equal(grpo0, grpo1)
    generate_every = 2  # optimizer steps per generation batch: num_iterations 2 x (spg 2 / GA 2)
    for batch, (dppo, _) in enumerate(ranks[0]["audits"]):
        received = sketch_gradients(ranks[0]["sketch"], ranks[0]["steps"][batch * generate_every]).cpu()
        torch.testing.assert_close(dppo, received, rtol=1e-4, atol=1e-5 * float(received.abs().max()))
