"""The online gradient audit (``audit_every``): its math (``dppo_trl.audit``), that its two gradients are the ones
GRPOTrainer's and DPPO's optimizers receive, that training is unchanged by it, and that its bias statistic stays
within noise for the unbiased designs and grows for ``topk``."""

import math
import statistics

import pytest
import torch
from conftest import cpu_config, random_reward
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.audit import (
    RunningMoments,
    audited_batch,
    bias_z,
    compare_gradients,
    make_sketch,
    measured_error_scale,
    sketch_gradients,
    student_t_two_sided_p,
)
from dppo_trl.estimator import SUPPORTED_LOSS_TYPES

# ---------------------------------------------------------------- the math


@pytest.mark.parametrize("t", [0.1, 1.0, 3.0, 10.0, 100.0])
def test_student_t_tail_matches_its_closed_forms(t):
    assert student_t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, rel=1e-10)
    assert student_t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9, abs=1e-15)
    normal = 2 * (1 - statistics.NormalDist().cdf(min(t, 6.0)))
    assert student_t_two_sided_p(min(t, 6.0), 10**7) == pytest.approx(normal, rel=1e-4)


def moments_of(rows: torch.Tensor) -> RunningMoments:
    moments = RunningMoments()
    for row in rows:
        moments = moments.update(row)
    return moments


