"""Gradient efficiency per unit of compute: how close each pruning design's gradient estimate comes to the
population gradient, for the tokens its log-prob and loss passes allocate (docs/benchmarks.md, "Gradient error per
unit of compute", states the protocol and reads the results).

Checkpoints of a countdown model (`dppo_trl.tasks.countdown`, a char-level Qwen2 after 300, 400, 550 supervised
steps, each built on the previous one) stand in for stages of training. Per checkpoint, a pool of ``--batches``
generation batches of ``--prompts`` prompts x ``--group-size`` completions (temperature 1, exact-chain reward,
TRL's group advantages), plus one more independent group per prompt: its mean |A| and mean completion tokens are the
prompt's history (prompt pruning). Per row, ``h_n = grad sum_t log p(token t | prefix)`` in float64; the policy term
of TRL's loss (``beta=0``, on policy) is ``g_n = c_n h_n``, ``c_n = -A_n / T_b`` (``dapo``) or ``-A_n / (L_n N_b)``
(``grpo``).

Designs (``--designs``, default ``default_designs()``): ``<design>[+tokens][+g<gamma>][+e<target>]@<rate>`` draws
the package's registered unbiased design ``<design>`` (``pruning.unbiased_designs()``) through ``pruning.get_design``
on the trainer's ``PruneProblem`` of the batch at ``completion_keep_rate=<rate>``; ``+tokens`` is
``keep_budget="tokens"``, ``+g<gamma>`` ``score_length_exponent=gamma``, ``+e<target>`` ``adaptive_keep_error=target``.
A newly registered design is measured with no code here (``<name>@0.5`` joins the defaults); a ``DESIGNS`` entry not
registered is skipped with a warning. The registered biased designs (``topk[@<rate>]``, ``zero_variance``) go through
``get_design`` too. Custom: ``grpo`` (the batch, TRL's padded passes), ``packing`` (every row, DPPO's packed passes),
``prompt@<rate>`` (prompt pruning alone), ``dppo+prompt@<rate>`` (then ``systematic`` over the accepted rows),
``prompt+exact_lengths@<rate>`` (``dapo``'s ``D_b = T_b``: an exact length history) and
``oracle[+tokens][+g<gamma>]@<rate>`` (keep probabilities proportional to ``||g_n|| / sqrt(cost_n)`` at the expected
tokens of ``systematic`` with the same options: the optimum of the family, the limit to compare with). One
``PruneProblem`` per batch and variant serves every design and draw of it (its keep probabilities solved once).

A design estimates batch b's gradient as ``sum_n w_n g_n`` (the full-batch normalizer stays, as in the trainer); its
squared error to the population gradient (the pool mean) is a quadratic form on the Gram ``diag(c) h h^T diag(c)``,
of which only the diagonal blocks and the products with the batches' gradients are formed (``Quadratics``). Averaged
over batches and ``--prune-seeds`` draws (seeded by ``dppo_trl.core.seeds.named_seed``): ``mse``, ``mse_to_batch``
(the pruning noise alone), ``bias`` (the seed-mean error to the batch gradient over its norm; ``bias_noise`` what
the seeds alone give an unbiased design), ``compute`` (tokens ONE log-prob or loss pass allocates: TRL's padded batch
for ``grpo``, DPPO's packed micro-batches otherwise), ``efficiency = (mse x compute)_grpo / (mse x compute)_design``;
and the balance of the draws: ``kept_rows_sd`` and ``kept_tokens_rel_sd`` (spread over the seeds of the kept rows
and of their tokens over its mean) and ``group_imbalance`` (how far each group's weighted advantages stray
from their total, over the batch's total |A|).

Caveats. The batch gradients are mostly noise here (GRPO's relative error to the pool mean is above 1), so the MSE
to the pool mean rewards shrinkage: a biased design that shrinks the estimate (``topk``) can show less MSE than the
full batch. Under ``dapo``, ``prompt@`` divides, as the trainer does, by a token count fixed before the acceptance
draw (``prompt_token_normalizer``): its expected estimate is ``N_b / D_b``, so its ``bias`` is the length history's
error ``|T_b / D_b - 1|``; ``prompt+exact_lengths@`` shows the estimate's own bias, at the noise level.

About 7.5 minutes here single-threaded from scratch (4 of them the supervised warm start, cached under
``--model-cache``; about 3 once cached), the two ``balanced`` designs' cube walks about 2.5 more.

    python benchmarks/bench_variance.py                          # writes benchmarks/results/bench_variance.json
    python benchmarks/bench_variance.py --checkpoints 300 --batches 4 --prune-seeds 50 --json /tmp/v.json
    python benchmarks/bench_variance.py --designs grpo systematic@0.5 poisson+tokens+g0.25@0.4 --json /tmp/v.json
    python benchmarks/bench_variance.py --designs grpo prompt@0.5 dppo+prompt@0.5 --merge   # re-measure these rows
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from harness import config_default, group_advantages, read_json, result_path, text_table, write_json  # noqa: E402

from dppo_trl.core.estimator import horvitz_thompson_weights  # noqa: E402
from dppo_trl.core.packing import assign_microbatches, default_packed_tokens, packed_allocation  # noqa: E402
from dppo_trl.core.pruning import (  # noqa: E402
    PruneProblem,
    adaptive_keep_rate,
    get_design,
    keep_probabilities,
    sampling_designs,
    systematic_sample,
    unbiased_designs,
    zero_spread_rows,
)
from dppo_trl.core.seeds import named_seed  # noqa: E402

# <design>[+tokens][+g<gamma>]@r (see parse_design); +tokens@0.4 spends about what @0.5 does in rows.
DESIGNS = (
    "grpo", "packing", "systematic@0.75", "systematic@0.5", "systematic@0.25", "poisson@0.5", "stratified@0.5",
    "balanced@0.5", "systematic+g-0.5@0.5", "stratified+g-0.5@0.5", "systematic+g0.5@0.5", "systematic+tokens@0.4",
    "stratified+tokens@0.4", "balanced+tokens@0.4", "systematic+tokens+g0.25@0.4", "systematic+tokens+g-0.5@0.4",
    "stratified+tokens+g-0.5@0.4", "stratified+e0.3@0.25", "stratified+e0.5@0.25", "topk@0.5", "zero_variance",
    "prompt@0.5", "dppo+prompt@0.5", "prompt+exact_lengths@0.5", "oracle@0.5",
)
# The designs implemented here, not registered in the package: whether each takes (then needs) @<rate>.
CUSTOM_DESIGNS = {"grpo": False, "packing": False, "prompt": True, "dppo+prompt": True, "prompt+exact_lengths": True,
                  "oracle": True}
PROMPT_DESIGNS = ("prompt", "dppo+prompt", "prompt+exact_lengths")
MODIFIERS = "[+tokens][+g<gamma>][+e<target>]"
LOSS_TYPES = ("dapo", "grpo")
STEPS_PER_GENERATION, PER_DEVICE_ROWS = 4, 16  # DPPO trainer's micro-batching of one generation batch
KEEP_FLOOR, PROMPT_KEEP_FLOOR = config_default("keep_floor"), config_default("prompt_keep_floor")


@dataclass(frozen=True)
class DesignSpec:
    """A parsed design name: ``base`` (a registered design or a ``CUSTOM_DESIGNS`` one), its keep rate (None when
    the name has none) and the ``PruneProblem`` settings of ``+tokens``, ``+g<gamma>`` and ``+e<target>``."""

    base: str
    rate: float | None = None
    tokens: bool = False  # budget_in_tokens
    gamma: float = 0.0  # length_exponent
    error: float | None = None  # adaptive_keep_error: the batch's rate from <rate> up to meet it

    @property
    def variant(self) -> tuple:
        """What fixes a batch's keep probabilities: the designs of one variant share its ``PruneProblem``."""
        return (self.rate, self.tokens, self.gamma, self.error)


