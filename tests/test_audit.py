"""The online gradient audit (``audit_every``): its math (``dppo_trl.core.audit``), that its two gradients are the ones
GRPOTrainer's and DPPO's optimizers receive, that they share their randomness (dropout off in both: with every row
kept they differ by float rounding), that training is unchanged by it, that a batch without signal is not compared,
and that its bias alarm fires for ``topk`` and, at its measured false-alarm rate, not for the unbiased designs."""

import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
from support.marks import FAST_LOSS_TYPES, slow_unless
from support.recording import recording
from support.rewards import coarse_reward
from support.training import StopAt, build, train, train_with_gradients
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.core.audit import (
    BIAS_ALARM_MIN_AUDITS,
    BIAS_ALARM_T,
    audited_batch,
    bias_alarm,
    bias_t,
    compare_gradients,
    dropout_disabled,
    make_sketch,
    PhaseSeconds,
    measured_error_scale,
    projected_time_ratios,
    sketch_gradients,
    step_ratio_at_share,
)
from dppo_trl.core.estimator import SUPPORTED_LOSS_TYPES

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

# ---------------------------------------------------------------- the math


def test_bias_t_is_the_student_t_of_the_projections():
    r = torch.randn(30, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.2 - 0.05
    expected = float(r.mean() / (r.std() / math.sqrt(30)))
    assert bias_t(r.tolist()) == pytest.approx(expected, rel=1e-12)
    assert bias_t([]) is None and bias_t([0.3]) is None
    assert bias_t([0.0, 0.0, 0.0]) == 0.0
    assert bias_t([-0.2, -0.2]) == -math.inf and bias_t([0.1, 0.1, 0.1]) == math.inf


def test_the_bias_alarm_fires_beyond_its_threshold_from_its_minimum_number_of_audits():
    shrunk = [-0.3, -0.31, -0.29] * 10  # t about -70: a shrinkage on every batch
    fired = [n for n in range(1, 31) if bias_alarm(shrunk[:n])]
    assert fired[0] == BIAS_ALARM_MIN_AUDITS and fired == list(range(BIAS_ALARM_MIN_AUDITS, 31))
    noise = [0.1, -0.1] * 10
    assert abs(bias_t(noise)) < BIAS_ALARM_T and not bias_alarm(noise)


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
            for i, shape in enumerate(shapes)]


def flat(named):
    return torch.cat([g.flatten().double() for _, g, _ in named])


def test_exact_sketch_is_the_concatenated_gradient_and_a_missing_gradient_is_zeros():
    named = named_random_gradients(0)
    sketch = make_sketch(sum(n for *_, n in named), 4096, exact_max=10**6, seed=3)
    assert sketch.exact
    torch.testing.assert_close(sketch_gradients(sketch, named), flat(named), rtol=0, atol=0)
    other = named_random_gradients(1)
    total = sketch_gradients(sketch, other)
    assert sketch_gradients(sketch, named, out=total) is total  # added into the running sum, on the CPU
    torch.testing.assert_close(total, flat(named) + flat(other), rtol=0, atol=0)
    assert total.device.type == "cpu" and total.dtype == torch.float64
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


@pytest.mark.parametrize("seed", [2**62, 2**63 - 1, 2**64 + 3])
def test_countsketch_takes_any_training_seed(seed):
    """``torch.Generator.manual_seed`` takes 64 bits: the per-chunk seed is reduced modulo 2^63 (it overflowed from
    about 2^44 on); the sketch is still a fixed linear map that keeps norms within its tolerance."""
    named = named_random_gradients(0)
    k = 4096
    sketch = make_sketch(sum(n for *_, n in named), k, exact_max=0, seed=seed)
    sketched = sketch_gradients(sketch, named)
    assert torch.equal(sketched, sketch_gradients(sketch, named))
    assert abs(float(sketched.norm()) / float(flat(named).norm()) - 1) < 6 * math.sqrt(1 / (2 * k))