def test_running_moments_are_the_sample_mean_and_variance():
    rows = torch.randn(50, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    moments = moments_of(rows)
    assert moments.count == 50
    torch.testing.assert_close(moments.mean, rows.mean(0), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(moments.m2 / 49, rows.var(0), rtol=1e-12, atol=1e-14)


def test_bias_z_stays_within_noise_for_mean_zero_differences_and_grows_with_a_bias():
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(200, 256, generator=generator, dtype=torch.float64) * torch.linspace(0.1, 10, 256)
    assert bias_z(moments_of(noise[:1])) is None
    assert bias_z(moments_of(noise)) < 3.0  # Bonferroni over 256 directions: P(z > 3) <= 0.27%
    biased = noise.clone()
    biased[:, 17] += 0.8 * biased[:, 17].std()  # 0.8 standard deviations along one direction: t about 0.8 sqrt(n)
    growing = [bias_z(moments_of(biased[:n])) for n in (50, 100, 200)]
    assert growing[-1] > 6.0 and growing[-1] > growing[0]
    assert bias_z(moments_of(torch.zeros(5, 3))) == 0.0
    assert bias_z(moments_of(torch.ones(5, 3))) == 0.0  # no spread: no standard error, nothing to test


def test_audited_batches_are_every_nth_from_a_seeded_offset():
    for every in (1, 3, 7):
        for seed in range(4):
            hits = [b for b in range(50) if audited_batch(b, every, seed)]
            assert len({b % every for b in hits}) == 1 and len(hits) in (50 // every, 50 // every + 1)
            assert all(hits[i + 1] - hits[i] == every for i in range(len(hits) - 1))
    assert len({min(b for b in range(9) if audited_batch(b, 9, seed)) for seed in range(40)}) > 3
    assert not any(audited_batch(b, 0, 0) for b in range(10))


def named_random_gradients(seed, shapes=((300, 40), (40,), (1000, 30), (7,))):
    generator = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.randn(*shape, generator=generator, dtype=torch.float64), math.prod(shape))
            for i, shape in enumerate(shapes)]  # fmt: skip


def flat(named):
    return torch.cat([g.flatten().double() for _, g, _ in named])


def test_exact_sketch_is_the_concatenated_gradient_and_a_missing_gradient_is_zeros():
    named = named_random_gradients(0)
    sketch = make_sketch(sum(n for *_, n in named), 4096, exact_max=10**6, seed=3)
    assert sketch.exact
    torch.testing.assert_close(sketch_gradients(sketch, named), flat(named), rtol=0, atol=0)
    named[1] = ("p1", None, 40)
    assert torch.all(sketch_gradients(sketch, named)[12000:12040] == 0)


def test_countsketch_keeps_norms_and_cosines_within_its_stated_tolerance_and_is_the_same_everywhere():
    """Two gradients with cosine about 0.6: the sketch's norms within 6 x sqrt(1 / (2k)) relative and cosine within
    6 x sqrt(2 / k) of the exact values (k = 4096: about 6.6% and 13%; measured here well inside); the map is linear
    and fixed by its seed (two sketches built apart, as on two ranks, give identical numbers)."""
    a, noise = named_random_gradients(0), named_random_gradients(1)
    b = [(n, 0.75 * g + 0.6 * h, k) for (n, g, k), (_, h, _) in zip(a, noise)]
    k = 4096
    sketch = make_sketch(sum(n for *_, n in a), k, exact_max=0, seed=11)
    assert not sketch.exact and sketch.dim == k
    sa, sb = sketch_gradients(sketch, a), sketch_gradients(sketch, b)
    for exact, sketched in ((flat(a), sa), (flat(b), sb)):
        assert abs(float(sketched.norm()) / float(exact.norm()) - 1) < 6 * math.sqrt(1 / (2 * k))
    exact_cos = compare_gradients(flat(a), flat(b))["cosine"]
    assert abs(compare_gradients(sa, sb)["cosine"] - exact_cos) < 6 * math.sqrt(2 / k)
    again = make_sketch(sum(n for *_, n in a), k, exact_max=0, seed=11)
    assert torch.equal(sketch_gradients(again, b), sb)
    summed = [(n, g + h, m) for (n, g, m), (_, h, _) in zip(a, b)]
    torch.testing.assert_close(sketch_gradients(sketch, summed), sa + sb, rtol=1e-12, atol=1e-9)
    other_seed = make_sketch(sum(n for *_, n in a), k, exact_max=0, seed=12)
    assert not torch.equal(sketch_gradients(other_seed, b), sb)


def test_compare_gradients():
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert compare_gradients(g, g) == {"cosine": 1.0, "rel_error": 0.0}
    out = compare_gradients(torch.tensor([3.0, 0.0], dtype=torch.float64), g)
    assert out["cosine"] == pytest.approx(0.6) and out["rel_error"] == pytest.approx(0.8)
    assert compare_gradients(g, torch.zeros(2, dtype=torch.float64)) is None


def test_measured_error_scale_is_the_median_ratio_so_far():
    assert measured_error_scale([]) == 1.0
    assert measured_error_scale([2.0, 0.5, 4.0, math.nan]) == 2.0


# ---------------------------------------------------------------- the trainer


class AuditRecorder(DPPOTrainer):
    """Keeps each audit's two reduced gradient vectors (exact on the tiny model) and the keep-rate scale that each
    keep decision used."""

    def _record_audit(self, dppo, grpo, seconds):
        self.__dict__.setdefault("audits", []).append((dppo.clone(), grpo.clone()))
        super()._record_audit(dppo, grpo, seconds)

    def _measured_error_scale(self):
        scale = super()._measured_error_scale()
        self.__dict__.setdefault("scales", []).append((list(self._audit_records()["ratio"]), scale))
        return scale


class GradientsAtEachStep(TrainerCallback):
    """The flattened gradient (trainable parameters, in order) that the optimizer receives at each step."""

    def __init__(self):
        self.trainer, self.grads = None, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        params = [p for p in self.trainer.model.parameters() if p.requires_grad]
        self.grads.append(torch.cat([torch.zeros(p.numel()) if p.grad is None else p.grad.flatten() for p in params])
                          .double())  # fmt: skip


def run(cls, config_cls, tmp_path, model_dir, dataset, reward=random_reward, **overrides):
    recorder = GradientsAtEachStep()
    args = cpu_config(tmp_path, cls=config_cls, max_grad_norm=0.0, **overrides)
    trainer = cls(model_dir, reward, args=args, train_dataset=dataset, callbacks=[recorder])
    recorder.trainer = trainer
    trainer.train()
    return trainer, recorder.grads


def assert_close_vectors(actual, expected):
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("loss_type", SUPPORTED_LOSS_TYPES)
def test_audited_gradients_are_what_grpo_and_dppo_optimizers_receive(tmp_path, tiny_model_dir, train_dataset,
                                                                     loss_type, beta):  # fmt: skip
    """GA == steps_per_generation: one optimizer step takes the generation batch. The audit's GRPO gradient is
    GRPOTrainer's accumulated gradient on the same batch, its DPPO gradient the one DPPO's optimizer receives."""
    common = dict(max_steps=1, beta=beta, loss_type=loss_type, steps_per_generation=2, gradient_accumulation_steps=2)
    _, grpo_grads = run(GRPOTrainer, GRPOConfig, tmp_path / "g", tiny_model_dir, train_dataset, **common)
    dppo, dppo_grads = run(AuditRecorder, DPPOConfig, tmp_path / "d", tiny_model_dir, train_dataset, audit_every=1,
                           **common)  # fmt: skip
    (audit_dppo, audit_grpo), = dppo.audits
    assert_close_vectors(audit_grpo, grpo_grads[0])
    assert_close_vectors(audit_dppo, dppo_grads[0])
    assert not torch.allclose(audit_dppo, audit_grpo)  # half the rows are pruned: the two differ


@pytest.mark.parametrize("loss_type,checkpointing", [("dapo", None), ("grpo", None), ("dapo", {"use_reentrant": True})])
def test_with_fewer_accumulation_steps_the_audit_sums_the_batchs_steps(tmp_path, tiny_model_dir, train_dataset,
                                                                       loss_type, checkpointing):  # fmt: skip
    """GA 1 < steps_per_generation 2, learning rate 0 (the batch's two steps at fixed parameters): the audited
    gradients are the sums of the two steps' gradients, GRPO's and DPPO's (also through the backward that
    reentrant gradient checkpointing needs)."""
    common = dict(max_steps=2, beta=0.05, loss_type=loss_type, steps_per_generation=2, gradient_accumulation_steps=1,
                  learning_rate=0.0)  # fmt: skip
    if checkpointing is not None:
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing)
    _, grpo_grads = run(GRPOTrainer, GRPOConfig, tmp_path / "g", tiny_model_dir, train_dataset, **common)
    dppo, dppo_grads = run(AuditRecorder, DPPOConfig, tmp_path / "d", tiny_model_dir, train_dataset, audit_every=1,
                           **common)  # fmt: skip
    (audit_dppo, audit_grpo), = dppo.audits
    assert_close_vectors(audit_grpo, grpo_grads[0] + grpo_grads[1])
    assert_close_vectors(audit_dppo, dppo_grads[0] + dppo_grads[1])


