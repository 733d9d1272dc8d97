"""The online gradient audit's math (no TRL import): which generation batches are audited, a fixed random sketch
of the trainable parameters' gradients, the comparison of DPPO's and GRPO's sketched gradients of one batch, the
running bias statistic over the audited batches, and the dropout switch both gradient passes run under.

For an unbiased design, DPPO's gradient ``g_dppo`` of a generation batch is a Horvitz-Thompson estimate of
GRPO's ``g_grpo`` of the same batch at the same parameters, so ``d = g_dppo - g_grpo`` has mean zero over the
keep draw, given the batch. The audit tests it along GRPO's own gradient: the projection
``r = <d, g_grpo> / |g_grpo|^2`` has conditional mean exactly 0 given the batch (``g_grpo`` is fixed by the batch,
``d`` is linear in the weights; so also through a fixed sketch), so the audited ``r_t`` are martingale
differences and their Student t stays within noise, while a design that shrinks the gradient drives it below
``-BIAS_ALARM_T`` within a few audits (``topk``, which drops the small-|A| rows unweighted, on the tiny model and
on SmolLM2: ``r < 0`` on nearly every pruned batch). A bias orthogonal to ``g_grpo`` does not show in ``r``.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch

from .seeds import derive_seed, named_seed

_SKETCH_CHUNK = 1 << 22  # coordinates hashed per generator call: bounds the index tensor, not the result

# The bias alarm: |bias t| above BIAS_ALARM_T at any audit from the BIAS_ALARM_MIN_AUDITS-th counted one on.
# Its false-alarm rate is measured, not derived (r is skewed and heavy-tailed, and every audit is a look):
# tests/test_audit.py::test_the_bias_alarms_false_alarm_rate_over_seeded_runs.
BIAS_ALARM_T = 4.0
BIAS_ALARM_MIN_AUDITS = 8


def audited_batch(batch_index: int, every: int, seed: int) -> bool:
    """Whether generation batch ``batch_index`` (counted from the start of training) is audited: every
    ``every``-th batch from an offset in ``[0, every)`` drawn from ``seed``. A function of the seed and the
    training position only, so every rank and a resumed run audit the same batches, whatever the keep draw."""
    if every <= 0:
        return False
    offset = derive_seed("audit_offset", seed) % every
    return (batch_index + offset) % every == 0


@dataclass(frozen=True)
class GradientSketch:
    """A fixed linear map from the trainable parameters' gradients to ``dim`` float64 numbers. ``exact``: the
    concatenated gradients themselves (``dim`` = their count), so norms and cosines are exact. Otherwise a
    CountSketch: coordinate ``i`` of parameter ``name`` goes to one of ``dim`` directions with a random sign, both
    drawn from a generator seeded by ``seed``, the name and the chunk, so every rank (same device type) uses the
    same directions; inner products are unbiased, with a relative standard deviation of about ``sqrt(2 / dim)``
    for the squared norm."""

    dim: int
    exact: bool
    seed: int


def make_sketch(num_parameters: int, sketch_dim: int, exact_max: int, seed: int) -> GradientSketch:
    """The exact map when there are at most ``exact_max`` trainable parameters, else a ``sketch_dim`` CountSketch."""
    if num_parameters <= exact_max:
        return GradientSketch(dim=num_parameters, exact=True, seed=seed)
    return GradientSketch(dim=sketch_dim, exact=False, seed=seed)


def sketch_seed(seed: int, name: str, chunk: int) -> int:
    """The generator seed of chunk ``chunk`` of parameter ``name``: reduced modulo 2^63, since
    ``torch.Generator.manual_seed`` takes 64 bits (any training ``seed``, 2^62 and above included)."""
    return named_seed(seed, name, chunk)


def sketch_gradients(sketch: GradientSketch, named_grads: list[tuple[str, torch.Tensor | None, int]],
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``S g`` (float64, on the CPU) of ``[(name, grad or None, numel)]`` in a fixed order, added into ``out`` when
    given (a running sum over micro-batches); a parameter without gradient contributes zeros. The exact map adds
    each parameter's gradient into its slice, copied to the CPU in float64 one parameter at a time (no full-size
    copy besides ``out``, on the CPU or the gradients' device); the CountSketch hashes on the gradients' device, a
    chunk of ``_SKETCH_CHUNK`` coordinates at a time, into ``dim`` numbers."""
    if out is None:
        out = torch.zeros(sketch.dim, dtype=torch.float64)
    if sketch.exact:
        offset = 0
        for _, grad, numel in named_grads:
            if grad is not None:
                out[offset : offset + numel] += grad.detach().flatten().to("cpu", torch.float64)
            offset += numel
        return out
    device = next((g.device for _, g, _ in named_grads if g is not None), out.device)
    hashed = torch.zeros(sketch.dim, dtype=torch.float64, device=device)
    for name, grad, _ in named_grads:
        if grad is None:
            continue
        flat = grad.detach().flatten()
        for chunk, start in enumerate(range(0, flat.numel(), _SKETCH_CHUNK)):
            values = flat[start : start + _SKETCH_CHUNK].double()
            generator = torch.Generator(device=flat.device)
            generator.manual_seed(sketch_seed(sketch.seed, name, chunk))
            bucket = torch.randint(sketch.dim, (values.numel(),), generator=generator, device=flat.device)
            sign = torch.randint(2, (values.numel(),), generator=generator, device=flat.device).double() * 2 - 1
            hashed.index_add_(0, bucket, values * sign)
    return out.add_(hashed.cpu())