def test_compare_gradients():
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert compare_gradients(g, g) == {"cosine": 1.0, "rel_error": 0.0, "projection": 0.0}
    out = compare_gradients(torch.tensor([3.0, 0.0], dtype=torch.float64), g)
    assert out["cosine"] == pytest.approx(0.6) and out["rel_error"] == pytest.approx(0.8)
    assert out["projection"] == pytest.approx(((3 - 3) * 3 + (0 - 4) * 4) / 25)  # -0.64: shrunk along g
    assert compare_gradients(0.5 * g, g)["projection"] == pytest.approx(-0.5)
    assert compare_gradients(g, torch.zeros(2, dtype=torch.float64)) is None


def test_measured_error_scale_is_the_median_ratio_so_far():
    assert measured_error_scale([]) == 1.0
    assert measured_error_scale([2.0, 0.5, 4.0, math.nan]) == 2.0


def test_dropout_disabled_turns_every_kind_of_dropout_off_and_restores_it():
    """A Qwen2 with attention dropout (a float its attention layers copy from the config and pass to the kernel
    while training) and LoRA dropout (``nn.Dropout`` modules): inside, a forward in train mode is the eval-mode
    forward, ``model.training`` stays True; after, every module's mode, ``p`` and rate are as they were."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5)
    base = Qwen2ForCausalLM(config)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    model.train()
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    modes = {name: (m.training, getattr(m, "p", None)) for name, m in model.named_modules()}
    assert not torch.equal(model(x).logits, model(x).logits)  # dropout on
    with dropout_disabled(model):
        assert model.training
        inside = model(x).logits
        assert torch.equal(inside, model(x).logits)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(inside.detach(), model(x).logits, rtol=0, atol=0)
    model.train()
    assert {name: (m.training, getattr(m, "p", None)) for name, m in model.named_modules()} == modes
    assert base.config.attention_dropout == 0.5
    assert all(layer.self_attn.attention_dropout == 0.5 for layer in base.model.layers)
    assert not torch.equal(model(x).logits, model(x).logits)


@pytest.mark.slow
def test_the_bias_alarms_false_alarm_rate_over_seeded_runs():
    """The alarm (|bias t| > BIAS_ALARM_T from the BIAS_ALARM_MIN_AUDITS-th counted audit on, checked at every
    audit) over 24 audits of 150 seeded runs, each on simulated batches of its own row-gradient geometry
    (``bench_audit.simulated_projections``: the package's designs, exact linear gradients): the unbiased designs
    raise it in at most 5% of the runs (``bench_audit_alarm.json`` measures it over 500 runs); topk at keep 0.3 in
    about half (27 of these 50): the sign and size of its bias along GRPO's gradient depend on the run's geometry
    (dropping a group's majority rows can lengthen the gradient as well as shorten it), while on the tiny model
    and on SmolLM2 it is a shrinkage that alarms at once (the trainer test below, ``benchmarks.md``)."""
    from bench_audit import first_alarm, simulated_projections

    seeds = 150
    for design in ("stratified", "systematic", "poisson"):
        alarms = [first_alarm(simulated_projections(design, 0.3, 24, seed)) for seed in range(seeds)]
        assert sum(a is not None for a in alarms) <= 0.05 * seeds, design
    detected = [first_alarm(simulated_projections("topk", 0.3, 24, seed)) for seed in range(50)]
    assert sum(a is not None for a in detected) >= 0.4 * 50


def test_the_audit_figures_of_usage_md_are_rendered_from_their_json():
    """docs/usage.md's audit section quotes its cost and the alarm's worst false-alarm rates from bench_audit*.json
    (``render_docs.MORE_DOCS``): they equal what the JSON gives, and no marker starts a line or sits in code."""
    import render_docs

    usage = Path(__file__).parent.parent / "docs" / "usage.md"
    text = usage.read_text()
    specs = {m["spec"].split()[0] for m in render_docs.MARKER.finditer(text)}
    assert {"bench_audit", "bench_audit_alarm_worst"} <= specs
    assert not render_docs.stale([usage], render_docs.load_results())
    for line in text.splitlines():
        for m in render_docs.MARKER.finditer(line):
            assert m.start() > len(line) - len(line.lstrip()) or m["spec"] in render_docs.TABLES, line
            assert line[: m.start()].count("`") % 2 == 0, line


# ---------------------------------------------------------------- the trainer


# Each audit's two reduced gradient vectors (exact on the tiny model) and the keep-rate scale that each keep
# decision used.
AuditRecorder = recording(record_audits=True, record_error_scales=True)


def run(cls, config_cls, tmp_path, model_dir, dataset, **kwargs):
    """(trainer, the flat gradient its optimizer received at each step), without gradient clipping."""
    return train_with_gradients(cls, tmp_path, model_dir, dataset, config_cls=config_cls, **kwargs)


def assert_close_vectors(actual, expected):
    scale = float(expected.abs().max())
    assert scale > 0
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("loss_type,beta", [slow_unless(loss_type in FAST_LOSS_TYPES, loss_type, beta)
                                            for beta in (0.0, 0.05) for loss_type in SUPPORTED_LOSS_TYPES])
def test_audited_gradients_are_what_grpo_and_dppo_optimizers_receive(tmp_path, tiny_model_dir, train_dataset,
                                                                     loss_type, beta):
    """GA == steps_per_generation: one optimizer step takes the generation batch. The audit's GRPO gradient is
    GRPOTrainer's accumulated gradient on the same batch, its DPPO gradient the one DPPO's optimizer receives."""
    common = dict(max_steps=1, beta=beta, loss_type=loss_type, steps_per_generation=2, gradient_accumulation_steps=2)
    _, grpo_grads = run(GRPOTrainer, GRPOConfig, tmp_path / "g", tiny_model_dir, train_dataset, **common)
    dppo, dppo_grads = run(AuditRecorder, DPPOConfig, tmp_path / "d", tiny_model_dir, train_dataset, audit_every=1,
                           **common)
    (audit_dppo, audit_grpo), = dppo.audits
    assert_close_vectors(audit_grpo, grpo_grads[0])
    assert_close_vectors(audit_dppo, dppo_grads[0])
    assert not torch.allclose(audit_dppo, audit_grpo)  # half the rows are pruned: the two differ


@pytest.mark.parametrize("loss_type,checkpointing", [("dapo", None), ("grpo", None), ("dapo", {"use_reentrant": True})])
def test_with_fewer_accumulation_steps_the_audit_sums_the_batchs_steps(tmp_path, tiny_model_dir, train_dataset,
                                                                       loss_type, checkpointing):
    """GA 1 < steps_per_generation 2, learning rate 0 (the batch's two steps at fixed parameters): the audited
    gradients are the sums of the two steps' gradients, GRPO's and DPPO's (also through the backward that
    reentrant gradient checkpointing needs)."""
    common = dict(max_steps=2, beta=0.05, loss_type=loss_type, steps_per_generation=2, gradient_accumulation_steps=1,
                  learning_rate=0.0)
    if checkpointing is not None:
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing)
    _, grpo_grads = run(GRPOTrainer, GRPOConfig, tmp_path / "g", tiny_model_dir, train_dataset, **common)
    dppo, dppo_grads = run(AuditRecorder, DPPOConfig, tmp_path / "d", tiny_model_dir, train_dataset, audit_every=1,
                           **common)
    (audit_dppo, audit_grpo), = dppo.audits
    assert_close_vectors(audit_grpo, grpo_grads[0] + grpo_grads[1])
    assert_close_vectors(audit_dppo, dppo_grads[0] + dppo_grads[1])


def lora(dropout=0.05):
    """TRL's default LoRA dropout (0.05), on every attention and MLP projection of the tiny model."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@pytest.mark.parametrize("checkpointing,peft", [(None, False), ({"use_reentrant": False}, False),
                                                ({"use_reentrant": True}, False), (None, True)])