def design_grammar() -> str:
    """The valid design names, in words (for error messages)."""
    biased = [f"{name}[@<rate>]" for name in sampling_designs() if name not in unbiased_designs()]
    return (f"grpo, packing, prompt@<rate>, dppo+prompt@<rate>, prompt+exact_lengths@<rate>, oracle{MODIFIERS}@<rate>, "
            f"{', '.join(biased)} or <design>{MODIFIERS}@<rate> with <design> one of {list(unbiased_designs())}, "
            "0 < rate <= 1")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _parse(design: str) -> tuple[DesignSpec | None, str]:
    """``(spec, "")``, or ``(None, why design is invalid)``. The base is a ``CUSTOM_DESIGNS`` name or a design of the
    package's registry (``sampling_designs()``); modifiers (each at most once) only on an unbiased one."""
    head, at, rate_text = design.partition("@")
    base, *mods = [head] if head in CUSTOM_DESIGNS else head.split("+")
    if base not in CUSTOM_DESIGNS and base not in sampling_designs():
        return None, f"{base!r} is not a registered sampling design"
    unbiased = base == "oracle" or base in unbiased_designs()
    fields = {}
    for mod in mods:
        name = "tokens" if mod == "tokens" else {"g": "gamma", "e": "error"}.get(mod[:1])
        value = True if name == "tokens" else _number(mod[1:])
        if not unbiased or name in (None, *fields) or value is None or (name == "error" and value <= 0):
            return None, f"+{'+'.join(mods)} is not {MODIFIERS} (<target> > 0) on an unbiased design"
        fields[name] = value
    rate = _number(rate_text) if at else None
    if at and not CUSTOM_DESIGNS.get(base, True):
        return None, f"{base} takes no @<rate>"
    if at and (rate is None or not 0.0 < rate <= 1.0):
        return None, f"@{rate_text} is not a keep rate in (0, 1]"
    if not at and CUSTOM_DESIGNS.get(base, unbiased):  # a registered biased design's rate is optional
        return None, f"{base} needs @<rate>"
    return DesignSpec(base, rate, **fields), ""


def parse_design(design: str) -> DesignSpec:
    """``"systematic+tokens+g-0.5@0.4"`` -> ``DesignSpec("systematic", 0.4, True, -0.5)``. A registered biased
    design's rate is optional (keep rate 1 without one). ValueError naming the valid names for any other."""
    spec, why = _parse(design)
    if spec is None:
        raise ValueError(f"design {design!r} is invalid: {why}; expected {design_grammar()}")
    return spec


def available_designs(designs=DESIGNS) -> list[str]:
    """``designs`` less those that are not valid now (e.g. a design not registered yet), each with a warning."""
    out = []
    for design in designs:
        spec, why = _parse(design)
        if spec is None:
            print(f"warning: design {design!r} skipped: {why}", file=sys.stderr, flush=True)
        else:
            out.append(design)
    return out


def default_designs() -> list[str]:
    """``available_designs()``, then ``<name>@0.5`` for each registered unbiased design that ``DESIGNS`` omits
    (a newly registered design is measured by default)."""
    named = {design.partition("@")[0].split("+")[0] for design in DESIGNS}
    return available_designs() + [f"{name}@0.5" for name in unbiased_designs() if name not in named]