def compare_gradients(dppo: torch.Tensor, grpo: torch.Tensor) -> dict | None:
    """``cosine`` of the two (sketched) gradients, ``rel_error = ||dppo - grpo|| / ||grpo||`` and ``projection =
    <dppo - grpo, grpo> / ||grpo||^2`` (the bias statistic's increment); None when GRPO's gradient is zero (the
    batch carries no signal: nothing to compare against)."""
    grpo_norm, dppo_norm = float(grpo.norm()), float(dppo.norm())
    if grpo_norm == 0.0:
        return None
    difference = dppo - grpo
    cosine = float(dppo @ grpo) / (dppo_norm * grpo_norm) if dppo_norm > 0 else 0.0
    return {"cosine": cosine, "rel_error": float(difference.norm()) / grpo_norm,
            "projection": float(difference @ grpo) / grpo_norm**2}


def bias_t(projections: list[float]) -> float | None:
    """Student's t of the audited projections: their mean over its standard error, ``mean / (sd / sqrt(n))``.
    None before two; without spread, 0 if they are all 0, else +-inf (a bias that shows on every batch alike)."""
    n = len(projections)
    if n < 2:
        return None
    mean, sd = statistics.fmean(projections), statistics.stdev(projections)
    if sd == 0.0:
        return 0.0 if mean == 0.0 else math.copysign(math.inf, mean)
    return mean / (sd / math.sqrt(n))


def bias_alarm(projections: list[float]) -> bool:
    """Whether the audits so far raise the bias alarm: ``|bias_t| > BIAS_ALARM_T`` with at least
    ``BIAS_ALARM_MIN_AUDITS`` counted audits (checked at every audit)."""
    t = bias_t(projections)
    return len(projections) >= BIAS_ALARM_MIN_AUDITS and t is not None and abs(t) > BIAS_ALARM_T


def _is_rate(value) -> bool:
    return isinstance(value, float) and value != 0.0


def _dropout_attributes(obj) -> list[str]:
    """Float attributes of ``obj`` that are dropout probabilities by name (``attention_dropout``,
    ``hidden_dropout``, ``attn_pdrop``, ...), non-zero."""
    return [name for name, value in vars(obj).items()
            if ("dropout" in name or name.endswith("pdrop")) and _is_rate(value)]


def _dropout_holders(model: torch.nn.Module) -> list:
    """Every module of ``model`` and every model config on them: where dropout rates are kept."""
    holders = list(model.modules())
    holders += list({id(c): c for m in holders if (c := getattr(m, "config", None)) is not None and
                     hasattr(c, "__dict__") and not isinstance(c, torch.nn.Module)}.values())
    return holders


