"""Every invalid value of every DPPO field is rejected at construction, naming the field."""

import dataclasses

import pytest
from support.configs import DPPO_FIELDS, VALIDATION
from support.configs import validation_config as make
from trl import GRPOConfig

from dppo_trl import DPPOConfig


def test_fields_are_documented_and_subclass_grpo():
    assert issubclass(DPPOConfig, GRPOConfig)
    own = {f.name: f for f in dataclasses.fields(DPPOConfig)}.keys() - {f.name for f in dataclasses.fields(GRPOConfig)}
    assert own == DPPO_FIELDS
    for f in dataclasses.fields(DPPOConfig):
        if f.name in DPPO_FIELDS:
            assert len(f.metadata.get("help", "")) > 40, f.name


def test_defaults():
    cfg = make()
    assert (cfg.completion_keep_rate, cfg.keep_floor, cfg.prune_sampling, cfg.prune_seed) == (
        0.5,
        0.05,
        "stratified",
        None,
    )
    # the length exponent by loss_type: -0.5 for the per-sequence means, 0 for the token sums; set: as given
    assert cfg.loss_type == "dapo" and cfg.score_length_exponent is None and cfg.length_exponent == 0.0
    assert make(loss_type="grpo").length_exponent == -0.5 and make(loss_type="sapo").length_exponent == -0.5
    assert make(loss_type="grpo", score_length_exponent=0).length_exponent == 0.0
    assert make(loss_type="grpo", prune_sampling="topk").length_exponent == 0.0  # CPPO's rule stays |A|
    assert cfg.keep_budget == "rows" and cfg.adaptive_keep_error is None
    assert cfg.completion_pruning
    assert not make(completion_keep_rate=1.0).completion_pruning
    assert make(completion_keep_rate=1.0, prune_sampling="zero_variance").completion_pruning


