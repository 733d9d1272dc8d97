"""``num_iterations`` > 1 (TRL's ``mu``): each iteration of a generation batch trains on its own, independent draw
of the keep mask, all drawn when the batch is generated; the old-policy log-probs are computed once, before the
first update, for the rows some iteration keeps (docs/estimator.md, "Reusing a generation").

The oracle, against GRPOTrainer in float64 end to end: at the parameters each iteration starts from (those the run
reached), the expectation of DPPO's gradient over that iteration's masks (every Poisson mask enumerated) is
GRPOTrainer's gradient of the whole generation batch, on GRPOTrainer's own batch, old log-probs and micro-batches.
A mask reused across iterations fails it: iteration 2 starts from parameters that depend on it."""

import pytest
import torch
from support.configs import float64_settings
from support.marks import slow_unless
from support.models import save_tiny_hybrid
from support.oracle import as_float64, assert_exact, dppo_loss_and_grad, flat_gradient
from support.outcomes import poisson_outcomes
from support.recording import OptimizerGradients, wrap
from support.training import StopAt, build
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.core.estimator import SUPPORTED_LOSS_TYPES


def _cloned(batch: dict) -> dict:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class GRPOWithItsBatch(GRPOTrainer):
    """GRPOTrainer keeping its first generation batch as scored (``generated``) and as split into its micro-batches
    (``microbatches``)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training and "generated" not in self.__dict__:
            self.generated = _cloned(out)
        return out

    def _prepare_inputs(self, generation_batch):
        out = super()._prepare_inputs(generation_batch)
        if self.model.training and "microbatches" not in self.__dict__:
            self.microbatches = [_cloned(mb) for mb in self._buffered_inputs]
        return out


class DPPOWithItsDraws(DPPOTrainer):
    """DPPOTrainer keeping its first generation batch's decision (``decision``: ``GenerationBatch``) and what its
    scoring returned (``scored``: with the deferred passes' log-probs)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        wrap(self.keep_decision, "draw", self._keep_first_decision)

    def _keep_first_decision(self, draw, output, batch, scores):
        draw(output, batch, scores)
        self.__dict__.setdefault("decision", batch)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training and "scored" not in self.__dict__:
            self.scored = _cloned({k: v for k, v in out.items() if isinstance(v, torch.Tensor)})
        return out


class ParametersAtEachStep(TrainerCallback):
    """The trainable parameters before the first optimizer step and after each one."""

    def __init__(self):
        self.model, self.snapshots = None, []

    def _snapshot(self):
        self.snapshots.append({n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad})

    def on_train_begin(self, args, state, control, **kwargs):
        self._snapshot()

    def on_step_end(self, args, state, control, **kwargs):
        self._snapshot()


def one_generation(tmp_path, model_dir, dataset, iterations, ga, experts_implementation=None, **settings):
    """One generation batch (8 rows: 2 prompts x 4, spg 2) trained ``iterations`` times by GRPOTrainer and by
    DPPOTrainer (Poisson keep masks at 0.5, floor 0.1), float64, AdamW at 0.05 (the ratios move off 1 and clip).
    Returns (grpo, dppo, dppo's parameters at each optimizer step, dppo's gradient at each optimizer step)."""
    common = dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
                  gradient_accumulation_steps=ga, num_iterations=iterations, max_steps=iterations * 2 // ga,
                  learning_rate=0.05, epsilon=0.2, max_grad_norm=0.0, logging_steps=1, **float64_settings(),
                  **settings)
    if experts_implementation:
        common["model_init_kwargs"]["experts_implementation"] = experts_implementation
    grpo = build(GRPOWithItsBatch, tmp_path / "grpo", model_dir, dataset, config_cls=GRPOConfig, **common)
    grpo.train()
    parameters, gradients = ParametersAtEachStep(), OptimizerGradients()
    dppo = build(DPPOWithItsDraws, tmp_path / "dppo", model_dir, dataset, callbacks=[parameters, gradients],
                 completion_keep_rate=0.5, keep_floor=0.1, prune_sampling="poisson", speed_check=False, **common)
    parameters.model = gradients.model = dppo.model
    dppo.train()
    return grpo, dppo, parameters.snapshots, gradients.flat()


def grpo_gradient(grpo, parameters) -> torch.Tensor:
    """GRPOTrainer's gradient of its whole generation batch (every micro-batch of its split) at ``parameters``."""
    grpo.model.load_state_dict(parameters, strict=False)
    grpo.model.zero_grad()
    for microbatch in grpo.microbatches:
        GRPOTrainer._compute_loss(grpo, grpo.model, microbatch).backward()
    return flat_gradient(grpo.model)


def dppo_gradient(dppo, batch, weights):
    """DPPO's gradient of ``batch`` with the rows of ``weights`` > 0 kept at those weights, on TRL's split of the
    run (the RNG state its shuffle drew from: ``bnpo``'s counts and the entropy filter's quantile are over it)."""
    torch.set_rng_state(dppo.decision.trl_split_rng_state)
    return dppo_loss_and_grad(dppo, batch, weights > 0, weights)[1]