@pytest.mark.parametrize("checkpointing", [None, {"use_reentrant": False}, {"use_reentrant": True}])
def test_training_with_the_audit_is_training_without_it(tmp_path, tiny_model_dir, train_dataset, checkpointing):
    """Bit for bit: parameters, losses and every logged metric other than the audit's (GA < spg, KL, packing), also
    under gradient checkpointing (reentrant checkpointing refuses ``torch.autograd.grad``: the audit's backward
    goes into emptied ``.grad`` slots that are put back)."""
    common = dict(max_steps=4, beta=0.05, steps_per_generation=2, gradient_accumulation_steps=1)
    if checkpointing is not None:
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing)
    plain, _ = run(DPPOTrainer, DPPOConfig, tmp_path / "a", tiny_model_dir, train_dataset, **common)
    audited, _ = run(AuditRecorder, DPPOConfig, tmp_path / "b", tiny_model_dir, train_dataset, audit_every=1,
                     **common)  # fmt: skip
    assert len(audited.audits) == 2
    for (name, p), (_, q) in zip(plain.model.named_parameters(), audited.model.named_parameters()):
        assert torch.equal(p, q), name
    strip = lambda h: {k: v for k, v in h.items() if "audit" not in k and "runtime" not in k and "per_second" not in k
                       and k != "step_time"}  # noqa: E731  fmt: skip
    assert [strip(h) for h in plain.state.log_history] == [strip(h) for h in audited.state.log_history]
    assert any("dppo/audit_cosine" in h for h in audited.state.log_history)


def test_the_audit_logs_its_metrics_and_the_summary_line_reports_it(tmp_path, tiny_model_dir, train_dataset, capsys):
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, max_steps=6, audit_every=2,
                     steps_per_generation=1, gradient_accumulation_steps=1)  # fmt: skip
    logged = [h for h in trainer.state.log_history if "dppo/audit_cosine" in h]
    assert len(logged) == len(trainer.audits) == 3
    for h in logged:
        assert -1 <= h["dppo/audit_cosine"] <= 1 and h["dppo/audit_rel_error"] >= 0 and h["dppo/audit_seconds"] > 0
        assert h["dppo/audit_noise_to_signal"] == pytest.approx(h["dppo/audit_rel_error"] / h["dppo/pruning_error"])
    assert sum("dppo/audit_bias_z" in h for h in logged) == 2  # from the second audit on
    cosines = [compare_gradients(d, g)["cosine"] for d, g in trainer.audits]
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPPO summary")][-1]
    assert f"audits 3, median cosine {statistics.median(cosines):.3f}, worst bias z" in line