def test_training_with_the_audit_is_training_without_it(tmp_path, tiny_model_dir, train_dataset, checkpointing, peft):
    """Bit for bit: parameters, losses and every logged metric other than the audit's (GA < spg, KL, packing), also
    under gradient checkpointing (reentrant checkpointing refuses ``torch.autograd.grad``: the audit's backward
    goes into emptied ``.grad`` slots that are put back) and with LoRA dropout (the audit turns dropout off for its
    passes and forks the RNG: training draws the same dropout masks, and its dropout modules are back in train
    mode after each audit)."""
    common = dict(max_steps=4, beta=0.05, steps_per_generation=2, gradient_accumulation_steps=1)
    if checkpointing is not None:
        common.update(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing)
    if peft:
        common.update(peft_config=lora(), learning_rate=1e-2)
    plain, _ = run(DPPOTrainer, DPPOConfig, tmp_path / "a", tiny_model_dir, train_dataset, **common)
    audited, _ = run(AuditRecorder, DPPOConfig, tmp_path / "b", tiny_model_dir, train_dataset, audit_every=1,
                     **common)
    assert len(audited.audits) == 2
    for (name, p), (_, q) in zip(plain.model.named_parameters(), audited.model.named_parameters()):
        assert torch.equal(p, q), name
    def strip(h):
        return {k: v for k, v in h.items()
                if "audit" not in k and "speed" not in k and "runtime" not in k and "per_second" not in k
                and k != "step_time"}

    assert [strip(h) for h in plain.state.log_history] == [strip(h) for h in audited.state.log_history]
    assert any("dppo/audit_cosine" in h for h in audited.state.log_history)
    dropouts = [m for m in audited.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert all(m.training and m.p == 0.05 for m in dropouts) and (len(dropouts) > 0) == peft


@pytest.mark.parametrize("spg,beta", [(1, 0.0), (2, 0.0), (2, 0.05)])
def test_with_every_row_kept_the_audit_reads_float_rounding_under_lora_dropout(tmp_path, tiny_model_dir,
                                                                               train_dataset, spg, beta):
    """LoRA dropout 0.05 (TRL's default), every row kept (``completion_keep_rate=1.0``, packing): DPPO's gradient is
    GRPO's but for float rounding, so the audit must read about 1e-7, not the two passes' independent dropout
    masks (about 0.3 before both passes turned dropout off). GA 1 < spg 2: GRPO's old-policy (and reference)
    log-probs are DPPO's own on the kept rows (one dropout draw). Such batches are exact: they do not enter the
    bias statistic."""
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, peft_config=lora(),
                     max_steps=4, audit_every=1, completion_keep_rate=1.0, packing=True, steps_per_generation=spg,
                     gradient_accumulation_steps=1, beta=beta, learning_rate=1e-2)
    assert len(trainer.audits) == 4 // spg
    for dppo, grpo in trainer.audits:
        comparison = compare_gradients(dppo, grpo)
        assert comparison["rel_error"] < 1e-5 and comparison["cosine"] > 1 - 1e-9, comparison
    assert trainer.audit_ledger.records["projection"] == []  # every audit exact: nothing for the bias statistic
    assert not any("dppo/audit_bias_t" in h for h in trainer.state.log_history)