def expected_gradient(dppo, batch, pi):
    """The expectation of DPPO's gradient of ``batch`` over every Poisson mask of ``pi``."""
    outcomes = list(poisson_outcomes(pi))
    assert sum(p for p, *_ in outcomes) == pytest.approx(1.0)
    return sum(p * dppo_gradient(dppo, batch, weights) for p, _, weights in outcomes)


CASES = [
    # GA 1 < spg 2, KL on, every loss type
    *[slow_unless(lt == "dapo", lt, 0.05, 2, 1, {}) for lt in SUPPORTED_LOSS_TYPES],
    # one optimizer step an iteration (GA = spg), three iterations
    slow_unless(True, "dapo", 0.0, 3, 2, {}),
    slow_unless(False, "grpo", 0.05, 3, 1, {}),
    # the entropy filter (TRL's split; the rows an iteration did not keep forwarded for its quantile)
    slow_unless(True, "bnpo", 0.0, 2, 2, dict(top_entropy_quantile=0.5)),
    slow_unless(False, "dapo", 0.05, 2, 1, dict(top_entropy_quantile=0.5, entropy_coef=0.01)),
]


@pytest.mark.parametrize("loss_type,beta,iterations,ga,option", CASES)
def test_each_iterations_expected_gradient_is_grpos_at_the_parameters_it_starts_from(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs, loss_type, beta, iterations, ga, option
):
    grpo, dppo, snapshots, gradients = one_generation(tmp_path, tiny_model_dir, train_dataset, iterations, ga,
                                                      loss_type=loss_type, beta=beta, **option)
    assert_each_iteration_is_grpos(grpo, dppo, snapshots, gradients, iterations, ga)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["moe", "lfm2"])
def test_each_iteration_is_grpos_on_a_moe_and_a_hybrid_model(tmp_path, tiny_moe_dir, train_dataset, exact_logprobs,
                                                              model):
    """The oracle above on a mixture of experts (its router loss off: not reweighted, docs/estimator.md section 2)
    and a hybrid recurrent model (LFM2's convolution layers: one sequence per packed row), GA 1 < spg 2."""
    model_dir = tiny_moe_dir if model == "moe" else save_tiny_hybrid(tmp_path / "model", model)
    # The grouped expert kernel takes no float64: the experts' eager loop does. LFM2 computes its norms partly in
    # float32, hence 1e-6 of the gradient's norm there.
    experts = dict(experts_implementation="eager", router_aux_loss_coef=0.0) if model == "moe" else {}
    grpo, dppo, snapshots, gradients = one_generation(tmp_path, model_dir, train_dataset, 2, 1, **experts)
    assert_each_iteration_is_grpos(grpo, dppo, snapshots, gradients, 2, 1,
                                   close=assert_exact if model == "moe" else relatively_close(1e-6))


def relatively_close(tolerance):
    """A comparison of two gradients to ``tolerance`` of the reference's norm."""

    def close(value, reference):
        assert float((value.double() - reference.double()).norm() / reference.double().norm()) < tolerance

    return close


def assert_each_iteration_is_grpos(grpo, dppo, snapshots, gradients, iterations, ga, close=assert_exact):
    """The first generation batch ``grpo`` and ``dppo`` trained (the same completions): DPPO's old-policy log-probs
    are GRPO's on the rows some iteration keeps and were never computed for the others; at the parameters each
    iteration started from (``snapshots``), the expectation of DPPO's gradient over that iteration's masks is
    GRPOTrainer's gradient; with one optimizer step an iteration (GA 2), the run's own step is the gradient of the
    mask it drew for that iteration. With the draws independent across iterations
    (``test_the_iterations_masks_are_independent_draws_of_the_same_design``), the parameters an iteration starts
    from do not depend on its mask: each iteration's expected step is GRPO's at those parameters."""
    batch, decision, scored = grpo.generated, dppo.decision, dppo.scored
    assert torch.equal(scored["completion_ids"], batch["completion_ids"])  # the same generation batch
    assert decision.iteration_weights.shape == (iterations, 8)

    # The old-policy log-probs: once, at the generation's parameters, for the rows some iteration keeps (GRPO's to
    # float64 rounding); never for a row no iteration keeps (TRL's placeholder zeros stay).
    union = decision.keep
    assert torch.equal(union, (decision.iteration_weights > 0).any(0))
    rows = scored["dppo_row"]
    old = scored["old_per_token_logps"]
    close(old[union[rows]], batch["old_per_token_logps"][rows[union[rows]]])
    assert not old[~union[rows]].any()

    pi = decision.keep_probabilities
    assert ((pi > 0) & (pi < 1)).sum() >= 3  # a genuinely random design
    steps_per_iteration = 2 // ga
    dppo.model.train()
    for k in range(iterations):
        start = snapshots[k * steps_per_iteration]  # the parameters iteration k starts from
        assert k == 0 or any(not torch.equal(start[n], snapshots[0][n]) for n in start)
        full = grpo_gradient(grpo, start)
        assert full.abs().sum() > 0
        dppo.model.load_state_dict(start, strict=False)
        # TRL's advantages are float32: A / pi rounds there at 3e-8; in float64 the oracle is exact.
        close(expected_gradient(dppo, as_float64(batch), pi), full)
        if ga == 2:  # the run's own step of iteration k is its drawn mask's gradient (one step takes the batch)
            close(gradients[k * steps_per_iteration], dppo_gradient(dppo, batch, decision.iteration_weights[k]))