def test_the_measured_error_source_uses_earlier_audits_only(tmp_path, tiny_model_dir, train_dataset):
    """adaptive_keep_error_source='audit': batch b's target is adaptive_keep_error / median(ratios of batches < b)."""
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, max_steps=5, audit_every=1,
                     steps_per_generation=1, gradient_accumulation_steps=1, adaptive_keep_error=0.5,
                     adaptive_keep_error_source="audit")  # fmt: skip
    ratios = trainer._audit_records()["ratio"]
    assert len(trainer.scales) == 5 and len(ratios) == 5
    for b, (seen, scale) in enumerate(trainer.scales):
        assert seen == ratios[:b]
        assert scale == measured_error_scale(ratios[:b])
    assert trainer.scales[0][1] == 1.0 and trainer.scales[-1][1] != 1.0


# ---------------------------------------------------------------- the bias statistic on a tiny model


def has_a_digit(completions, **kwargs):
    """A reward that depends on the content (whether a digit appears), so the rows a biased design drops are not
    independent of their gradients."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


@pytest.mark.parametrize("sampling,biased", [("stratified", False), ("systematic", False), ("topk", True)])
def test_bias_z_stays_within_noise_for_unbiased_designs_and_grows_for_topk(tmp_path, tiny_model_dir, train_dataset,
                                                                           sampling, biased):  # fmt: skip
    """150 audited generation batches (16 rows, groups of 8) at fixed parameters (learning rate 0), compared exactly:
    the bias z of an unbiased design stays below 4 (Bonferroni-corrected: exceeded with probability below 1e-4),
    topk's exceeds it (it drops the small-|A| rows unweighted, so E[g_dppo] != g_grpo; measured about 8 here)."""
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, reward=has_a_digit,
                     max_steps=150, audit_every=1, steps_per_generation=1, gradient_accumulation_steps=1,
                     learning_rate=0.0, prune_sampling=sampling, num_generations=8, per_device_train_batch_size=16,
                     logging_steps=150)  # fmt: skip
    z = bias_z(trainer._audit_moments)
    assert trainer._audit_moments.count == 150 and trainer._audit_sketch.exact
    assert (z > 4.0) if biased else (z < 4.0), z


def test_a_resumed_run_goes_on_with_the_audit_history(tmp_path, tiny_model_dir, train_dataset):
    """Killed after 3 of 6 steps and resumed: the same audits, bias statistic and measured-error scales (hence
    keep rates, with adaptive_keep_error_source='audit') as the uninterrupted run."""
    from conftest import StopAt

    settings = dict(max_steps=6, audit_every=1, steps_per_generation=1, gradient_accumulation_steps=1,
                    adaptive_keep_error=0.5, adaptive_keep_error_source="audit", save_strategy="steps", save_steps=3)
    whole, _ = run(AuditRecorder, DPPOConfig, tmp_path / "whole", tiny_model_dir, train_dataset, **settings)
    args = cpu_config(tmp_path / "split", max_grad_norm=0.0, **settings)
    first = AuditRecorder(tiny_model_dir, random_reward, args=args, train_dataset=train_dataset, callbacks=[StopAt(3)])
    first.train()
    second = AuditRecorder(tiny_model_dir, random_reward, args=args, train_dataset=train_dataset)
    second.train(resume_from_checkpoint=str(tmp_path / "split" / "out" / "checkpoint-3"))
    assert second._audit_moments.count == whole._audit_moments.count == 6
    torch.testing.assert_close(second._audit_moments.mean, whole._audit_moments.mean, rtol=1e-5, atol=1e-9)
    for key in ("cosine", "ratio", "bias_z"):
        assert second._audit_records()[key] == pytest.approx(whole._audit_records()[key], rel=1e-5), key
    assert [s for _, s in first.scales + second.scales] == pytest.approx([s for _, s in whole.scales], rel=1e-5)