@pytest.mark.parametrize(
    "field,value",
    [
        ("completion_keep_rate", 0.0),
        ("completion_keep_rate", -0.1),
        ("completion_keep_rate", 1.5),
        ("completion_keep_rate", "half"),
        ("completion_keep_rate", True),
        ("completion_keep_rate", float("nan")),
        ("keep_floor", 0.0),
        ("keep_floor", 1.01),
        ("keep_floor", None),
        ("prune_sampling", "random"),
        ("prune_sampling", ""),
        ("prune_sampling", None),
        ("keep_budget", "bytes"),
        ("keep_budget", None),
        ("score_length_exponent", 3.0),
        ("score_length_exponent", "0.5"),
        ("score_length_exponent", True),
        ("score_length_exponent", float("nan")),
        ("adaptive_keep_error", 0.0),
        ("adaptive_keep_error", -0.3),
        ("adaptive_keep_error", "0.3"),
        ("adaptive_keep_error", True),
        ("adaptive_keep_error", float("nan")),
        ("adaptive_keep_error", float("inf")),
        ("prune_seed", -1),
        ("prune_seed", 1.5),
        ("prune_seed", "7"),
        ("prune_seed", True),
        ("packing", "yes"),
        ("packing", 1),
        ("max_packed_tokens", 0),
        ("max_packed_tokens", -5),
        ("max_packed_tokens", 1.5),
        ("max_packed_tokens", True),
        ("max_packed_tokens", "64"),
        ("prompt_keep_rate", 0.0),
        ("prompt_keep_rate", 1.2),
        ("prompt_keep_rate", "0.5"),
        ("prompt_keep_rate", True),
        ("prompt_keep_rate", float("nan")),
        ("prompt_keep_rate", None),
        ("prompt_keep_floor", 0.0),
        ("prompt_keep_floor", "0.1"),
        ("prompt_keep_floor", float("inf")),
        ("prompt_history_decay", 1.0),
        ("prompt_history_decay", "0.5"),
        ("prompt_history_decay", False),
        ("prompt_history_decay", float("nan")),
        ("adaptive_keep_error_source", "measured"),
        ("adaptive_keep_error_source", None),
        ("audit_every", -1),
        ("audit_every", 1.5),
        ("audit_every", True),
        ("audit_every", "10"),
        ("audit_sketch_dim", 0),
        ("audit_sketch_dim", 64.0),
        ("audit_exact_params", -1),
        ("audit_exact_params", None),
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        make(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(completion_keep_rate=1.0, packing=False, loss_type="dapoo"), "loss_type"),  # a typo, in any setting
        (dict(loss_type="dapoo"), "loss_type"),
    ],
)
def test_invalid_values_are_rejected_in_every_configuration(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make(**kwargs)


def test_pruning_and_packing_accept_every_grpo_option():
    for extra in (dict(completion_keep_rate=1.0, packing=False), {}):
        cfg = make(**extra, top_entropy_quantile=0.2, entropy_coef=0.01, use_adaptive_entropy=True)
        assert cfg.dppo_training_path == (extra == {})


def test_validation_happens_before_grpo_config():
    # A DPPO error is reported even when GRPOConfig would be happy, and before any model is involved.
    with pytest.raises(ValueError, match="keep_floor=2"):
        make(keep_floor=2)


def test_every_dppo_field_is_in_the_config_reference():
    from pathlib import Path

    reference = (Path(__file__).parent.parent / "docs" / "config.md").read_text()
    for name in DPPO_FIELDS:
        assert f"| `{name}` |" in reference, f"docs/config.md does not document {name}"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(prompt_keep_floor=0.3), "prompt_keep_floor"),  # prompt pruning off: the setting would be ignored
        (dict(prompt_history_decay=0.9), "prompt_history_decay"),
        (dict(completion_keep_rate=1.0, keep_floor=0.2), "keep_floor"),  # completion pruning off
        (dict(completion_keep_rate=1.0, prune_sampling="poisson"), "prune_sampling"),
        (dict(completion_keep_rate=1.0, prune_seed=3), "prune_seed"),
        (dict(prune_sampling="zero_variance", completion_keep_rate=0.3), "completion_keep_rate"),
        (dict(prune_sampling="topk", keep_floor=0.2), "keep_floor"),
        (dict(prune_sampling="topk", prune_seed=3), "prune_seed"),
        (dict(prune_sampling="topk", keep_budget="tokens"), "keep_budget"),
        (dict(completion_keep_rate=1.0, score_length_exponent=-0.5), "score_length_exponent"),
        (dict(completion_keep_rate=1.0, adaptive_keep_error=0.3), "adaptive_keep_error"),
        (dict(prune_sampling="topk", adaptive_keep_error=0.3), "adaptive_keep_error"),
        (dict(packing=False, max_packed_tokens=64), "max_packed_tokens"),
        (dict(completion_keep_rate=0.01), "keep_floor"),  # the floor keeps more than the rate
        (dict(audit_sketch_dim=128), "audit_sketch_dim"),  # the audit is off
        (dict(audit_exact_params=0), "audit_exact_params"),
        (dict(audit_every=5, completion_keep_rate=1.0), "audit_every"),  # nothing is pruned: float rounding only
        (dict(audit_every=5, completion_keep_rate=1.0, packing=False), "audit_every"),  # GRPO's path: never runs
        (dict(adaptive_keep_error_source="audit"), "adaptive_keep_error_source"),  # no adaptive_keep_error
        (dict(adaptive_keep_error=0.3, adaptive_keep_error_source="audit"), "adaptive_keep_error_source"),  # no audit
        (dict(prompt_keep_rate=0.5, top_entropy_quantile=0.2, per_device_train_batch_size=16),
         "top_entropy_quantile"),  # approximate: said
        (dict(prompt_keep_rate=0.5), "prompt_keep_rate"),  # 8 rows of 8: one candidate a process, m = P
        (dict(prompt_keep_rate=0.9, per_device_train_batch_size=32, num_generations=8), "prompt_keep_rate"),  # 4 of 4
    ],
)
def test_valid_settings_that_the_configuration_does_not_use_warn_once(kwargs, field, caplog):
    """Sweeps and one-flag baselines override one field over a recipe that sets others: a warning, not an error."""
    with caplog.at_level("WARNING", logger="dppo_trl.config"):
        cfg = make(**kwargs)
    warnings = [r for r in caplog.records if r.name == "dppo_trl.config" and r.levelname == "WARNING"]
    assert len(warnings) == 1 and field in warnings[0].getMessage()
    for name, value in kwargs.items():
        assert getattr(cfg, name) == value


