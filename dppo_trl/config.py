"""``DPPOConfig``: ``GRPOConfig`` plus DPPO's fields, validated at construction. The class docstring is the fields'
reference; ``ALLOWED_VALUES`` says what each accepts and ``UNUSED_SETTING_RULES`` when a valid setting goes unused.
docs/config.md is generated from the three (``python -m dppo_trl.config_reference --write``)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from transformers.utils import logging
from trl import GRPOConfig

from .core.estimator import SUPPORTED_LOSS_TYPES
from .core.prompts import accepted_per_rank, probe_scores, prompt_scores
from .core.pruning import default_length_exponent, sampling_designs, unbiased_designs

logger = logging.get_logger(__name__)

_DEFAULT_KEEP_RATE = 0.5
_DEFAULT_KEEP_FLOOR = 0.05
_DEFAULT_SAMPLING = "stratified"  # chosen from make bench-variance and make bench-reasoning (docs/benchmarks.md)
_DEFAULT_PROMPT_KEEP_FLOOR = 0.1
_DEFAULT_PROMPT_HISTORY_DECAY = 0.5
KEEP_BUDGETS = ("rows", "tokens")
ADAPTIVE_ERROR_SOURCES = ("model", "audit")
_DEFAULT_AUDIT_SKETCH_DIM = 4096
_DEFAULT_AUDIT_EXACT_PARAMS = 1 << 23
# Each DPPO field's help= is what `dppo-trl --help` shows: one or two short sentences (at most 40 words); the full
# explanation is the class docstring's (`help(dppo_trl.DPPOConfig)`, rendered into docs/config.md), which the help
# points to once.


def audit_sharding_refusal(audit_every: int) -> str:
    """The one message refusing the audit under DeepSpeed or FSDP (set in the config, or by ``accelerate launch``)."""
    return (
        f"audit_every={audit_every!r} is not supported with DeepSpeed or FSDP yet (the audit takes gradients of the "
        "unsharded parameters); set audit_every=0."
    )


def is_real_number(value, *, finite: bool = False) -> bool:
    """Whether ``value`` is an int or a float, not a bool; with ``finite``, also neither NaN nor +-inf. Without it
    NaN passes, for range checks to refuse: ``low < value <= high`` is false for NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return not finite or math.isfinite(value)