def has_dropout(model: torch.nn.Module) -> bool:
    """Whether a forward of ``model`` in train mode draws dropout: a ``torch.nn.Dropout``-family module with
    ``p > 0``, or a non-zero dropout rate on a module or a model config."""
    modules = [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    return bool(modules) or any(_dropout_attributes(obj) for obj in _dropout_holders(model))


@contextlib.contextmanager
def dropout_disabled(model: torch.nn.Module):
    """Dropout off in ``model`` while inside, every setting restored after; ``model.training`` stays as it is.
    Each ``torch.nn.Dropout``-family module goes to eval mode with ``p = 0`` (some attention layers read ``p``
    under their own training flag), and each non-zero dropout rate kept as a float, on a module
    (``attention_dropout``, which HF attention layers copy from their config and pass to the attention kernel
    while training) or on a model config, is set to 0."""
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    saved_dropouts = [(m, m.training, m.p) for m in dropouts]
    saved_rates = [(obj, name, getattr(obj, name)) for obj in _dropout_holders(model)
                   for name in _dropout_attributes(obj)]
    try:
        for module in dropouts:
            module.training, module.p = False, 0.0
        for obj, name, _ in saved_rates:
            setattr(obj, name, 0.0)
        yield
    finally:
        for module, training, p in saved_dropouts:
            module.training, module.p = training, p
        for obj, name, value in saved_rates:
            setattr(obj, name, value)


def measured_error_scale(ratios: list[float]) -> float:
    """The factor by which the measured relative error exceeds the model-based ``pruning_relative_error``: the
    median of the audited batches' ratios so far, 1.0 before the first audit."""
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    return statistics.median(finite) if finite else 1.0


@dataclass(frozen=True)
class PhaseSeconds:
    """Seconds of one generation batch's phases for one method, as an audit measures them at the same parameters.

    Args:
        generation: TRL's generation and scoring of the batch (the same for GRPO and DPPO).
        logps: the old-policy and reference log-prob passes (GRPO: every row; DPPO: the kept rows).
        gradient: one forward and backward over the batch's micro-batches (once per iteration).
    """

    generation: float
    logps: float
    gradient: float


def projected_time_ratios(grpo: PhaseSeconds, dppo: PhaseSeconds, num_iterations: int = 1) -> dict | None:
    """DPPO's training and step time as ratios to GRPO's, from one audited batch's phases.

    Training is the log-prob passes plus ``num_iterations`` gradient passes. The step is generation plus
    training; what neither phase covers (optimizer, logging) is left out, so the step ratio is a projection.

    Args:
        grpo, dppo: the phases of each method on the same batch (``generation`` is read from ``grpo``).
        num_iterations: TRL's ``num_iterations``, the gradient passes per generation batch.

    Returns:
        ``{"train_time_ratio", "step_time_ratio", "generation_share"}`` (the share of generation in GRPO's step),
        or None when GRPO's phases took no time.
    """
    grpo_train = grpo.logps + num_iterations * grpo.gradient
    dppo_train = dppo.logps + num_iterations * dppo.gradient
    grpo_step = grpo.generation + grpo_train
    if grpo_train <= 0 or grpo_step <= 0:
        return None
    return {"train_time_ratio": dppo_train / grpo_train,
            "step_time_ratio": (grpo.generation + dppo_train) / grpo_step,
            "generation_share": grpo.generation / grpo_step}


def run_speed_metrics(train_ratios: list[float], step_ratios: list[float], generation_shares: list[float],
                      run_seconds: float, measuring_seconds: float = 0.0) -> dict:
    """What a run saved, from its timed batches (``projected_time_ratios`` of each), its wall seconds and the seconds
    its measurements took (the speed check's and the audits' own passes, which GRPO would not run).

    Args:
        train_ratios, step_ratios, generation_shares: one value per timed batch.
        run_seconds: the run's wall time, its measurements included.
        measuring_seconds: the part of ``run_seconds`` spent measuring.

    Returns:
        ``dppo/speed_step_time_ratio``, ``dppo/speed_train_time_ratio``, ``dppo/speed_generation_share``
        (medians over the timed batches), ``dppo/speed_measuring_seconds``, ``dppo/speed_projected_grpo_seconds``
        (the run's training time, its measurements taken out, over the step ratio: GRPO's time for the same steps,
        projected) and ``dppo/speed_projected_seconds_saved`` (GRPO's projected time less the whole run's, so what
        the measurements cost counts against the saving); empty without a timed batch.
    """
    if not step_ratios:
        return {}
    step = statistics.median(step_ratios)
    grpo_seconds = (run_seconds - measuring_seconds) / step if step > 0 else float("nan")
    return {"dppo/speed_step_time_ratio": step, "dppo/speed_train_time_ratio": statistics.median(train_ratios),
            "dppo/speed_generation_share": statistics.median(generation_shares),
            "dppo/speed_measuring_seconds": measuring_seconds,
            "dppo/speed_projected_grpo_seconds": grpo_seconds,
            "dppo/speed_projected_seconds_saved": grpo_seconds - run_seconds}


# A timed batch stands for the run while the share of completion tokens it kept is within this factor of the
# run's mean share: training time follows the kept tokens.
REPRESENTATIVE_FACTOR = 2.0


def representative_timing(timed_token_fractions: list[float], run_token_fraction: float) -> bool:
    """Whether the timed batches kept about as many completion tokens as the run's batches did on average: their
    median within ``REPRESENTATIVE_FACTOR`` of ``run_token_fraction`` either way (a batch that kept almost nothing,
    e.g. one of groups without signal, times a training phase far shorter than the run's)."""
    if not timed_token_fractions or not run_token_fraction > 0:
        return True
    ratio = statistics.median(timed_token_fractions) / run_token_fraction
    return 1 / REPRESENTATIVE_FACTOR <= ratio <= REPRESENTATIVE_FACTOR


def speed_check_batch(generation_batches: int) -> int:
    """The generation batch the speed check times: the second, past the first batch's one-time costs (allocator,
    kernel selection), or the first when the run has one."""
    return 1 if generation_batches >= 2 else 0


def step_ratio_at_share(train_time_ratio: float, generation_share: float) -> float:
    """The step ratio on a machine where generation takes ``generation_share`` of GRPO's step and DPPO changes
    training only: ``s + (1 - s) * train_time_ratio``."""
    return generation_share + (1.0 - generation_share) * train_time_ratio


def synchronized_clock() -> float:
    """``time.perf_counter()`` once queued GPU work has finished (a phase's seconds include its kernels)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()