def test_under_the_entropy_filter_a_batch_with_rows_dropped_is_compared_and_counted(tmp_path, tiny_model_dir,
                                                                                    train_dataset):
    """The filter's quantile takes every row's tokens, so a batch that drops only zero-advantage rows
    (``keep_floor=1``) is not classed exact: it is compared, and its projection enters the bias statistic (it
    stayed out before, and ``dppo/audit_bias_t`` was never logged). The filter being exact, it reads float
    rounding."""
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, reward=coarse_reward,
                     max_steps=8, audit_every=1, completion_keep_rate=0.5, keep_floor=1.0, top_entropy_quantile=0.5,
                     steps_per_generation=1, gradient_accumulation_steps=1)
    kept = [h["dppo/kept_fraction"] for h in trainer.state.log_history if "dppo/kept_fraction" in h]
    records = trainer.audit_ledger.records
    dropped = sum(0.0 < k < 1.0 for k in kept)  # a batch that keeps nothing has no signal: nothing to compare
    assert dropped >= 2 and len(records["projection"]) == dropped, kept
    assert any("dppo/audit_bias_t" in h for h in trainer.state.log_history)
    for dppo, grpo in trainer.audits:
        assert compare_gradients(dppo, grpo)["rel_error"] < 1e-5


def equal_partial_credit(completions, **kwargs):
    """Every completion scores 0.7 (a partial credit that is not a dyadic fraction): every group has zero spread,
    yet TRL's float32 advantages of a group of 8 are about 6e-4, not 0 (its float32 mean is not 0.7)."""
    return [0.7] * len(completions)