def test_a_configuration_that_uses_every_setting_does_not_warn(caplog):
    with caplog.at_level("WARNING", logger="dppo_trl.config"):
        make(completion_keep_rate=0.3, keep_floor=0.1, prune_seed=2, prompt_keep_rate=0.5, prompt_keep_floor=0.2,
             per_device_train_batch_size=16, max_packed_tokens=64)
        make(audit_every=10, audit_sketch_dim=256, audit_exact_params=0, adaptive_keep_error=0.3,
             adaptive_keep_error_source="audit")
    assert not [r for r in caplog.records if r.name == "dppo_trl.config"]


@pytest.mark.parametrize("kwargs", [dict(prompt_keep_rate=0.5), dict(deepspeed={"zero_optimization": {"stage": 2}})])
def test_the_audit_refuses_what_it_cannot_measure_yet(kwargs):
    """Prompt pruning (its weights are unbiased over an epoch, not within the audited batch) and sharded or
    partitioned training (the audit takes gradients of the unsharded parameters)."""
    with pytest.raises(ValueError, match="audit_every"):
        make(audit_every=4, **kwargs)
    make(audit_every=0, **{k: v for k, v in kwargs.items() if k == "prompt_keep_rate"})  # off: accepted


def test_trainer_rejects_bad_setups_before_loading_any_model(tmp_path):
    """The model path does not exist: an error about it would mean the model was loaded first."""
    from dppo_trl import DPPOTrainer

    missing = str(tmp_path / "no-such-model")
    with pytest.raises(TypeError, match="GRPOConfig"):
        DPPOTrainer(missing, lambda completions, **kw: [0.0] * len(completions), args=dict(VALIDATION))


def test_the_cut_says_when_it_cuts_nothing_and_refuses_a_floor_above_m_over_p(caplog):
    """``m = round(rate x P)`` of each process's ``P`` candidates: ``m = P`` warns (naming ``P`` and what to
    change); a floor with ``floor x P > m`` would bias the fixed-size draw and is refused, naming both fields."""
    with caplog.at_level("WARNING", logger="dppo_trl.config"):
        cfg = make(prompt_keep_rate=0.5)  # TRL's defaults: 8 rows of 8 completions, one candidate a process
    assert (cfg.prompt_candidates_per_process, cfg.prompt_accepted_per_process, cfg.prompt_cut_runs) == (1, 1, False)
    [warning] = [r.getMessage() for r in caplog.records if r.name == "dppo_trl.config"]
    assert "P=1" in warning and "cuts nothing" in warning and "per_device_train_batch_size" in warning
    cut = make(prompt_keep_rate=0.5, per_device_train_batch_size=16, num_generations=4, steps_per_generation=2)
    assert (cut.prompt_candidates_per_process, cut.prompt_accepted_per_process, cut.prompt_cut_runs) == (8, 4, True)
    for kwargs in (dict(prompt_keep_rate=0.25, prompt_keep_floor=0.3, per_device_train_batch_size=16,
                        num_generations=4),  # P 4, m 1: -16.7% without the refusal
                   dict(prompt_keep_rate=0.05, per_device_train_batch_size=80, num_generations=4)):  # P 20, m 1
        with pytest.raises(ValueError, match="prompt_keep_floor=.*prompt_keep_rate=.*m / P"):
            make(**kwargs)
    assert make(prompt_keep_rate=0.25, prompt_keep_floor=0.25, per_device_train_batch_size=16,
                num_generations=4).prompt_cut_runs  # floor x P = m: every pi at the floor, sum m


def test_the_cut_with_several_iterations_says_only_the_first_is_exact(caplog):
    """The cut is drawn once a generation: with num_iterations > 1 the later iterations reuse it, which a warning
    says; completion pruning alone draws each iteration afresh (tests/test_reuse.py) and warns nothing."""
    cut = dict(prompt_keep_rate=0.5, per_device_train_batch_size=16, num_generations=4, steps_per_generation=2)
    for settings, warns in ((dict(cut, num_iterations=2), True), (cut, False),
                            (dict(num_iterations=2, completion_keep_rate=0.5), False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dppo_trl.config"):
            make(**settings)
        warnings = [r.getMessage() for r in caplog.records if r.name == "dppo_trl.config"]
        assert any("num_iterations=2" in w and "first iteration" in w for w in warnings) == warns, warnings