def test_a_run_resumed_between_iterations_draws_each_remaining_iteration_afresh(
    tmp_path, tiny_model_dir, train_dataset, exact_logprobs
):
    """num_iterations 3, stopped after the first iteration (a checkpoint at step 1) and resumed: TRL's trainer
    generates a new batch at a resume (its buffer is not saved) and trains it 3 times, and so does DPPO, each
    iteration with its own draw. GRPOTrainer resumed from the same checkpoint generates the same batch, and the
    oracle above holds for the resumed generation."""
    common = dict(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2,
                  gradient_accumulation_steps=2, num_iterations=3, max_steps=4, learning_rate=0.05, epsilon=0.2,
                  max_grad_norm=0.0, logging_steps=1, beta=0.05, **float64_settings())
    pruning = dict(completion_keep_rate=0.5, keep_floor=0.1, prune_sampling="poisson", speed_check=False)
    build(DPPOWithItsDraws, tmp_path / "dppo", tiny_model_dir, train_dataset, callbacks=[StopAt(1)], **pruning,
          **common).train()
    checkpoint = str(tmp_path / "dppo" / "out" / "checkpoint-1")
    parameters, gradients = ParametersAtEachStep(), OptimizerGradients()
    dppo = build(DPPOWithItsDraws, tmp_path / "dppo", tiny_model_dir, train_dataset,
                 callbacks=[parameters, gradients], **pruning, **common)
    parameters.model = gradients.model = dppo.model
    dppo.train(resume_from_checkpoint=checkpoint)
    assert dppo.state.global_step == 4 and len(gradients.steps) == 3
    grpo = build(GRPOWithItsBatch, tmp_path / "grpo", tiny_model_dir, train_dataset, config_cls=GRPOConfig,
                 **{**common, "max_steps": 3})
    grpo.train(resume_from_checkpoint=checkpoint)
    assert_each_iteration_is_grpos(grpo, dppo, parameters.snapshots, gradients.flat(), 3, 2)


def test_the_iterations_masks_are_independent_draws_of_the_same_design(tmp_path, tiny_model_dir, train_dataset):
    """Over 3000 generation positions: each iteration keeps row n with frequency ``pi_n`` and two iterations keep it
    together with frequency ``pi_n ** 2`` (within 4.5 binomial SE), where one mask reused would give ``pi_n``."""
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, completion_keep_rate=0.5,
                    num_iterations=3, steps_per_generation=2, gradient_accumulation_steps=2)
    scores = torch.tensor([1.3, -0.2, 0.7, -0.9, 0.05, 0.4, -1.6, 0.0])
    lengths = torch.tensor([[4, 5, 5], [4, 3, 3], [4, 6, 6], [4, 2, 2], [4, 6, 6], [4, 1, 1], [4, 4, 4], [4, 3, 3]])
    from dppo_trl.components.generation_batch import GenerationBatch

    batch = GenerationBatch(row_tokens=lengths, rewards_per_func=None)
    draws = []
    for position in range(3000):
        trainer.state.global_step = position
        keeps, pi, _ = trainer.keep_decision.decide(scores, batch)
        draws.append(keeps)
    keeps = torch.stack(draws).double()  # (draws, iterations, rows)
    assert pi[7] == 0 and ((pi > 0) & (pi < 1)).sum() >= 4
    n = keeps.size(0)
    for k in range(3):
        se = (pi * (1 - pi) / n).sqrt().clamp(min=1e-12)
        assert ((keeps[:, k].mean(0) - pi).abs() <= 4.5 * se + 1e-12).all()
    for a, b in ((0, 1), (0, 2), (1, 2)):
        joint, expected = (keeps[:, a] * keeps[:, b]).mean(0), pi**2
        se = (expected * (1 - expected) / n).sqrt().clamp(min=1e-12)
        assert ((joint - expected).abs() <= 4.5 * se + 1e-12).all()


def test_the_speed_check_counts_every_iteration_and_says_so(tmp_path, tiny_model_dir, train_dataset, capsys):
    """At num_iterations 2 the speed check times the batch's log-prob passes once and its gradient passes once per
    iteration, for GRPO and DPPO alike (``core.audit.projected_time_ratios``), and the summary line says so."""
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, completion_keep_rate=0.5, num_iterations=2,
                    steps_per_generation=2, gradient_accumulation_steps=2, max_steps=4, beta=0.05)
    trainer.train()
    records = trainer.audit_ledger.records
    assert len(records["step_time_ratio"]) == 1 and records["speed_check_at"] is not None
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPPO summary")][-1]
    assert "1 batch timed; each generation batch trained num_iterations=2 times, every iteration counted" in line
