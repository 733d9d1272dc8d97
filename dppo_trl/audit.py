"""The online gradient audit's math (no TRL import): which generation batches are audited, a fixed random sketch
of the trainable parameters' gradients, the comparison of DPPO's and GRPO's sketched gradients of one batch, and
the running bias statistic over the audited batches.

For an unbiased design, DPPO's gradient ``g_dppo`` of a generation batch is a Horvitz-Thompson estimate of
GRPO's ``g_grpo`` of the same batch at the same parameters, so ``d = g_dppo - g_grpo`` has mean zero over the
keep draw, given everything before it. Along any fixed direction ``u`` the audited ``<u, d_t>`` are then
martingale differences: their running mean over ``sqrt(var / n)`` stays within noise. A biased design (``topk``)
has ``E[d] != 0`` and its statistic grows like ``sqrt(n)``.
"""

from __future__ import annotations

import math
import statistics
import zlib
from dataclasses import dataclass

import torch

_SKETCH_CHUNK = 1 << 22  # coordinates hashed per generator call: bounds the index tensor, not the result


def audited_batch(batch_index: int, every: int, seed: int) -> bool:
    """Whether generation batch ``batch_index`` (counted from the start of training) is audited: every
    ``every``-th batch from an offset in ``[0, every)`` drawn from ``seed``. A function of the seed and the
    training position only, so every rank and a resumed run audit the same batches, whatever the keep draw."""
    if every <= 0:
        return False
    offset = (seed * 0x9E3779B97F4A7C15 + 0x2545F4914F6CDD1D) % 2**63 % every
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


def sketch_gradients(sketch: GradientSketch, named_grads: list[tuple[str, torch.Tensor | None, int]]) -> torch.Tensor:
    """``S g`` (float64, on the gradients' device) of ``[(name, grad or None, numel)]`` in a fixed order; a
    parameter without gradient contributes zeros."""
    device = next((g.device for _, g, _ in named_grads if g is not None), torch.device("cpu"))
    if sketch.exact:
        parts = [torch.zeros(n, dtype=torch.float64, device=device) if g is None else g.detach().flatten().double()
                 for _, g, n in named_grads]  # fmt: skip
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64, device=device)
    out = torch.zeros(sketch.dim, dtype=torch.float64, device=device)
    for name, grad, _ in named_grads:
        if grad is None:
            continue
        flat = grad.detach().flatten()
        for chunk, start in enumerate(range(0, flat.numel(), _SKETCH_CHUNK)):
            values = flat[start : start + _SKETCH_CHUNK].double()
            generator = torch.Generator(device=flat.device)
            generator.manual_seed((sketch.seed ^ zlib.crc32(name.encode())) * 1_000_003 + chunk)
            bucket = torch.randint(sketch.dim, (values.numel(),), generator=generator, device=flat.device)
            sign = torch.randint(2, (values.numel(),), generator=generator, device=flat.device).double() * 2 - 1
            out.index_add_(0, bucket, values * sign)
    return out


def compare_gradients(dppo: torch.Tensor, grpo: torch.Tensor) -> dict | None:
    """``cosine`` of the two (sketched) gradients and ``rel_error = ||dppo - grpo|| / ||grpo||``; None when
    GRPO's gradient is zero (the batch carries no signal: nothing to compare against)."""
    grpo_norm, dppo_norm = float(grpo.norm()), float(dppo.norm())
    if grpo_norm == 0.0:
        return None
    cosine = float(dppo @ grpo) / (dppo_norm * grpo_norm) if dppo_norm > 0 else 0.0
    return {"cosine": cosine, "rel_error": float((dppo - grpo).norm()) / grpo_norm}


@dataclass(frozen=True)
class RunningMoments:
    """Count, mean and sum of squared deviations (Welford) of the audited differences, per direction (float64)."""

    count: int = 0
    mean: torch.Tensor | None = None
    m2: torch.Tensor | None = None

    def update(self, x: torch.Tensor) -> RunningMoments:
        x = x.detach().double().cpu()
        if self.count == 0:
            return RunningMoments(1, x.clone(), torch.zeros_like(x))
        count = self.count + 1
        delta = x - self.mean
        mean = self.mean + delta / count
        return RunningMoments(count, mean, self.m2 + delta * (x - mean))


def bias_z(moments: RunningMoments) -> float | None:
    """The largest ``|t|`` over the directions (``t`` = running mean over its standard error, Student's t with
    ``n - 1`` degrees of freedom), as a two-sided z after a Bonferroni correction for the number of directions
    that vary: ``z = Phi^-1(1 - p / 2)`` with ``p = min(1, m x p_min)``. Under unbiasedness
    ``P(z > c) <= 2 (1 - Phi(c))`` (conservative: 3 is exceeded with probability at most 0.27%). None before two
    audits. A direction without spread has no standard error and is left out (e.g. a parameter whose gradient
    is 0 in both estimates, or equal to the last bit across audits); 0 when no direction varies."""
    n = moments.count
    if n < 2:
        return None
    se = (moments.m2.clamp(min=0) / (n - 1) / n).sqrt()
    varies = se > 0
    if not bool(varies.any()):
        return 0.0
    t_max = float((moments.mean[varies].abs() / se[varies]).max())
    p = min(1.0, int(varies.sum()) * student_t_two_sided_p(t_max, n - 1))
    return two_sided_z(p)


def two_sided_z(p: float) -> float:
    """The z with ``P(|N(0, 1)| > z) = p``: 0 at ``p = 1``, inf at ``p = 0``."""
    if p >= 1.0:
        return 0.0
    return math.inf if p <= 0.0 else -statistics.NormalDist().inv_cdf(p / 2)


def student_t_two_sided_p(t: float, df: int) -> float:
    """``P(|T| > t)`` for Student's t with ``df`` degrees of freedom: ``I_x(df / 2, 1 / 2)``, ``x = df / (df + t²)``."""
    return regularized_incomplete_beta(df / 2.0, 0.5, df / (df + t * t))


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """``I_x(a, b)`` by its continued fraction (evaluated with Lentz's method), on the side where it converges
    fast (``x < (a + 1) / (a + b + 2)``) or through ``I_x(a, b) = 1 - I_{1-x}(b, a)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - regularized_incomplete_beta(b, a, 1.0 - x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a


def _beta_continued_fraction(a: float, b: float, x: float, steps: int = 1000, eps: float = 1e-15) -> float:
    """``1 / (1 + d_1 / (1 + d_2 / (1 + ...)))`` with ``d_{2m} = m (b - m) x / ((a + 2m - 1)(a + 2m))`` and
    ``d_{2m+1} = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1))``."""
    tiny = 1e-300
    f, c, d = tiny, tiny, 0.0
    for k in range(steps + 1):
        if k == 0:
            coefficient = 1.0
        elif k % 2 == 0:
            m = k // 2
            coefficient = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            m = k // 2
            coefficient = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + coefficient * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + coefficient / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if k > 0 and abs(c * d - 1.0) < eps:
            break
    return f


def measured_error_scale(ratios: list[float]) -> float:
    """The factor by which the measured relative error exceeds the model-based ``pruning_relative_error``: the
    median of the audited batches' ratios so far, 1.0 before the first audit."""
    finite = [r for r in ratios if math.isfinite(r) and r > 0]
    return statistics.median(finite) if finite else 1.0