def _integer(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _in_unit_interval(value) -> bool:
    return is_real_number(value) and 0 < value <= 1


def _registered_design(value) -> bool:
    return isinstance(value, str) and value in sampling_designs()


class Allowed(NamedTuple):
    """What a field accepts (``accepts(value)``) and the words for it (``says``: a text, or a function giving one
    when it is read) of the field's error and of docs/config.md's "allowed" column."""

    accepts: Callable[[Any], bool]
    says: str | Callable[[], str]


_UNIT_INTERVAL = Allowed(_in_unit_interval, "a number in (0, 1]")

# In the fields' order (loss_type last), read by one loop (DPPOConfig._validate_dppo_fields); each error names the
# field, the value and what is allowed.
ALLOWED_VALUES: dict[str, Allowed] = {
    "completion_keep_rate": _UNIT_INTERVAL,
    "keep_floor": _UNIT_INTERVAL,
    "prune_sampling": Allowed(_registered_design, lambda: f"one of {list(sampling_designs())}"),
    "keep_budget": Allowed(lambda v: v in KEEP_BUDGETS, f"one of {list(KEEP_BUDGETS)}"),
    "score_length_exponent": Allowed(lambda v: v is None or is_real_number(v) and -2 <= v <= 2,
                                     "None or a number in [-2, 2]"),
    "adaptive_keep_error": Allowed(lambda v: v is None or is_real_number(v, finite=True) and v > 0,
                                   "None or a finite number > 0"),
    "adaptive_keep_error_source": Allowed(lambda v: v in ADAPTIVE_ERROR_SOURCES,
                                          f"one of {list(ADAPTIVE_ERROR_SOURCES)}"),
    "prune_seed": Allowed(lambda v: v is None or _integer(v, 0), "None or an integer >= 0"),
    "audit_every": Allowed(lambda v: _integer(v, 0), "an integer >= 0"),
    "audit_sketch_dim": Allowed(lambda v: _integer(v, 1), "an integer >= 1"),
    "audit_exact_params": Allowed(lambda v: _integer(v, 0), "an integer >= 0"),
    "speed_check": Allowed(lambda v: isinstance(v, bool), "True or False"),
    "prompt_keep_rate": _UNIT_INTERVAL,
    "prompt_keep_floor": _UNIT_INTERVAL,
    "prompt_history_decay": Allowed(lambda v: is_real_number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "prompt_score": Allowed(lambda v: isinstance(v, str) and v in prompt_scores(),
                            lambda: f"one of {list(prompt_scores())}"),
    "prompt_probe_generations": Allowed(lambda v: v is None or _integer(v, 0), "None or an integer >= 0"),
    "packing": Allowed(lambda v: isinstance(v, bool), "True or False"),
    "max_packed_tokens": Allowed(lambda v: v is None or _integer(v, 1), "None or an integer >= 1"),
    "prefix_sharing": Allowed(lambda v: v is None or isinstance(v, bool), "None, True or False"),
    # GRPO's field, checked in every configuration: GRPOConfig accepts a typo, which fails at the first loss.
    "loss_type": Allowed(lambda v: v in SUPPORTED_LOSS_TYPES, f"one of {list(SUPPORTED_LOSS_TYPES)}"),
}


def allowed_values(name: str) -> str:
    """What field ``name`` accepts, in words (``ALLOWED_VALUES``)."""
    says = ALLOWED_VALUES[name].says
    return says() if callable(says) else says


@dataclass
class DPPOConfig(GRPOConfig):
    r"""
    Configuration class for `DPPOTrainer`: TRL's `GRPOConfig`, every field of which works as in TRL, plus the DPPO
    fields below. Each is validated when the config is built, before any model is loaded, with an error that names
    the field, the value and what is allowed (`ALLOWED_VALUES`); valid settings that the configuration does not use
    give one warning, not an error (`UNUSED_SETTING_RULES`): sweeps and one-flag baselines override one field over
    a recipe that sets others. This docstring is the fields' reference in an installed package
    (`help(dppo_trl.DPPOConfig)`; `dppo-trl --help-all` lists each field with a short help); the repository's
    docs/config.md is generated from it and those two tables.

    Parameters:
        > Parameters that control completion pruning

        completion_keep_rate (`float`, *optional*, defaults to `0.5`):
            Target fraction of the generation batch that enters the log-prob and loss passes: the keep
            probabilities sum to this fraction of its rows, or of its tokens under `keep_budget="tokens"` (more
            when `keep_floor` forces it). `1.0` switches completion pruning off, except under
            `prune_sampling="zero_variance"`, which does not use the rate.
        keep_floor (`float`, *optional*, defaults to `0.05`):
            Smallest keep probability of a row that can contribute to the loss: it caps the Horvitz-Thompson weight
            `1 / pi` at `1 / keep_floor`.
        prune_sampling (`str`, *optional*, defaults to `"stratified"`):
            The sampling design that draws the kept rows: unbiased, the kept rows weighted by `1 / pi`
            (`"stratified"`, `"systematic"`, `"poisson"`, `"balanced"`), or a biased baseline without weights
            (`"topk"`: CPPO's; `"zero_variance"`: DAPO's filter of the groups whose rewards are all equal). What
            each does, what it costs and which to use: `docs/estimator.md`, section 3; the measurements behind the
            default: `docs/benchmarks.md`, "Gradient error per unit of compute". Any name registered with
            `dppo_trl.core.pruning.register_design` is accepted.
        keep_budget (`str`, *optional*, defaults to `"rows"`):
            What `completion_keep_rate` is a fraction of, for the unbiased designs: `"rows"`, the generation
            batch's completions (`sum(pi) = rate x N`), or `"tokens"`, its prompt + completion tokens, what the
            log-prob and loss passes cost (`sum(pi x L) = rate x sum(L)`).
        score_length_exponent (`float`, *optional*):
            `gamma` of the keep scores `|A| x L^gamma` (`L`: the row's prompt + completion tokens); `0` scores `|A|`.
            `None`: the unbiased designs take the default of `loss_type` (the values, and why:
            `docs/estimator.md`, section 3), `"topk"` takes `0` (CPPO's `|A|`).
        adaptive_keep_error (`float`, *optional*):
            When set (e.g. `0.3`), each generation batch's keep rate is the smallest from `completion_keep_rate` up
            to 1 whose estimated pruning error (`dppo/pruning_error`) is at most this value: `completion_keep_rate`
            becomes the fewest kept. The rate is a function of the batch alone, so the design stays exactly
            unbiased (`docs/estimator.md`, section 3). `None`: a fixed rate.
        adaptive_keep_error_source (`str`, *optional*, defaults to `"model"`):
            What `adaptive_keep_error` bounds: `"model"`, the model-based `dppo/pruning_error`; `"audit"`, the
            gradient audit's measured error: the target is divided by the median ratio of measured to model-based
            error over the batches audited so far that pruned (1 before the first), so a batch's keep rate depends
            only on earlier batches and its own scores, never on its own draw.
        prune_seed (`int`, *optional*):
            Seed of DPPO's draws only (the keep draws and prompt pruning's acceptance draws); `None`: derived from
            `seed`. Runs with the same `seed` and different `prune_seed` generate the same first completions and
            differ only in their masks.

        > Parameters that control the gradient audit

        audit_every (`int`, *optional*, defaults to `0`):
            Every this many generation batches (the same on every rank), before the batch's first optimizer step,
            GRPO's and DPPO's gradients of the batch are computed at the current parameters and compared
            (`dppo/audit_*`, with a bias statistic and its alarm); training is unchanged. `0`: off. What it logs,
            costs and holds in memory: `docs/usage.md`, "The gradient audit". Refused with `prompt_keep_rate < 1`
            (prompt weights are unbiased over an epoch, not within one batch), DeepSpeed or FSDP (the audit takes
            gradients of the unsharded parameters).
        audit_sketch_dim (`int`, *optional*, defaults to `4096`):
            Directions `k` of the audit's CountSketch of the gradients (seeded, the same on every rank), used above
            `audit_exact_params` trainable parameters: norms and cosines within about `sqrt(2 / k)` relative.
        audit_exact_params (`int`, *optional*, defaults to `8388608`):
            Up to this many trainable parameters the audit compares the gradients exactly, above it through the
            sketch (the memory of each: `docs/usage.md`, "The gradient audit"). `0`: always sketch.
        speed_check (`bool`, *optional*, defaults to `True`):
            Time GRPO's training passes once, beside DPPO's, on one early generation batch (the second; the first
            when the run has one) at the same parameters, with training unchanged: the summary line and the final
            log (`report_to`) get the measured step time ratio, generation's share of GRPO's step and the projected
            time saved (`docs/usage.md`, "What the run saved"). It costs one more training phase of each method,
            once. Not run under prompt pruning, DeepSpeed or FSDP (the summary says so).

        > Parameters that control prompt pruning

        prompt_keep_rate (`float`, *optional*, defaults to `1.0`):
            Prompt pruning before rollout: of the prompts GRPO's sampler yields for a step, each process generates
            only `round(prompt_keep_rate x P)` of its `P`, drawn with probabilities set by `prompt_score` and
            reweighted by `1 / pi`, so that the expected step stays GRPO's (what holds, per loss type:
            `docs/prompt_pruning.md`). With a token-mean loss (`dapo`, TRL's default) each step is GRPO's times a
            random scale `T / D`, near 1, its spread falling with the candidates (`docs/prompt_pruning.md`, "What
            holds"). Where `round(prompt_keep_rate x P) = P` (TRL's defaults give `P = 1`) nothing is cut, no probe
            runs and the step is GRPO's: a warning says so. `completion_keep_rate` then counts GRPO's rows, not the
            accepted ones. `1.0`: off. Refused with `scale_rewards="batch"` or
            `multi_objective_aggregation="normalize_then_sum"`: a batch-level reward statistic over the accepted
            prompts is not GRPO's (`docs/estimator.md`, section 2b).
        prompt_keep_floor (`float`, *optional*, defaults to `0.1`):
            Smallest acceptance probability of a prompt: it caps the prompt weight at `1 / prompt_keep_floor`. At
            most `m / P` (the accepted share of a process's candidates); above it, refused.
        prompt_score (`str`, *optional*, defaults to `"probe"`):
            What sets a candidate's acceptance probability: `"probe"`, whether the rewards of its probe
            (`prompt_probe_generations` completions generated and scored first) differ; `"ema"`, the moving average
            of its own earlier groups' mean `|A|` (`prompt_history_decay`); `"calibrated"`, what the prompts whose
            last group looked like its last group (flat or spread, and where its mean reward lay) got at their next
            visit (`docs/prompt_pruning.md`, "Scores").
        prompt_probe_generations (`int`, *optional*):
            Completions `k` of every candidate generated first and scored, for `prompt_score="probe"`; an accepted
            prompt keeps them in its group and generates the other `num_generations - k`. In
            `[2, num_generations)` for the probe score, `0` for a history score; `None`: 2 for the probe, else 0.
        prompt_history_decay (`float`, *optional*, defaults to `0.5`):
            Weight of the old value in a prompt's moving averages, of its groups' mean `|A|` (the `"ema"` score) and
            of their completion lengths (the token normalizer without a probe); `0` keeps only the latest group's.

        > Parameters that control packing

        packing (`bool`, *optional*, defaults to `True`):
            Dense Prompt Packing of the training passes (`docs/packing.md`): the kept rows go to the
            `steps_per_generation` micro-batches balanced by tokens, each run padding-free; also with completion
            pruning off. `False`: TRL's padded micro-batches.
        max_packed_tokens (`int`, *optional*):
            Token budget of one packed row. `None`: a budget by attention implementation. What a longer sequence
            gets, and why no forward call is larger than TRL's whatever the budget: `docs/packing.md`, "The plan",
            items 2 and 4.
        prefix_sharing (`bool`, *optional*):
            Prefix sharing in the packed passes (`docs/packing.md`, "Prefix sharing"): the kept completions of a
            group forward their prompt once, exactly, where that is faster than repeating it. `None`: on where the
            model's attention kernel and layers make it exact (sdpa or eager, full attention, no MoE router loss),
            else off with the reason logged once.
            `True`: on, and an error at construction where it is not exact. `False`: off.
    """

    completion_keep_rate: float = field(
        default=_DEFAULT_KEEP_RATE,
        metadata={
            "help": "Target fraction of the generation batch's completions (or tokens) kept for the log-prob and "
            "loss passes; 1.0: no completion pruning."
        },
    )
    keep_floor: float = field(
        default=_DEFAULT_KEEP_FLOOR,
        metadata={
            "help": "Smallest keep probability of a row that can contribute: it caps the Horvitz-Thompson weight "
            "1/pi at 1/keep_floor."
        },
    )
    prune_sampling: str = field(
        default=_DEFAULT_SAMPLING,
        metadata={
            "help": "The sampling design of the kept rows: unbiased with 1/pi weights (stratified, systematic, "
            "poisson, balanced) or a biased baseline (topk, zero_variance).",
            "choices": list(sampling_designs()),
        },
    )
    keep_budget: str = field(
        default="rows",
        metadata={
            "help": "What completion_keep_rate is a fraction of: the batch's rows, or its tokens (what the log-prob "
            "and loss passes cost).",
            "choices": list(KEEP_BUDGETS),
        },
    )
    score_length_exponent: float | None = field(
        default=None,
        metadata={"help": "gamma of the keep scores |A| x L^gamma (L: the row's tokens); None: by loss_type."},
    )
    adaptive_keep_error: float | None = field(
        default=None,
        metadata={
            "help": "When set (e.g. 0.3), each generation batch keeps the smallest rate from completion_keep_rate up "
            "whose estimated pruning error is at most this value; None: a fixed rate."
        },
    )
    adaptive_keep_error_source: str = field(
        default="model",
        metadata={
            "help": "What adaptive_keep_error bounds: model, the model-based error; audit, the gradient audit's "
            "measured one.",
            "choices": list(ADAPTIVE_ERROR_SOURCES),
        },
    )
    prune_seed: int | None = field(
        default=None,
        metadata={"help": "Seed of DPPO's keep and prompt-acceptance draws only; None: derived from seed."},
    )
    audit_every: int = field(
        default=0,
        metadata={
            "help": "Every this many generation batches, compare DPPO's gradient of the batch with GRPO's and log "
            "dppo/audit_*; training is unchanged. 0: off."
        },
    )
    audit_sketch_dim: int = field(
        default=_DEFAULT_AUDIT_SKETCH_DIM,
        metadata={
            "help": "Directions of the audit's gradient sketch, used above audit_exact_params trainable parameters."
        },
    )
    audit_exact_params: int = field(
        default=_DEFAULT_AUDIT_EXACT_PARAMS,
        metadata={
            "help": "Up to this many trainable parameters the audit compares the gradients exactly; 0: always sketch."
        },
    )
    speed_check: bool = field(
        default=True,
        metadata={
            "help": "Time GRPO's passes once: the summary and the last log say what DPPO saved."
        },
    )
    prompt_keep_rate: float = field(
        default=1.0,
        metadata={
            "help": "Prompt pruning before rollout: the fraction of each step's candidate prompts generated, drawn "
            "at random and reweighted; 1.0: off."
        },
    )
    prompt_keep_floor: float = field(
        default=_DEFAULT_PROMPT_KEEP_FLOOR,
        metadata={"help": "Smallest acceptance probability of a prompt under prompt pruning."},
    )
    prompt_score: str = field(
        default="probe",
        metadata={"help": "Prompt pruning's predictor: 'probe' (its probe's rewards differ), 'ema' or 'calibrated' "
                  "(its history)."},
    )
    prompt_probe_generations: int | None = field(
        default=None,
        metadata={"help": "Prompt pruning: completions of each candidate generated first (the probe); None: 2 for "
                  "the probe, else 0."},
    )
    prompt_history_decay: float = field(
        default=_DEFAULT_PROMPT_HISTORY_DECAY,
        metadata={"help": "Weight of the old value in a prompt's moving-average score and length (prompt pruning)."},
    )
    packing: bool = field(
        default=True,
        metadata={
            "help": "Dense Prompt Packing of the training passes: balanced, padding-free micro-batches; False: TRL's "
            "padded micro-batches."
        },
    )
    max_packed_tokens: int | None = field(
        default=None,
        metadata={"help": "Token budget of one packed row; None: by attention implementation."},
    )
    prefix_sharing: bool | None = field(
        default=None,
        metadata={
            "help": "Forward each group's prompt once in the packed passes; None: on where exact for the model's "
            "attention, True: on (an error where not exact), False: off."
        },
    )

    def __post_init__(self):
        self._validate_dppo_fields()
        super().__post_init__()
        if self.prompt_pruning:
            self._validate_cut_size()

    @property
    def completion_pruning(self) -> bool:
        """Whether completion pruning is on."""
        return self.prune_sampling == "zero_variance" or self.completion_keep_rate < 1.0

    @property
    def length_exponent(self) -> float:
        """``score_length_exponent``, or when None its default for ``loss_type`` (an unbiased design; ``topk``
        keeps CPPO's ``|A|``)."""
        if self.score_length_exponent is not None:
            return float(self.score_length_exponent)
        return default_length_exponent(self.loss_type) if self.prune_sampling in unbiased_designs() else 0.0

    @property
    def prompt_pruning(self) -> bool:
        """Whether prompt pruning (before rollout) is on."""
        return self.prompt_keep_rate < 1.0

    @property
    def prompt_candidates_per_process(self) -> int:
        """``P``: the candidate prompts a process gets a step under prompt pruning (its generation batch,
        ``per_device_train_batch_size x steps_per_generation`` rows, over ``num_generations``)."""
        return self.per_device_train_batch_size * self.steps_per_generation // self.num_generations

    @property
    def prompt_accepted_per_process(self) -> int:
        """``m``: the candidates a process accepts of its ``P``, ``round(prompt_keep_rate x P)``, at least 1."""
        return accepted_per_rank(self.prompt_keep_rate, self.prompt_candidates_per_process)

    @property
    def prompt_cut_runs(self) -> bool:
        """Whether prompt pruning cuts anything: ``m < P`` (where ``m = P`` every candidate is generated)."""
        return self.prompt_pruning and self.prompt_accepted_per_process < self.prompt_candidates_per_process

    @property
    def dppo_training_path(self) -> bool:
        """Whether training batches go through DPPO's micro-batching (pruning or packing); otherwise every hook
        is TRL's own and the trainer is exactly `GRPOTrainer`."""
        return self.completion_pruning or self.prompt_pruning or self.packing

    def _validate_dppo_fields(self) -> None:
        for name, allowed in ALLOWED_VALUES.items():
            value = getattr(self, name)
            if not allowed.accepts(value):
                raise ValueError(f"{name}={value!r} is invalid: it must be {allowed_values(name)}.")
        if self.audit_every and self.prompt_pruning:
            raise ValueError(
                f"audit_every={self.audit_every!r} cannot be combined with prompt_keep_rate={self.prompt_keep_rate!r} "
                "yet: the audit compares DPPO with GRPO on the same batch, and GRPO's batch holds the prompts that "
                "were never generated. Use prompt_keep_rate=1.0 or audit_every=0."
            )
        if self.prompt_pruning:
            self._validate_probe()
        if self.audit_every and (self.deepspeed or self.fsdp):
            raise ValueError(audit_sharding_refusal(self.audit_every))
        scale = self.scale_rewards if isinstance(self.scale_rewards, str) else "group" if self.scale_rewards else "none"
        if self.prompt_pruning and (scale == "batch" or self.multi_objective_aggregation == "normalize_then_sum"):
            raise ValueError(
                f"prompt_keep_rate={self.prompt_keep_rate!r} cannot be combined with scale_rewards={scale!r} "
                f"and multi_objective_aggregation={self.multi_objective_aggregation!r}: a batch-level reward statistic "
                "over the accepted prompts is not GRPO's over the batch it would have drawn. Use scale_rewards='group' "
                "or 'none' with multi_objective_aggregation='sum_then_normalize', or prompt_keep_rate=1.0."
            )
        unused = self._unused_settings()
        if unused:
            logger.warning("DPPOConfig: " + "; ".join(unused) + ".")

    def _validate_cut_size(self) -> None:
        """The cut's ``m`` of ``P``: a floor above ``m / P`` is refused (the acceptance probabilities would sum past
        ``m``, which a fixed-size draw cannot honour); ``m = P`` cuts nothing, which a warning says."""
        candidates, accepted = self.prompt_candidates_per_process, self.prompt_accepted_per_process
        per_process = (f"each process gets P={candidates} candidate prompt(s) a step (per_device_train_batch_size="
                       f"{self.per_device_train_batch_size} x steps_per_generation={self.steps_per_generation} / "
                       f"num_generations={self.num_generations}) and accepts m=round({self.prompt_keep_rate!r} x "
                       f"{candidates})={accepted}")
        if accepted == candidates:
            change = ("raise per_device_train_batch_size or steps_per_generation" if candidates == 1 else
                      f"lower prompt_keep_rate below {1 - 0.5 / candidates:.3g}, or raise per_device_train_batch_size "
                      "or steps_per_generation")
            logger.warning(f"DPPOConfig: prompt_keep_rate={self.prompt_keep_rate!r} cuts nothing: {per_process}, so "
                           f"every candidate is generated, no probe runs and the step is GRPO's. To cut, {change}.")
        elif self.prompt_keep_floor * candidates > accepted * (1 + 1e-12):
            raise ValueError(
                f"prompt_keep_floor={self.prompt_keep_floor!r} is invalid with prompt_keep_rate="
                f"{self.prompt_keep_rate!r}: {per_process}, and a floor above m / P = {accepted / candidates:.4g} "
                "makes the acceptance probabilities sum past m, which the fixed-size draw cannot honour (the cut "
                f"would be biased). Use prompt_keep_floor <= {accepted / candidates:.4g}, or a higher prompt_keep_rate."
            )
        elif self.num_iterations > 1:
            logger.warning(
                f"DPPOConfig: the cut (prompt_keep_rate={self.prompt_keep_rate!r}) with num_iterations="
                f"{self.num_iterations}: the first iteration of a generation batch is exact; the later ones train on "
                "the same accepted prompts (a generation cannot be drawn again), from parameters that depend on "
                "them, so their expected step is close to GRPO's, not equal (completion pruning draws each "
                "iteration afresh). For an exact step at every iteration, use num_iterations=1 with the cut."
            )

    def _validate_probe(self) -> None:
        score = self.prompt_score
        if self.prompt_probe_generations is None:
            self.prompt_probe_generations = 2 if score in probe_scores() else 0
        k = self.prompt_probe_generations
        if score in probe_scores() and not 2 <= k < self.num_generations:
            raise ValueError(
                f"prompt_probe_generations={k!r} is invalid with prompt_score={score!r}: it must be an integer in "
                f"[2, num_generations={self.num_generations}) (a probe of one completion shows no spread, and one of "
                "a whole group would cut nothing). Set it, or use prompt_score='ema' or 'calibrated' with "
                "prompt_probe_generations=0."
            )
        if score not in probe_scores() and k:
            raise ValueError(
                f"prompt_probe_generations={k!r} is invalid with prompt_score={score!r}: that score does not read a "
                f"probe, so it must be 0. Use prompt_probe_generations=0, or prompt_score in {list(probe_scores())}."
            )

    def _unused_settings(self) -> list[str]:
        """The warnings of ``UNUSED_SETTING_RULES`` that apply, in the table's order."""
        context = _WarningContext(self)
        defaults = {f.name: f.default for f in dataclasses.fields(DPPOConfig)}
        return [
            f"{rule.field}={getattr(self, rule.field)!r} {rule.says.format_map(context)}"
            for rule in UNUSED_SETTING_RULES
            if (rule.any_value or getattr(self, rule.field) != defaults[rule.field]) and rule.when(self)
        ]


# The conditions of UNUSED_SETTING_RULES; each docstring is docs/config.md's "warns when" for its rules.
def _no_keep_draw(c: DPPOConfig) -> bool:
    """no completion is drawn at random: `completion_keep_rate=1.0`, or a biased `prune_sampling` (`"topk"`,
    `"zero_variance"`)"""
    return not c.completion_pruning or c.prune_sampling not in unbiased_designs()


def _no_keep_scores(c: DPPOConfig) -> bool:
    """no keep scores are used: `completion_keep_rate=1.0` or `prune_sampling="zero_variance"`"""
    return not c.completion_pruning or c.prune_sampling == "zero_variance"


def _no_draw_at_all(c: DPPOConfig) -> bool:
    """nothing is drawn at random: no completion draw (as for `keep_floor`) and `prompt_keep_rate=1.0`"""
    return _no_keep_draw(c) and not c.prompt_pruning


def _no_completion_pruning(c: DPPOConfig) -> bool:
    """`completion_keep_rate=1.0`"""
    return not c.completion_pruning


def _zero_variance_with_a_rate(c: DPPOConfig) -> bool:
    """`prune_sampling="zero_variance"` (which drops exactly the groups whose rewards are all equal) and a rate
    other than `1.0`"""
    return c.prune_sampling == "zero_variance" and c.completion_keep_rate != 1.0


def _floor_above_rate(c: DPPOConfig) -> bool:
    """an unbiased design with `keep_floor` above `completion_keep_rate`, so more than the rate is kept"""
    return not _no_keep_draw(c) and c.keep_floor > c.completion_keep_rate


def _no_adaptive_error(c: DPPOConfig) -> bool:
    """`adaptive_keep_error=None`"""
    return c.adaptive_keep_error is None


def _adaptive_error_without_audit(c: DPPOConfig) -> bool:
    """`adaptive_keep_error` is set and `audit_every=0`: the model-based error is used"""
    return c.adaptive_keep_error is not None and not c.audit_every


def _audit_off(c: DPPOConfig) -> bool:
    """`audit_every=0`"""
    return not c.audit_every


def _grpo_path(c: DPPOConfig) -> bool:
    """nothing is pruned or packed: GRPO's own path, on which the audit does not run"""
    return not c.dppo_training_path


def _packed_not_pruned(c: DPPOConfig) -> bool:
    """packing on and nothing pruned: the audit measures only float rounding"""
    return c.dppo_training_path and not c.completion_pruning


def _no_prompt_pruning(c: DPPOConfig) -> bool:
    """`prompt_keep_rate=1.0`"""
    return not c.prompt_pruning


def _probe_score(c: DPPOConfig) -> bool:
    """prompt pruning with a probe score (`prompt_score="probe"`)"""
    return c.prompt_pruning and c.prompt_score in probe_scores()


def _with_prompt_pruning(c: DPPOConfig) -> bool:
    """`prompt_keep_rate < 1`"""
    return c.prompt_pruning


def _no_packing(c: DPPOConfig) -> bool:
    """`packing=False`"""
    return not c.packing


class UnusedSetting(NamedTuple):
    """``field`` warns while ``when(config)`` holds and the field is off its default (at any value with
    ``any_value``); the warning is ``field=value`` then ``says``, a ``str.format`` template of the config's fields
    and ``{why}`` (why no completion is drawn at random)."""

    field: str
    when: Callable[[DPPOConfig], bool]
    says: str
    any_value: bool = False


_ZERO_VARIANCE_RATE = (
    "is not used by prune_sampling='zero_variance' (it drops exactly the groups whose rewards are all equal)"
)
_FLOOR_ABOVE_RATE = (
    "is above completion_keep_rate={completion_keep_rate!r}: every row that can contribute is kept with probability at "
    "least keep_floor, so more than completion_keep_rate is kept (weights up to 1 / keep_floor)"
)
_AUDIT_WITHOUT_PRUNING = (
    "with completion_keep_rate=1.0: nothing is pruned, the audit measures only the float rounding of DPPO's passes"
)
_FILTER_WITH_PROMPT_PRUNING = (
    "is approximate with prompt_keep_rate={prompt_keep_rate!r}: its quantile is taken over the accepted prompts' rows "
    "(GRPO's filter had the batch been those prompts; prompts not generated cannot count)"
)
_SOURCE_WITHOUT_AUDIT = "has no audit to learn from while audit_every=0: the model-based error is used"

# Read in this order by DPPOConfig._unused_settings: one warning lists every rule that applies.
UNUSED_SETTING_RULES = (
    UnusedSetting("prune_sampling", _no_completion_pruning, "is not used while completion_keep_rate=1.0"),
    UnusedSetting("keep_floor", _no_keep_draw, "is not used with {why}"),
    UnusedSetting("keep_budget", _no_keep_draw, "is not used with {why}"),
    UnusedSetting("score_length_exponent", _no_keep_scores, "is not used with {why}"),
    UnusedSetting("adaptive_keep_error", _no_keep_draw, "is not used with {why}"),
    UnusedSetting("prune_seed", _no_draw_at_all, "is not used with {why} and prompt_keep_rate=1.0"),
    UnusedSetting("completion_keep_rate", _zero_variance_with_a_rate, _ZERO_VARIANCE_RATE),
    UnusedSetting("keep_floor", _floor_above_rate, _FLOOR_ABOVE_RATE, any_value=True),
    UnusedSetting("adaptive_keep_error_source", _no_adaptive_error, "is not used while adaptive_keep_error=None"),
    UnusedSetting("adaptive_keep_error_source", _adaptive_error_without_audit, _SOURCE_WITHOUT_AUDIT),
    UnusedSetting("audit_every", _grpo_path, "is not used: nothing is pruned or packed (GRPO's path)"),
    UnusedSetting("audit_every", _packed_not_pruned, _AUDIT_WITHOUT_PRUNING),
    UnusedSetting("audit_sketch_dim", _audit_off, "is not used while audit_every=0"),
    UnusedSetting("audit_exact_params", _audit_off, "is not used while audit_every=0"),
    UnusedSetting("prompt_keep_floor", _no_prompt_pruning, "is not used while prompt_keep_rate=1.0"),
    UnusedSetting("prompt_history_decay", _no_prompt_pruning, "is not used while prompt_keep_rate=1.0"),
    UnusedSetting("prompt_history_decay", _probe_score, "is not used with prompt_score={prompt_score!r} (the probe "
                  "needs no history)"),
    UnusedSetting("prompt_probe_generations", _no_prompt_pruning, "is not used while prompt_keep_rate=1.0"),
    UnusedSetting("prompt_score", _no_prompt_pruning, "is not used while prompt_keep_rate=1.0"),
    UnusedSetting("top_entropy_quantile", _with_prompt_pruning, _FILTER_WITH_PROMPT_PRUNING),
    UnusedSetting("max_packed_tokens", _no_packing, "is not used with packing=False"),
    UnusedSetting("prefix_sharing", _no_packing, "is not used with packing=False"),
)


class _WarningContext(dict):
    """The names of an ``UnusedSetting.says`` template: ``why`` and the config's fields."""

    def __init__(self, config: DPPOConfig):
        pruning = config.completion_pruning
        super().__init__(why=f"prune_sampling={config.prune_sampling!r}" if pruning else "completion_keep_rate=1.0")
        self.config = config

    def __missing__(self, name: str):
        return getattr(self.config, name)


def as_dppo_config(args: GRPOConfig) -> DPPOConfig:
    """``args`` itself when it is a ``DPPOConfig``; a ``GRPOConfig`` becomes the ``DPPOConfig`` with the same GRPO
    fields and DPPO's defaults (a warning says so, once a process): swapping only the trainer class keeps the
    setup and turns pruning on."""
    if isinstance(args, DPPOConfig):
        return args
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a DPPOConfig or a GRPOConfig, got {type(args).__name__}.")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    values["generation_batch_size"] = None  # derived from steps_per_generation by __post_init__, as it was
    config = DPPOConfig(**values)
    logger.warning_once(
        f"DPPOTrainer got a GRPOConfig: it trains with DPPO's defaults (completion_keep_rate="
        f"{config.completion_keep_rate}, prune_sampling={config.prune_sampling!r}, packing={config.packing}). Pass a "
        "DPPOConfig to choose them; completion_keep_rate=1.0 and packing=False give GRPO's own path."
    )
    return config