def design_argument(text: str) -> str:
    """``--designs`` type: the name itself, once ``parse_design`` accepts it."""
    try:
        parse_design(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


# ---------------------------------------------------------------------------------------------- pure parts
@dataclass
class Batch:
    """One generation batch: ``group_size`` consecutive rows per prompt. ``history``: per prompt, the mean |A|
    of one more independent group (its prompt-pruning score); ``history_tokens``: that group's mean completion
    tokens (its loss-token history)."""

    rewards: torch.Tensor  # (N,) float64
    advantages: torch.Tensor  # (N,) float64, exactly 0 on zero-spread groups
    prompt_tokens: torch.Tensor  # (N,) long
    completion_tokens: torch.Tensor  # (N,) long: loss tokens L_n (eos included when generated)
    history: torch.Tensor  # (N / group_size,) float64
    group_size: int
    history_tokens: torch.Tensor | None = None  # (N / group_size,) float64: the history group's mean L_n

    @property
    def scores(self) -> torch.Tensor:
        """|A| with zero-spread groups forced to exactly 0 (the trainer's pruning scores)."""
        return torch.where(zero_spread_rows(self.rewards, self.group_size), 0.0, self.advantages.abs())

    @property
    def cost(self) -> torch.Tensor:
        """Tokens of each row's sequence (prompt + completion), float64."""
        return (self.prompt_tokens + self.completion_tokens).double()


def loss_coefficients(loss_type: str, batch: Batch) -> torch.Tensor:
    """``c_n`` with ``g_n = c_n h_n``: ``-A_n / T_b`` (``dapo``) or ``-A_n / (L_n N_b)`` (``grpo``)."""
    lengths = batch.completion_tokens.double()
    if loss_type == "dapo":
        return -batch.advantages / lengths.sum()
    if loss_type == "grpo":
        return -batch.advantages / (lengths * lengths.numel())
    raise ValueError(f"loss_type={loss_type!r}: expected one of {LOSS_TYPES}")


def padded_tokens(batch: Batch) -> int:
    """TRL: every row of the generation batch allocates the widest prompt + the widest completion."""
    return batch.prompt_tokens.numel() * int(batch.prompt_tokens.max() + batch.completion_tokens.max())


@functools.lru_cache(maxsize=200_000)
def _packed_tokens(lengths: tuple[int, ...], width: int) -> int:
    bins = assign_microbatches(list(lengths), STEPS_PER_GENERATION, PER_DEVICE_ROWS)
    budget = default_packed_tokens(PER_DEVICE_ROWS, width, varlen_attention=False)
    # An empty micro-batch forwards one filler token, as the trainer's `with_fillers` does.
    return sum(packed_allocation([lengths[i] for i in b] or [1], budget, PER_DEVICE_ROWS * width) for b in bins)


def packed_tokens(batch: Batch, passed: torch.Tensor, generated: torch.Tensor) -> int:
    """DPPO's trainer: the ``passed`` rows in ``STEPS_PER_GENERATION`` LPT micro-batches, each packed with the
    row budget of sdpa (the padded width of the ``generated`` rows); 0 when nothing was generated."""
    if not bool(generated.any()):
        return 0
    width = int(batch.prompt_tokens[generated].max() + batch.completion_tokens[generated].max())
    lengths = (batch.prompt_tokens + batch.completion_tokens)[passed].tolist()
    return _packed_tokens(tuple(sorted(lengths)), width)  # the bins' profile depends only on the multiset


def oracle_probabilities(norms: torch.Tensor, cost: torch.Tensor, budget: float) -> torch.Tensor:
    """``pi_n = min(1, t ||g_n|| / sqrt(cost_n))`` with ``sum pi_n cost_n = budget`` (every row with a
    gradient kept when the budget allows): the keep probabilities that minimize the variance of the
    Horvitz-Thompson sum under independent sampling, ``sum_n (1/pi_n - 1) ||g_n||^2``, at an expected token
    budget. Rows with ``||g_n|| = 0`` get 0."""
    norms, cost = norms.double(), cost.double()
    a = norms / cost.sqrt()
    positive = a > 0
    pi = torch.zeros_like(a)
    capped = torch.zeros_like(positive)
    for _ in range(a.numel() + 1):
        free = positive & ~capped
        rest = budget - float(cost[capped].sum())
        if rest <= 0 or not bool(free.any()):
            break
        t = rest / float((a[free] * cost[free]).sum())
        newly = free & (t * a >= 1.0)
        if not bool(newly.any()):
            pi[free] = t * a[free]
            break
        capped |= newly
    pi[capped] = 1.0
    return pi


# Prompt pruning, per candidate batch: each prompt j is accepted independently with probability q_j (the history
# score's clip(score / tau, floor, 1) with mean keep_rate) and its rows carry 1/q_j: the Poisson version of the
# trainer's fixed-size cut, with the same inclusion probabilities and weights. Its dapo normalizer is
# prompt_token_normalizer.
def prompt_acceptance(batch: Batch, keep_rate: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted rows, per-row prompt weight ``1/q_j`` on them, 0 elsewhere)."""
    q, _ = keep_probabilities(batch.history, keep_rate, PROMPT_KEEP_FLOOR, zero_score_contributes=True)
    accepted = torch.rand(q.numel(), generator=generator, dtype=torch.float64) < q
    rows = accepted.repeat_interleave(batch.group_size)
    return rows, torch.where(rows, 1.0 / q.repeat_interleave(batch.group_size), 0.0)


@dataclass
class Draw:
    """One draw of a design on one batch: the trainer's row weights (HT x prompt weights; 0 on rows not passed),
    the rows through the passes, the rows generated, and the tokens the passes allocate."""

    weights: torch.Tensor
    passed: torch.Tensor
    generated: torch.Tensor
    prompt_weights: torch.Tensor | None  # 1/q_j on generated rows under prompt pruning (dapo: over D_b), else None
    tokens: int


def batch_problem(batch: Batch, spec: DesignSpec, rows: torch.Tensor | None = None) -> PruneProblem:
    """The trainer's ``PruneProblem`` over ``batch``'s ``rows`` (default all; its groups renumbered) at ``spec``'s
    rate (1 without one) and budget: signed advantages (0 on zero-spread groups), prompt + completion tokens as
    costs, the package's keep floor, zero scores never kept, rows without completion tokens contributing nothing."""
    rows = torch.ones_like(batch.rewards, dtype=torch.bool) if rows is None else rows
    problem = PruneProblem(
        advantages=batch.advantages[rows],
        costs=batch.cost[rows],
        groups=torch.arange(int(rows.sum())) // batch.group_size,
        rewards=batch.rewards[rows],
        keep_rate=1.0 if spec.rate is None else spec.rate,
        keep_floor=KEEP_FLOOR,
        zero_score_contributes=False,
        contributes_nothing=batch.completion_tokens[rows] == 0,
        budget_in_tokens=spec.tokens,
        length_exponent=spec.gamma,
    )
    if spec.error is None:
        return problem
    return dataclasses.replace(problem, keep_rate=adaptive_keep_rate(problem, spec.error))


def cached_problem(batch: Batch, spec: DesignSpec, problems: dict, rows: torch.Tensor | None = None) -> PruneProblem:
    """``batch_problem``, built once per (variant, rows) in ``problems`` (one dict per batch): every design and
    draw of a variant shares the instance, so its keep probabilities are solved once (``PruneProblem`` memoizes)."""
    key = (spec.variant, None if rows is None else tuple(rows.nonzero().flatten().tolist()))
    if key not in problems:
        problems[key] = batch_problem(batch, spec, rows)
    return problems[key]


def registered_draw(name: str, problem: PruneProblem, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_design(name)`` on ``problem``: (kept rows, their weights: ``1 / pi`` for an unbiased design, 1 for a
    biased one; 0 elsewhere)."""
    keep, pi = get_design(name)(problem, generator)
    return keep, keep.double() if pi is None else horvitz_thompson_weights(pi, keep)


def oracle_keep_probabilities(spec: DesignSpec, batch: Batch, norms: torch.Tensor, problems: dict) -> torch.Tensor:
    """``oracle_probabilities`` at the expected tokens of ``systematic`` with ``spec``'s rate and budget (fixed per
    batch and loss type, so computed once by the caller)."""
    pi = cached_problem(batch, spec, problems).keep_probabilities()
    return oracle_probabilities(norms, batch.cost, float((pi * batch.cost).sum()))


def draw_design(
    design: str, batch: Batch, generator: torch.Generator, problems: dict | None = None, pi: torch.Tensor | None = None
) -> Draw:
    """One draw of ``design`` (``parse_design``). ``problems``: ``batch``'s ``PruneProblem`` cache
    (``cached_problem``), to share across draws; ``pi``: ``oracle``'s keep probabilities."""
    spec = parse_design(design)
    problems = {} if problems is None else problems
    every = torch.ones_like(batch.rewards, dtype=torch.bool)
    generated, prompt_weights = every, None
    if spec.base in ("grpo", "packing"):
        keep, weights = every, every.double()
    elif spec.base == "oracle":
        keep = systematic_sample(pi, generator)
        weights = horvitz_thompson_weights(pi, keep)
    elif spec.base in PROMPT_DESIGNS:
        generated, prompt_weights = prompt_acceptance(batch, spec.rate, generator)
        keep, weights = generated, prompt_weights
        if spec.base == "prompt+exact_lengths":
            prompt_weights = None  # D_b = T_b: the trainer's row weights, with the batch's own count
        if spec.base == "dppo+prompt":
            keep, weights = torch.zeros_like(generated), torch.zeros_like(prompt_weights)
            if bool(generated.any()):
                problem = cached_problem(batch, spec, problems, rows=generated)
                keep[generated], sub_weights = registered_draw("systematic", problem, generator)
                weights[generated] = prompt_weights[generated] * sub_weights
    else:
        keep, weights = registered_draw(spec.base, cached_problem(batch, spec, problems), generator)
    tokens = padded_tokens(batch) if spec.base == "grpo" else packed_tokens(batch, keep, generated)
    return Draw(weights, keep, generated, prompt_weights, tokens)


def prompt_token_normalizer(batch: Batch) -> float:
    """``D_b = G x sum_j`` (the history group's mean completion tokens of candidate ``j``): the candidates' expected
    loss tokens from their history, fixed before the acceptance draw (the trainer's per-epoch
    ``estimator.expected_batch_tokens``, at the scale of one candidate batch)."""
    if batch.history_tokens is None:
        raise ValueError("prompt pruning under dapo needs the batch's history_tokens")
    return batch.group_size * float(batch.history_tokens.double().sum())


def effective_weights(draw: Draw, batch: Batch, loss_type: str) -> torch.Tensor:
    """The estimate's weights in units of ``g_n``: the trainer's row weights, except that ``dapo`` under prompt
    pruning normalizes by the draw-independent ``D_b`` (``prompt_token_normalizer``) instead of ``T_b``: an
    unbiased estimate of ``N_b / D_b``, i.e. of the batch gradient times ``T_b / D_b``."""
    if loss_type != "dapo" or draw.prompt_weights is None:
        return draw.weights
    return draw.weights * (float(batch.completion_tokens.sum()) / max(prompt_token_normalizer(batch), 1.0))


@dataclass
class Quadratics:
    """The quadratic forms of one checkpoint and loss type (g-space), per batch ``b`` of ``N`` rows:
    ``gram[b] = G_bb``, ``cross[b] = (G (1_b - u))_b``, ``base[b] = ||F_b - mu||^2``, ``full[b] = ||F_b||^2``
    (``F_b`` the batch's full gradient, ``mu`` the pool mean) and ``population = ||mu||^2``."""

    gram: torch.Tensor  # (B, N, N)
    cross: torch.Tensor  # (B, N)
    base: torch.Tensor  # (B,)
    full: torch.Tensor  # (B,)
    population: float

    @property
    def norms(self) -> torch.Tensor:
        """(B, N): ``||g_n||``."""
        return torch.diagonal(self.gram, dim1=1, dim2=2).clamp(min=0).sqrt()


def batch_quadratics(h: torch.Tensor, coefficients: torch.Tensor, rows_per_batch: int) -> Quadratics:
    """From the per-row gradients ``h`` (R x P, batches of ``rows_per_batch`` consecutive rows) and ``c`` (R,):
    the same numbers as the full Gram ``diag(c) h h^T diag(c)`` would give, from its diagonal blocks only."""
    h, c = h.double(), coefficients.double()
    num_batches = h.size(0) // rows_per_batch
    hb, cb = h.view(num_batches, rows_per_batch, -1), c.view(num_batches, rows_per_batch)
    full_gradients = torch.einsum("bn,bnp->bp", cb, hb)  # F_b
    mu = full_gradients.mean(0)
    gram = cb[:, :, None] * (hb @ hb.transpose(1, 2)) * cb[:, None, :]
    cross = cb * torch.einsum("bnp,bp->bn", hb, full_gradients - mu)
    base = ((full_gradients - mu) ** 2).sum(1)
    full = (full_gradients**2).sum(1)
    return Quadratics(gram, cross, base, full, float(mu @ mu))


def squared_errors(weights: torch.Tensor, q: Quadratics, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For weight vectors ``weights`` (S x N) on batch ``b``: ``(||est - mu||^2, ||est - F_b||^2)`` per row of
    ``weights``, ``est = sum_n w_n g_n``; with ``d = w - 1``: ``base + 2 d.cross + d^T G_bb d`` and ``d^T G_bb d``."""
    d = weights.double() - 1.0
    noise = ((d @ q.gram[b]) * d).sum(1)
    return q.base[b] + 2.0 * (d @ q.cross[b]) + noise, noise


def design_statistics(draws: list[list[Draw]], weights: list[torch.Tensor], q: Quadratics) -> dict:
    """Per design and loss type: means over batches and draws of the squared errors, kept rows and tokens,
    and the relative bias (seed-mean error to the batch gradient over the batch gradient's norm; batches with
    a zero gradient are left out) with the noise level the seeds alone would give it."""
    err, noise, bias, bias_noise = [], [], [], []
    for b, w in enumerate(weights):
        e, n = squared_errors(w, q, b)
        err.append(e)
        noise.append(n)
        if float(q.full[b]) > 0:
            d = w.mean(0) - 1.0
            bias.append(math.sqrt(max(float(d @ q.gram[b] @ d), 0.0) / float(q.full[b])))
            bias_noise.append(math.sqrt(max(float(n.mean()), 0.0) / w.size(0) / float(q.full[b])))
    kept = [float(d.passed.double().mean()) for row in draws for d in row]
    mse = float(torch.cat(err).mean())
    return {
        "kept_fraction": statistics.mean(kept),
        "compute": statistics.mean(d.tokens for row in draws for d in row),
        "mse": mse,
        "mse_to_batch": float(torch.cat(noise).mean()),
        "relative_error": math.sqrt(max(mse, 0.0) / q.population) if q.population > 0 else math.nan,
        "bias": statistics.mean(bias) if bias else 0.0,
        "bias_noise": statistics.mean(bias_noise) if bias_noise else 0.0,
    }


def group_imbalance(weights: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per row of ``weights`` (S x N): ``sum_g |sum_{n in g} w_n A_n - sum_{n in g} A_n| / sum_n |A_n|``;
    exactly 0 for ``w = 1`` and on a batch whose advantages are all 0."""
    a = batch.advantages.double()
    total = float(a.abs().sum())
    if total == 0:
        return torch.zeros(weights.size(0), dtype=torch.float64)
    weighted = (weights.double() * a).view(weights.size(0), -1, batch.group_size).sum(2)
    return (weighted - a.view(-1, batch.group_size).sum(1)).abs().sum(1) / total


def balance_statistics(draws: list[list[Draw]], weights: list[torch.Tensor], batches: list[Batch]) -> dict:
    """``kept_rows_sd``, ``kept_tokens_rel_sd`` (standard deviations over the seeds, population form, so 0 for a
    fixed draw) and ``group_imbalance`` (mean over the seeds), each a mean over batches."""
    rows_sd, tokens_sd, imbalance = [], [], []
    for row, w, batch in zip(draws, weights, batches):
        passed = torch.stack([d.passed for d in row]).double()
        rows_sd.append(float(passed.sum(1).std(correction=0)))
        tokens = passed @ batch.cost
        mean = float(tokens.mean())
        tokens_sd.append(float(tokens.std(correction=0)) / mean if mean > 0 else 0.0)
        imbalance.append(float(group_imbalance(w, batch).mean()))
    return {
        "kept_rows_sd": statistics.mean(rows_sd),
        "kept_tokens_rel_sd": statistics.mean(tokens_sd),
        "group_imbalance": statistics.mean(imbalance),
    }


def batch_draws(design: str, batch: Batch, problems: dict, seeds: int, seed_key, norms: torch.Tensor) -> list[Draw]:
    """``seeds`` draws of ``design`` on one batch, seeded by ``seed_key`` and the seed, sharing ``problems``."""
    spec = parse_design(design)
    pi = oracle_keep_probabilities(spec, batch, norms, problems) if spec.base == "oracle" else None
    name = "/".join(map(str, seed_key))
    gens = (torch.Generator().manual_seed(named_seed(0, name, s)) for s in range(seeds))
    return [draw_design(design, batch, g, problems, pi) for g in gens]


def evaluate_designs(batches: list[Batch], quadratics: dict, designs, seeds: int, label="") -> list[dict]:
    """One row per (loss type, design): its statistics over the pool, then its ratios to ``grpo`` and
    ``oracle@0.5``. Draws use a generator seeded by (design, batch, seed) (oracle: and loss type); the other
    designs' draws are shared by the loss types. One ``PruneProblem`` per (batch, variant) serves every draw."""
    problems = [{} for _ in batches]
    cache, rows = {}, []
    for loss_type, q in quadratics.items():
        for design in designs:
            spec = parse_design(design)
            key = (design, loss_type) if spec.base == "oracle" else design
            if key not in cache:
                cache[key] = [batch_draws(design, batch, problems[b], seeds, (*key, b), q.norms[b])
                              for b, batch in enumerate(batches)]
            weights = [torch.stack([effective_weights(d, batch, loss_type) for d in row])
                       for row, batch in zip(cache[key], batches)]
            stats = design_statistics(cache[key], weights, q)
            rows.append({"checkpoint": label, "loss_type": loss_type, "design": design, "keep_rate": spec.rate,
                         **stats, **balance_statistics(cache[key], weights, batches)})
    return add_ratios(rows)


def add_ratios(rows: list[dict]) -> list[dict]:
    """``compute_ratio``, ``mse_ratio``, ``efficiency`` (to ``grpo``) and ``efficiency_to_oracle`` of each row,
    within its (checkpoint, loss type)."""
    by = {(r["checkpoint"], r["loss_type"], r["design"]): r for r in rows}
    for r in rows:
        grpo = by[r["checkpoint"], r["loss_type"], "grpo"]
        r["compute_ratio"] = r["compute"] / grpo["compute"]
        r["mse_ratio"] = r["mse"] / grpo["mse"] if grpo["mse"] > 0 else math.nan
        cost = r["mse"] * r["compute"]
        r["efficiency"] = grpo["mse"] * grpo["compute"] / cost if cost > 0 else math.inf
    for r in rows:
        oracle = by.get((r["checkpoint"], r["loss_type"], "oracle@0.5"))
        r["efficiency_to_oracle"] = r["efficiency"] / oracle["efficiency"] if oracle else None
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per (loss type, design): the mean over checkpoints of every figure."""
    keys = ("kept_fraction", "compute_ratio", "mse_ratio", "relative_error", "bias", "bias_noise", "efficiency",
            "efficiency_to_oracle", "kept_rows_sd", "kept_tokens_rel_sd", "group_imbalance")
    out = []
    for loss_type in dict.fromkeys(r["loss_type"] for r in rows):
        for design in dict.fromkeys(r["design"] for r in rows):
            group = [r for r in rows if r["loss_type"] == loss_type and r["design"] == design]
            if group:
                means = {k: statistics.mean(r[k] for r in group) if group[0][k] is not None else None for k in keys}
                out.append({"loss_type": loss_type, "design": design, "checkpoints": len(group), **means})
    return out


def print_table(rows: list[dict], title: str) -> None:
    width = max([17] + [len(r["design"]) + 1 for r in rows])
    print(f"\n{title}")
    print(text_table(rows, [
        ("design", -width, "design:"), ("kept", 6, "kept_fraction:.3f"), ("compute\n/GRPO", 9, "compute_ratio:.3f"),
        ("rel.err", 9, "relative_error:.3f"), ("mse\n/GRPO", 8, "mse_ratio:.3f"), ("bias", 8, "bias:.4f"),
        ("noise", 8, "bias_noise:.4f"), ("effic.", 8, "efficiency:.3f"), ("/oracle", 8, "efficiency_to_oracle:.3f"),
        ("rows\nsd", 7, "kept_rows_sd:.3f"), ("tokens\nrel.sd", 8, "kept_tokens_rel_sd:.4f"),
        ("group\nimbal.", 8, "group_imbalance:.4f"),
    ]))


# ---------------------------------------------------------------------------------------- model-dependent
def build_checkpoints(args, heldout: list[int]) -> list[dict]:
    """The snapshots at ``args.checkpoints`` supervised steps (sorted), cached: the first from
    ``warm_start``, each next one by ``supervised_steps`` on the warm start's examples, on top of the previous
    snapshot (a fresh AdamW each time). A cached snapshot is reused only when built by the same chain."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_trl.tasks.countdown import countdown, heldout_accuracy, warm_start, warm_start_starts
    from dppo_trl.tasks.toy import supervised_steps

    size = "" if (args.hidden_size, args.layers) == (128, 2) else f"-h{args.hidden_size}l{args.layers}"
    examples = [(f"{s}=", countdown(s)) for s in warm_start_starts(seed=args.seed)]
    chain, infos, previous = [], [], None
    for steps in sorted(set(args.checkpoints)):
        chain.append(steps)
        directory = Path(args.model_cache) / f"sft-{steps}{size}"
        info_file = directory / "bench_variance_sft.json"
        info = read_json(info_file) if info_file.exists() else None
        if info is None or info.get("chain") != chain or info.get("seed") != args.seed:
            start = time.perf_counter()
            if previous is None:
                info = warm_start(
                    directory,
                    heldout,
                    sft_steps=steps,
                    hidden_size=args.hidden_size,
                    num_layers=args.layers,
                    lr=3e-3,
                    seed=args.seed,
                )
            else:
                model = AutoModelForCausalLM.from_pretrained(previous)
                tokenizer = AutoTokenizer.from_pretrained(previous)
                loss = supervised_steps(model, tokenizer, examples, steps - chain[-2], 32, 3e-3, args.seed + steps)
                model.save_pretrained(directory)
                tokenizer.save_pretrained(directory)
                info = {"loss": loss, "heldout_accuracy": heldout_accuracy(model, tokenizer, heldout)}
            info.update(chain=list(chain), seed=args.seed, seconds=time.perf_counter() - start)
            write_json(info_file, info)
            print(f"sft-{steps}: built in {info['seconds']:.0f} s, loss {info['loss']:.3f}, greedy held-out "
                  f"{info['heldout_accuracy']:.3f}", flush=True)
        infos.append({"steps": steps, "model_dir": str(directory), **info})
        previous = directory
    return infos


@torch.no_grad()
def generate_groups(model, tokenizer, starts: list[int], group_size: int, copies: int, seed: int):
    """``copies`` independent groups per start, sampled at temperature 1 in one call (copy-major: all starts'
    first group, then the second...). Returns per row (prompt ids, completion ids up to and including the
    first eos, stopping at the first pad), its text and its start."""
    from dppo_trl.tasks.countdown import max_completion_tokens

    row_starts = [s for _ in range(copies) for s in starts for _ in range(group_size)]
    prompts = [f"{s}=" for s in row_starts]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=None, top_p=None,
                         max_new_tokens=max_completion_tokens())
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for prompt, start, completion in zip(prompts, row_starts, out[:, enc["input_ids"].size(1) :].tolist()):
        ids = []
        for token in completion:
            if token == tokenizer.pad_token_id:
                break
            ids.append(token)
            if token in eos:
                break
        text = tokenizer.decode(ids, skip_special_tokens=True)
        rows.append((tokenizer.encode(prompt, add_special_tokens=False), ids, text, start))
    return rows


def sample_batch(model, tokenizer, starts: list[int], group_size: int, seed: int) -> tuple[Batch, list]:
    """One generation batch (rewards, advantages, lengths) and its history groups; returns the batch and its
    rows (prompt ids, completion ids)."""
    from dppo_trl.tasks.countdown import countdown, countdown_reward

    rows = generate_groups(model, tokenizer, starts, group_size, 2, seed)
    rewards = torch.tensor(countdown_reward([r[2] for r in rows], answer=[countdown(r[3]) for r in rows]))
    n = len(starts) * group_size
    main, history = rewards[:n].double(), rewards[n:].double()
    history_tokens = torch.tensor([len(r[1]) for r in rows[n:]], dtype=torch.float64)
    batch = Batch(
        rewards=main,
        advantages=group_advantages(main, group_size),
        prompt_tokens=torch.tensor([len(r[0]) for r in rows[:n]]),
        completion_tokens=torch.tensor([len(r[1]) for r in rows[:n]]),
        history=group_advantages(history, group_size).abs().view(-1, group_size).mean(1),
        group_size=group_size,
        history_tokens=history_tokens.view(-1, group_size).mean(1),
    )
    return batch, [(r[0], r[1]) for r in rows[:n]]


def row_gradients(model, rows) -> torch.Tensor:
    """(R x P) float64: per row, the gradient of ``sum_t log p(completion token t | prefix)`` over its
    completion tokens, flattened over the (deduplicated, tied) parameters of a float64 copy of ``model``."""
    model = copy.deepcopy(model).to(torch.float64).eval()
    params = [p for p in model.parameters() if p.requires_grad]
    out = torch.empty(len(rows), sum(p.numel() for p in params), dtype=torch.float64)
    for r, (prompt, completion) in enumerate(rows):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).sum()
        out[r] = torch.cat([g.reshape(-1) for g in torch.autograd.grad(logp, params)])
    return out