def test_a_batch_without_signal_is_counted_and_not_compared(tmp_path, tiny_model_dir, train_dataset, capsys):
    """Every row scores exactly 0 (zero-spread groups) and beta == 0: GRPO's gradient is float residue and DPPO
    keeps nothing, so there is no cosine, no error and no projection to log (before: cosine 0, relative error 1)."""
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, reward=equal_partial_credit,
                     max_steps=3, audit_every=1, steps_per_generation=1, gradient_accumulation_steps=1,
                     num_generations=8, per_device_train_batch_size=16)
    logged = {k for h in trainer.state.log_history for k in h}
    assert not {"dppo/audit_cosine", "dppo/audit_rel_error", "dppo/audit_projection", "dppo/audit_bias_t"} & logged
    records = trainer.audit_ledger.records
    assert records["audits"] == records["no_signal"] == 3 and records["cosine"] == records["projection"] == []
    assert not trainer.__dict__.get("audits")  # no gradient pass at all
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPPO summary")][-1]
    assert "audits 3, median cosine n/a, 3 without signal" in line and "bias t" not in line


def test_the_audit_logs_its_metrics_and_the_summary_line_reports_it(tmp_path, tiny_model_dir, train_dataset, capsys):
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, max_steps=6, audit_every=2,
                     steps_per_generation=1, gradient_accumulation_steps=1)
    logged = [h for h in trainer.state.log_history if "dppo/audit_cosine" in h]
    assert len(logged) == len(trainer.audits) == 3
    for h, (d, g) in zip(logged, trainer.audits):
        assert -1 <= h["dppo/audit_cosine"] <= 1 and h["dppo/audit_rel_error"] >= 0 and h["dppo/audit_seconds"] > 0
        assert h["dppo/audit_noise_to_signal"] == pytest.approx(h["dppo/audit_rel_error"] / h["dppo/pruning_error"])
        assert h["dppo/audit_projection"] == pytest.approx(float((d - g) @ g) / float(g @ g), rel=1e-5)
    projections = trainer.audit_ledger.records["projection"]
    assert projections == pytest.approx([compare_gradients(d, g)["projection"] for d, g in trainer.audits])
    with_t = [h for h in logged if "dppo/audit_bias_t" in h]
    assert len(with_t) == 2 and with_t[-1]["dppo/audit_bias_t"] == pytest.approx(bias_t(projections), rel=1e-5)
    assert all(h["dppo/audit_bias_alarm"] == 0.0 for h in with_t)
    cosines = [compare_gradients(d, g)["cosine"] for d, g in trainer.audits]
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPPO summary")][-1]
    t = bias_t(projections)
    expected = f"audits 3, median cosine {statistics.median(cosines):.3f}, bias t {t:.2f} over 3 audits"
    assert expected in line
    timed = [h for h in trainer.state.log_history if "dppo/audit_step_time_ratio" in h]
    assert len(timed) == 3
    for h in timed:
        share, train_ratio = h["dppo/audit_generation_share"], h["dppo/audit_train_time_ratio"]
        assert 0 < share < 1 and train_ratio > 0
        assert h["dppo/audit_step_time_ratio"] == pytest.approx(step_ratio_at_share(train_ratio, share), rel=1e-3)
    step = statistics.median(h["dppo/audit_step_time_ratio"] for h in timed)
    assert f"a step takes {step:.2f} of GRPO's time (training " in line and "3 batches timed" in line


def test_the_projected_time_ratios_from_phase_seconds():
    grpo, dppo = PhaseSeconds(generation=2.0, logps=1.0, gradient=3.0), PhaseSeconds(2.0, 0.5, 1.0)
    ratios = projected_time_ratios(grpo, dppo)
    assert ratios == pytest.approx({"train_time_ratio": 1.5 / 4.0, "step_time_ratio": 3.5 / 6.0,
                                    "generation_share": 2.0 / 6.0})
    assert ratios["step_time_ratio"] == pytest.approx(step_ratio_at_share(ratios["train_time_ratio"], 2.0 / 6.0))
    twice = projected_time_ratios(grpo, dppo, num_iterations=2)  # the gradient passes run once per iteration
    assert twice["train_time_ratio"] == pytest.approx(2.5 / 7.0) and twice["generation_share"] == pytest.approx(2.0 / 9.0)
    assert projected_time_ratios(PhaseSeconds(1.0, 0.0, 0.0), dppo) is None
    assert step_ratio_at_share(0.25, 0.9) == pytest.approx(0.925) and step_ratio_at_share(0.25, 0.0) == 0.25


