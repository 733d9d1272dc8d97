"""``DPPOConfig``: ``GRPOConfig`` plus the completion-pruning fields, validated at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from transformers.utils import logging
from trl import GRPOConfig

from .core.estimator import SUPPORTED_LOSS_TYPES
from .core.pruning import default_length_exponent, get_design, sampling_designs, unbiased_designs

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


def _is_number(value) -> bool:
    """An int or float, not a bool (the range checks then compare it; NaN fails every comparison)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_unit_interval(name: str, value) -> None:
    if not _is_number(value) or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"{name}={value!r} is invalid: it must be a number in (0, 1].")


@dataclass
class DPPOConfig(GRPOConfig):
    r"""Configuration of [`DPPOTrainer`]: every field of TRL's `GRPOConfig`, plus the pruning fields below.

    Completion pruning draws, after TRL has computed advantages on the full groups, a random subset of the
    generation batch: row `n` is kept with probability `pi_n = clip(|A_n| / tau, keep_floor, 1)` (rows with
    `A_n == 0` that contribute nothing get `pi_n = 0`), and kept rows are weighted by `1 / pi_n`, so the
    expected loss and gradient equal GRPO's exactly. See `docs/estimator.md`.
    """

    completion_keep_rate: float = field(
        default=_DEFAULT_KEEP_RATE,
        metadata={
            "help": "Target fraction of the generation batch's completions that enter the log-prob and loss "
            "passes, in (0, 1]. The keep probabilities sum to this fraction of the rows (more when "
            "`keep_floor` forces it). 1.0 switches completion pruning off; with `packing=False` too, the trainer "
            "is then `GRPOTrainer` bit for bit (with packing, equal up to float rounding on rotary-position "
            "models). Not used by `prune_sampling='zero_variance'`."
        },
    )
    keep_floor: float = field(
        default=_DEFAULT_KEEP_FLOOR,
        metadata={
            "help": "Smallest keep probability of a row that can contribute to the loss, in (0, 1]. Bounds the "
            "largest Horvitz-Thompson weight by 1 / keep_floor. Used by the unbiased designs only."
        },
    )
    prune_sampling: str = field(
        default=_DEFAULT_SAMPLING,
        metadata={
            "help": "How the kept rows are drawn (default 'stratified': the least gradient error per unit of "
            "compute of the fixed-size unbiased designs in `make bench-variance`, where it beat 'systematic' in "
            "every matched comparison). 'stratified': systematic sampling over rows sorted by group, sign of A "
            "and length, so each group and sign keeps the sum of its pi rounded down or up; 'systematic': "
            "fixed-size probability-proportional-to-size sampling over a random order; 'poisson': independent "
            "Bernoulli(pi); 'balanced': the cube method on the budget, each group's advantages and the other "
            "cost, so the kept count (or tokens) meets its budget and each group's reweighted advantages nearly "
            "sum to the group's (linear in rows: about 20 ms at 512 rows, 3 s at 65,536); all four exactly "
            "unbiased with 1/pi weights. 'topk': CPPO's biased rule, keep the largest |A| with no weights; "
            "'zero_variance': DAPO-style biased filter, drop groups whose rewards are all equal, no weights. Any "
            "name registered with `dppo_trl.core.pruning.register_design` is accepted.",
            "choices": list(sampling_designs()),
        },
    )
    keep_budget: str = field(
        default="rows",
        metadata={
            "help": "What `completion_keep_rate` is a fraction of, for the unbiased designs: 'rows' (the generation "
            "batch's completions: sum(pi) = rate x N) or 'tokens' (its prompt + completion tokens, what the "
            "log-prob and loss passes cost: sum(pi x L) = rate x sum(L)).",
            "choices": list(KEEP_BUDGETS),
        },
    )
    score_length_exponent: float | None = field(
        default=None,
        metadata={
            "help": "gamma of the compute-aware keep scores |A| x L^gamma (L: the row's prompt + completion "
            "tokens, the same L as the token budget's), a number in [-2, 2]; 0 scores |A|. None (default): by "
            "loss_type, -0.5 for the per-sequence means ('grpo', 'sapo'), 0 for the token sums ('dapo' and the "
            "others), the best measured by `make bench-variance` under 'grpo' and 'dapo' (the other loss types "
            "follow the one they resemble, not measured); 0 for 'topk' (CPPO's |A|). Under a token budget the "
            "variance-optimal keep probabilities are proportional to ||g|| / sqrt(L). Used by the unbiased "
            "designs and 'topk'.",
        },
    )
    adaptive_keep_error: float | None = field(
        default=None,
        metadata={
            "help": "When set, each generation batch's keep rate is the smallest from `completion_keep_rate` up to "
            "1 whose estimated pruning error (logged as `dppo/pruning_error`: the Horvitz-Thompson noise relative "
            "to the full batch's gradient, the rows' gradients taken as orthogonal with norms proportional to "
            "their scores) is at most this value, e.g. 0.3: a batch whose signal sits in a few rows prunes down to "
            "`completion_keep_rate`, one whose signal is spread keeps more. `completion_keep_rate` stays the "
            "fewest kept. Still unbiased: the rate, hence pi, is a function of the batch alone, and every "
            "unbiased design keeps each row with probability exactly pi for any such pi (the enumeration tests "
            "of tests/test_unbiased.py). None: a fixed rate. Used by the unbiased designs.",
        },
    )
    adaptive_keep_error_source: str = field(
        default="model",
        metadata={
            "help": "What `adaptive_keep_error` bounds: 'model' (default), the model-based `dppo/pruning_error`; "
            "'audit', the measured relative error of the gradient audit (`audit_every > 0`): the model-based "
            "target is divided by the median ratio of measured to model-based error over the batches audited so "
            "far that pruned (1 before the first; a batch kept whole or without signal has no ratio), so each "
            "batch's keep rate still depends only on earlier batches and its own scores, never on its own draw. "
            "Used with `adaptive_keep_error`.",
            "choices": list(ADAPTIVE_ERROR_SOURCES),
        },
    )
    audit_every: int = field(
        default=0,
        metadata={
            "help": "Online gradient audit: every this many generation batches (the same batches on every rank, "
            "from `seed` and the training position), before the batch's first optimizer step, GRPO's gradient of "
            "the whole batch and DPPO's of its kept rows are computed at the current parameters, both with dropout "
            "off, and compared: `dppo/audit_cosine`, `dppo/audit_rel_error`, `dppo/audit_noise_to_signal` "
            "(measured over model-based error), `dppo/audit_projection` and `dppo/audit_bias_t` (the bias "
            "statistic along GRPO's gradient; `dppo/audit_bias_alarm` once |t| > 4 from 8 counted audits), "
            "`dppo/audit_seconds`. Training is unchanged (the RNG is forked and restored). 0 (default): off. Cost, "
            "memory and the alarm's measured false-alarm rate: docs/usage.md, \"The gradient audit\".",
        },
    )
    audit_sketch_dim: int = field(
        default=_DEFAULT_AUDIT_SKETCH_DIM,
        metadata={
            "help": "Directions of the audit's random sketch (a CountSketch of every trainable parameter's "
            "gradient, seeded, the same on every rank) when there are more than `audit_exact_params` trainable "
            "parameters: norms and cosines within about sqrt(2 / k) relative; the audit keeps two k-vectors. "
            "Used with `audit_every > 0`.",
        },
    )
    audit_exact_params: int = field(
        default=_DEFAULT_AUDIT_EXACT_PARAMS,
        metadata={
            "help": "Up to this many trainable parameters (default 8,388,608: e.g. LoRA r=16 on every linear layer "
            "of SmolLM2-135M, 4.9M), the audit compares the gradients exactly (GRPO's and DPPO's sums as float64 "
            "vectors of this size on the CPU, a third while comparing them). 0: always sketch. Used with "
            "`audit_every > 0`.",
        },
    )
    prune_seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the pruning decisions only (None: derived from `seed`). Runs with the same `seed` "
            "and different `prune_seed` generate the same first completions and differ only in their masks. "
            "Used by the random designs ('systematic', 'poisson', 'stratified', 'balanced') and by prompt pruning's "
            "acceptance draws."
        },
    )

    prompt_keep_rate: float = field(
        default=1.0,
        metadata={
            "help": "Prompt pruning before rollout, in (0, 1]: the target fraction of the prompts the training "
            "sampler has seen that it accepts. A prompt is accepted with probability q = clip(score / tau_q, "
            "prompt_keep_floor, 1), its score being the moving average of its groups' mean |A| (unseen prompts: "
            "q = 1), and carries the weight mean(q) / q. Every accepted prompt trains once (those that do not fill "
            "an epoch's last batch head the next epoch's first), except the run's final leftover of fewer than one "
            "batch of prompts, so each data epoch's expected weighted sum of per-prompt terms is mean(q) x the "
            "dataset's, over mean(q) x GRPO's expected steps: per step, GRPO's expected numerator, exactly (as a "
            "ratio of expectations over the epoch). Losses normalized by rows "
            "(grpo, sapo, luspo, dr_grpo): the expected step is GRPO's. Token-mean losses (dapo, bnpo, cispo, "
            "vespo): they divide by a token count D fixed when the epoch is planned (prompts per batch x "
            "num_generations x the history's mean loss tokens per completion), so the expected step is GRPO's "
            "expected token sum over D, which is GRPO's E[N]/E[T] up to the positive factor E[T]/D (the length "
            "history's error; GRPO's own step is a ratio estimate of E[N]/E[T]). The first epoch (nothing seen) "
            "is GRPO's exactly. 1.0 switches prompt pruning off. Needs a map-style (not streaming) dataset."
        },
    )
    prompt_keep_floor: float = field(
        default=_DEFAULT_PROMPT_KEEP_FLOOR,
        metadata={
            "help": "Smallest acceptance probability of a prompt, in (0, 1]; caps the prompt weight at "
            "1 / prompt_keep_floor. Used with prompt_keep_rate < 1 only."
        },
    )
    prompt_history_decay: float = field(
        default=_DEFAULT_PROMPT_HISTORY_DECAY,
        metadata={
            "help": "Weight of the old value in a prompt's moving-average score, in [0, 1): 0 keeps only the "
            "latest group's mean |A|. Used with prompt_keep_rate < 1 only."
        },
    )
    packing: bool = field(
        default=True,
        metadata={
            "help": "Dense Prompt Packing of the training passes: the kept rows are split into the "
            "`steps_per_generation` micro-batches balanced by tokens, and each micro-batch runs padding-free, "
            "several sequences back to back in one row with position_ids restarting per sequence. Also used "
            "when completion pruning is off. False: TRL's padded micro-batches."
        },
    )
    max_packed_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one packed row (with `packing`). None: with flash attention (cost per "
            "sequence), `per_device_train_batch_size` x the padded sequence width of the generation batch (one "
            "padded micro-batch of TRL); with sdpa or eager (cost quadratic in the packed row), the padded "
            "sequence width. A sequence longer than the budget gets a row of its own; nothing is cut or dropped."
        },
    )

    def __post_init__(self):
        self._validate_dppo_fields()
        super().__post_init__()

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
    def dppo_training_path(self) -> bool:
        """Whether training batches go through DPPO's micro-batching (pruning or packing); otherwise every hook
        is TRL's own and the trainer is exactly `GRPOTrainer`."""
        return self.completion_pruning or self.prompt_pruning or self.packing

    def _validate_dppo_fields(self) -> None:
        _check_unit_interval("completion_keep_rate", self.completion_keep_rate)
        _check_unit_interval("keep_floor", self.keep_floor)
        get_design(self.prune_sampling)  # names the field and the registered designs when unknown
        if self.keep_budget not in KEEP_BUDGETS:
            raise ValueError(f"keep_budget={self.keep_budget!r} is invalid: it must be one of {list(KEEP_BUDGETS)}.")
        gamma = self.score_length_exponent
        if gamma is not None and (not _is_number(gamma) or not -2 <= gamma <= 2):
            raise ValueError(f"score_length_exponent={gamma!r} is invalid: it must be None or a number in [-2, 2].")
        error = self.adaptive_keep_error
        if error is not None and (not _is_number(error) or not 0.0 < float(error) < math.inf):
            raise ValueError(f"adaptive_keep_error={error!r} is invalid: it must be None or a number > 0.")
        if self.prune_seed is not None and (
            isinstance(self.prune_seed, bool) or not isinstance(self.prune_seed, int) or self.prune_seed < 0
        ):
            raise ValueError(f"prune_seed={self.prune_seed!r} is invalid: it must be None or an integer >= 0.")
        self._validate_audit_fields()
        _check_unit_interval("prompt_keep_rate", self.prompt_keep_rate)
        _check_unit_interval("prompt_keep_floor", self.prompt_keep_floor)
        decay = self.prompt_history_decay
        if not _is_number(decay) or not 0.0 <= float(decay) < 1.0:
            raise ValueError(f"prompt_history_decay={decay!r} is invalid: it must be a number in [0, 1).")
        if not isinstance(self.packing, bool):
            raise ValueError(f"packing={self.packing!r} is invalid: it must be True or False.")
        if self.max_packed_tokens is not None and (
            isinstance(self.max_packed_tokens, bool)
            or not isinstance(self.max_packed_tokens, int)
            or self.max_packed_tokens < 1
        ):
            raise ValueError(
                f"max_packed_tokens={self.max_packed_tokens!r} is invalid: it must be None or an integer >= 1."
            )
        scale = self.scale_rewards if isinstance(self.scale_rewards, str) else "group" if self.scale_rewards else "none"
        if self.prompt_pruning and (scale == "batch" or self.multi_objective_aggregation == "normalize_then_sum"):
            raise ValueError(
                f"prompt_keep_rate={self.prompt_keep_rate!r} cannot be combined with scale_rewards={scale!r} "
                f"and multi_objective_aggregation={self.multi_objective_aggregation!r}: a batch-level reward statistic "
                "over the accepted prompts is not GRPO's over the batch it would have drawn. Use scale_rewards='group' "
                "or 'none' with multi_objective_aggregation='sum_then_normalize', or prompt_keep_rate=1.0."
            )
        if self.loss_type not in SUPPORTED_LOSS_TYPES:  # GRPOConfig accepts a typo and fails at the first loss
            raise ValueError(
                f"loss_type={self.loss_type!r} is invalid: it must be one of {list(SUPPORTED_LOSS_TYPES)}."
            )
        unused = self._unused_settings()
        if unused:
            logger.warning("DPPOConfig: " + "; ".join(unused) + ".")

    def _validate_audit_fields(self) -> None:
        for name, low in (("audit_every", 0), ("audit_sketch_dim", 1), ("audit_exact_params", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {low}.")
        if self.adaptive_keep_error_source not in ADAPTIVE_ERROR_SOURCES:
            raise ValueError(
                f"adaptive_keep_error_source={self.adaptive_keep_error_source!r} is invalid: it must be one of "
                f"{list(ADAPTIVE_ERROR_SOURCES)}."
            )
        if self.audit_every and self.prompt_pruning:
            raise ValueError(
                f"audit_every={self.audit_every!r} cannot be combined with prompt_keep_rate={self.prompt_keep_rate!r} "
                "yet: the audit compares completion pruning with GRPO on the same accepted batch, and prompt weights "
                "are unbiased over an epoch, not within one batch. Use prompt_keep_rate=1.0 or audit_every=0."
            )
        if self.audit_every and (self.deepspeed or self.fsdp):
            raise ValueError(
                f"audit_every={self.audit_every!r} is not supported with DeepSpeed or FSDP yet (the audit takes "
                "gradients of the unsharded parameters); set audit_every=0."
            )

    def _unused_audit_settings(self) -> list[str]:
        unused = []
        if not self.audit_every:
            for name, default in (("audit_sketch_dim", _DEFAULT_AUDIT_SKETCH_DIM),
                                  ("audit_exact_params", _DEFAULT_AUDIT_EXACT_PARAMS)):  # fmt: skip
                if getattr(self, name) != default:
                    unused.append(f"{name}={getattr(self, name)!r} is not used while audit_every=0")
        elif not self.dppo_training_path:
            unused.append(f"audit_every={self.audit_every!r} is not used: nothing is pruned or packed (GRPO's path)")
        elif not self.completion_pruning:
            unused.append(
                f"audit_every={self.audit_every!r} with completion_keep_rate=1.0: nothing is pruned, the audit "
                "measures only the float rounding of DPPO's passes"
            )
        if self.adaptive_keep_error_source != "model":
            if self.adaptive_keep_error is None:
                unused.append(
                    f"adaptive_keep_error_source={self.adaptive_keep_error_source!r} is not used while "
                    "adaptive_keep_error=None"
                )
            elif not self.audit_every:
                unused.append(
                    "adaptive_keep_error_source='audit' has no audit to learn from while audit_every=0: the "
                    "model-based error is used"
                )
        return unused

    def _unused_settings(self) -> list[str]:
        """Valid settings that the current configuration does not use (a warning, not an error: sweeps and one-flag
        baselines override one field over a recipe that sets others), and a floor that raises the kept fraction."""
        unused = self._unused_audit_settings()
        if not self.prompt_pruning:
            for name, default in (("prompt_keep_floor", _DEFAULT_PROMPT_KEEP_FLOOR),
                                  ("prompt_history_decay", _DEFAULT_PROMPT_HISTORY_DECAY)):  # fmt: skip
                if getattr(self, name) != default:
                    unused.append(f"{name}={getattr(self, name)!r} is not used while prompt_keep_rate=1.0")
        if self.max_packed_tokens is not None and not self.packing:
            unused.append(f"max_packed_tokens={self.max_packed_tokens!r} is not used with packing=False")
        deterministic = not self.completion_pruning or self.prune_sampling not in unbiased_designs()
        why = "completion_keep_rate=1.0" if not self.completion_pruning else f"prune_sampling={self.prune_sampling!r}"
        if not self.completion_pruning and self.prune_sampling != _DEFAULT_SAMPLING:
            unused.append(f"prune_sampling={self.prune_sampling!r} is not used while completion_keep_rate=1.0")
        if deterministic and self.keep_floor != _DEFAULT_KEEP_FLOOR:
            unused.append(f"keep_floor={self.keep_floor!r} is not used with {why}")
        if deterministic and self.keep_budget != "rows":
            unused.append(f"keep_budget={self.keep_budget!r} is not used with {why}")
        if self.score_length_exponent is not None and (
            not self.completion_pruning or self.prune_sampling == "zero_variance"
        ):
            unused.append(f"score_length_exponent={self.score_length_exponent!r} is not used with {why}")
        if deterministic and self.adaptive_keep_error is not None:
            unused.append(f"adaptive_keep_error={self.adaptive_keep_error!r} is not used with {why}")
        if deterministic and self.prune_seed is not None and not self.prompt_pruning:
            unused.append(f"prune_seed={self.prune_seed!r} is not used with {why} and prompt_keep_rate=1.0")
        if self.prune_sampling == "zero_variance" and self.completion_keep_rate not in (_DEFAULT_KEEP_RATE, 1.0):
            unused.append(
                f"completion_keep_rate={self.completion_keep_rate!r} is not used by prune_sampling='zero_variance' "
                "(it drops exactly the groups whose rewards are all equal)"
            )
        if self.completion_pruning and not deterministic and self.keep_floor > self.completion_keep_rate:
            unused.append(
                f"keep_floor={self.keep_floor!r} is above completion_keep_rate={self.completion_keep_rate!r}: every "
                "row that can contribute is kept with probability at least keep_floor, so more than "
                "completion_keep_rate is kept (weights up to 1 / keep_floor)"
            )
        return unused


def as_dppo_config(args: GRPOConfig) -> DPPOConfig:
    """``args`` itself when it is a ``DPPOConfig``; a ``GRPOConfig`` becomes the ``DPPOConfig`` with the same GRPO
    fields and DPPO's defaults (one info line says so): swapping only the trainer class keeps the setup."""
    if isinstance(args, DPPOConfig):
        return args
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args must be a DPPOConfig or a GRPOConfig, got {type(args).__name__}.")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    values["generation_batch_size"] = None  # derived from steps_per_generation by __post_init__, as it was
    logger.info("DPPOTrainer got a GRPOConfig: using it as a DPPOConfig with DPPO's defaults for the DPPO fields.")
    return DPPOConfig(**values)