def checkpoint_pool(info: dict, prompt_batches: list[list[int]], args) -> tuple[list[Batch], torch.Tensor, dict]:
    """The pool of one checkpoint: its batches, the per-row gradients (R x P) and its description."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(info["model_dir"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(info["model_dir"])
    start = time.perf_counter()
    batches, rows = [], []
    for b, starts in enumerate(prompt_batches):
        seed = named_seed(args.seed, f"generate/{info['steps']}", b)
        batch, batch_rows = sample_batch(model, tokenizer, starts, args.group_size, seed)
        batches.append(batch)
        rows += batch_rows
    generation_s = time.perf_counter() - start
    start = time.perf_counter()
    h = row_gradients(model, rows)
    gradient_s = time.perf_counter() - start
    lengths = torch.cat([b.completion_tokens for b in batches]).tolist()
    zero = torch.cat([zero_spread_rows(b.rewards, b.group_size).view(-1, b.group_size)[:, 0] for b in batches])
    description = {
        "steps": info["steps"],
        "sft_loss": info.get("loss"),
        "heldout_accuracy": info.get("heldout_accuracy"),
        "rows": h.size(0),
        "parameters": h.size(1),
        "zero_variance_share": float(zero.double().mean()),
        "pool_accuracy": float(torch.cat([b.rewards for b in batches]).mean()),
        "completion_tokens": {
            "min": min(lengths),
            "median": statistics.median(lengths),
            "mean": statistics.mean(lengths),
            "max": max(lengths),
        },
        "generation_s": generation_s,
        "gradient_s": gradient_s,
    }
    return batches, h, description


def run_checkpoint(info: dict, prompt_batches: list[list[int]], args) -> tuple[list[dict], dict]:
    """The result rows and description of one checkpoint (prints its tables)."""
    batches, h, description = checkpoint_pool(info, prompt_batches, args)
    c = description["completion_tokens"]
    print(f"\n[sft-{info['steps']}] zero-variance groups {description['zero_variance_share']:.1%}, completion "
          f"tokens {c['min']}..{c['max']} (median {c['median']:g}), sampled accuracy "
          f"{description['pool_accuracy']:.3f}; generation {description['generation_s']:.0f} s, gradients "
          f"{description['gradient_s']:.0f} s ({h.size(0)} rows x {h.size(1)} params)", flush=True)
    start = time.perf_counter()
    n = args.prompts * args.group_size
    quadratics = {lt: batch_quadratics(h, torch.cat([loss_coefficients(lt, b) for b in batches]), n)
                  for lt in args.loss_types}
    del h
    rows = evaluate_designs(batches, quadratics, args.designs, args.prune_seeds, label=info["steps"])
    description["estimator_s"] = time.perf_counter() - start
    for loss_type in args.loss_types:
        print_table([r for r in rows if r["loss_type"] == loss_type],
                    f"sft-{info['steps']}, loss_type={loss_type} ({args.batches} batches x {n} rows, "
                    f"{args.prune_seeds} prune seeds; estimators {description['estimator_s']:.0f} s)")
    return rows, description


REFERENCE_DESIGNS = ("grpo", "oracle@0.5")  # the designs every ratio is taken to


def merge_results(saved: dict, fresh: dict, new_pools: bool = False) -> dict:
    """``saved`` (a previous run's JSON) with the rows of ``fresh``'s designs replaced by ``fresh``'s (new designs
    appended) and the summary recomputed. Same pools (equal ``grpo`` rows: same checkpoints, batches and gradients):
    every ratio is recomputed. Otherwise refused, unless ``new_pools``: then only ``fresh``'s non-reference designs
    replace their rows, keeping the ratios they got in their own run (to its ``grpo`` and ``oracle@0.5``), tagged
    with ``pool`` (the merge's index). ``config["merged"]`` records each merge (its pools' descriptions too)."""
    key = lambda r: (r["checkpoint"], r["loss_type"], r["design"])  # noqa: E731
    saved_rows = {key(r): r for r in saved["results"]}
    same = all(k in saved_rows and math.isclose(saved_rows[k]["mse"], r["mse"], rel_tol=1e-9)
               for r in fresh["results"] if (k := key(r))[2] == "grpo")
    if not same and not new_pools:
        raise SystemExit("--merge: the grpo rows differ from the saved run's: not the same pools (--merge-new-pools)")
    merges = saved["config"].get("merged", [])
    record = {"designs": fresh["config"]["designs"], "elapsed_s": fresh["elapsed_s"], "same_pools": same}
    new = {key(r): r for r in fresh["results"]}
    if not same:
        record["checkpoints"] = fresh["checkpoints"]
        new = {k: {**r, "pool": len(merges)} for k, r in new.items() if k[2] not in REFERENCE_DESIGNS}
    rows = [new.pop(key(r), r) for r in saved["results"]] + list(new.values())
    config = {**saved["config"], "merged": merges + [record]}
    return {**saved, "config": config, "results": add_ratios(rows) if same else rows, "summary": summarize(rows)}


def prompt_batches_of(args) -> list[list[int]]:
    """``args.batches`` batches of ``args.prompts`` starts, drawn without replacement from the training list."""
    from dppo_trl.tasks.countdown import countdown_splits

    train, _ = countdown_splits(train_size=args.train_prompts, seed=0)
    if args.batches * args.prompts > len(train):
        raise SystemExit(f"--batches x --prompts = {args.batches * args.prompts} > {len(train)} training prompts")
    picks = random.Random(args.seed).sample(range(len(train)), args.batches * args.prompts)
    return [[train[i] for i in picks[k * args.prompts : (k + 1) * args.prompts]] for k in range(args.batches)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", type=int, default=[300, 400, 550], help="supervised steps")
    parser.add_argument("--batches", type=int, default=12, help="generation batches per checkpoint")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per generation batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (num_generations)")
    parser.add_argument("--prune-seeds", type=int, default=200, help="draws of every design per batch")
    parser.add_argument("--loss-types", nargs="+", default=list(LOSS_TYPES), choices=LOSS_TYPES)
    parser.add_argument("--designs", nargs="+", type=design_argument, default=None,
                        help=f"default: default_designs(); any of: {design_grammar()}")
    parser.add_argument("--train-prompts", type=int, default=256, help="training list (draws, with repeats)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-cache", default="outputs/bench-variance")
    parser.add_argument("--json", default=result_path("bench_variance"))
    parser.add_argument("--merge", action="store_true",
                        help="replace only the measured designs' rows in the existing --json (same pools), keep the "
                        "others; ratios and summary recomputed")
    parser.add_argument("--merge-new-pools", action="store_true",
                        help="with --merge, accept pools that differ from the saved run's (another machine or model "
                        "cache): the merged rows keep their own run's ratios and are tagged with their pool")
    args = parser.parse_args(argv)
    args.designs = default_designs() if args.designs is None else args.designs
    if "grpo" not in args.designs:
        parser.error("--designs must include grpo: every ratio is to it")
    torch.set_num_threads(1)
    started = time.perf_counter()
    from dppo_trl.tasks.countdown import countdown_splits

    _, heldout = countdown_splits(train_size=args.train_prompts, seed=0)
    infos = build_checkpoints(args, heldout)
    prompt_batches = prompt_batches_of(args)
    rows, descriptions = [], []
    for info in infos:
        checkpoint_rows, description = run_checkpoint(info, prompt_batches, args)
        rows += checkpoint_rows
        descriptions.append(description)
    summary = summarize(rows)
    for loss_type in args.loss_types:
        print_table([r for r in summary if r["loss_type"] == loss_type],
                    f"summary, loss_type={loss_type}: mean over checkpoints {[i['steps'] for i in infos]}")
    elapsed = time.perf_counter() - started
    out = Path(args.json)
    saved = {"config": vars(args), "elapsed_s": elapsed, "checkpoints": descriptions, "results": rows,
             "summary": summary}
    if args.merge:
        saved = merge_results(read_json(out), saved, new_pools=args.merge_new_pools)
    write_json(out, saved)
    print(f"\nwrote {out} ({elapsed:.0f} s in all)")
    return rows


if __name__ == "__main__":
    main()