def test_the_measured_error_source_uses_earlier_audits_only(tmp_path, tiny_model_dir, train_dataset):
    """adaptive_keep_error_source='audit': batch b's target is adaptive_keep_error / median(ratios of batches < b)."""
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, max_steps=5, audit_every=1,
                     steps_per_generation=1, gradient_accumulation_steps=1, adaptive_keep_error=0.5,
                     adaptive_keep_error_source="audit")
    ratios = trainer.audit_ledger.records["ratio"]
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


@pytest.mark.parametrize("sampling,biased", [("topk", True), ("stratified", False), ("systematic", False),
                                             ("poisson", False)])
def test_the_bias_alarm_fires_for_topk_within_24_audits_and_not_for_the_unbiased_designs(
    tmp_path, tiny_model_dir, train_dataset, sampling, biased, capsys
):
    """24 audited generation batches of a training run (16 rows, groups of 8, keep 0.3), compared exactly: topk
    drops the small-|A| rows unweighted, so DPPO's gradient is shorter than GRPO's along GRPO's own direction on
    nearly every batch (projection about -0.4, bias t about -13 after 24: the alarm fires at the 8th audit, the
    first it may); the unbiased designs' t stays within noise (measured |t| < 2 here)."""
    trainer, _ = run(AuditRecorder, DPPOConfig, tmp_path, tiny_model_dir, train_dataset, reward=has_a_digit,
                     max_steps=24, audit_every=1, steps_per_generation=1, gradient_accumulation_steps=1,
                     completion_keep_rate=0.3, prune_sampling=sampling, num_generations=8,
                     per_device_train_batch_size=16, logging_steps=24)
    records = trainer.audit_ledger.records
    assert records["audits"] == 24 and len(records["projection"]) >= 20 and trainer._audit_sketch.exact
    t = bias_t(records["projection"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPPO summary")][-1]
    if biased:
        assert records["alarm_at"] is not None and records["alarm_at"] <= 24 and t < -BIAS_ALARM_T
        assert f"BIAS ALARM (|t| > {BIAS_ALARM_T:g} at audit {records['alarm_at']})" in line
    else:
        assert records["alarm_at"] is None and abs(t) < BIAS_ALARM_T, t
        assert "no bias alarm" in line


def test_a_resumed_run_goes_on_with_the_audit_history(tmp_path, tiny_model_dir, train_dataset):
    """Killed after 3 of 6 steps and resumed: the same audits, bias statistic and measured-error scales (hence
    keep rates, with adaptive_keep_error_source='audit') as the uninterrupted run."""
    settings = dict(max_steps=6, audit_every=1, steps_per_generation=1, gradient_accumulation_steps=1,
                    adaptive_keep_error=0.5, adaptive_keep_error_source="audit", save_strategy="steps", save_steps=3)
    whole, _ = run(AuditRecorder, DPPOConfig, tmp_path / "whole", tiny_model_dir, train_dataset, **settings)
    split = dict(max_grad_norm=0.0, **settings)
    first = train(AuditRecorder, tmp_path / "split", tiny_model_dir, train_dataset, callbacks=[StopAt(3)], **split)
    second = build(AuditRecorder, tmp_path / "split", tiny_model_dir, train_dataset, **split)
    second.train(resume_from_checkpoint=str(tmp_path / "split" / "out" / "checkpoint-3"))
    assert second.audit_ledger.records["audits"] == whole.audit_ledger.records["audits"] == 6
    for key in ("cosine", "ratio", "projection", "bias_t"):
        assert second.audit_ledger.records[key] == pytest.approx(whole.audit_ledger.records[key], rel=1e-5, abs=1e-9), key
    assert len(whole.audit_ledger.records["bias_t"]) >= 4
    assert [s for _, s in first.scales + second.scales] == pytest.approx([s for _, s in whole.scales], rel=1e-5)
