"""One recording trainer for every test that looks inside a run: ``Recorder`` is put before a trainer class
(DPPOTrainer, or GRPOTrainer for what it has), and each recorder is opt in. ``RecordingTrainer`` is DPPOTrainer
recording each training generation batch's ``BATCH_KEYS``; ``recording(...)`` builds any other combination.
Also: the gradient the optimizer receives at each step, and the rows and tokens of the log-prob passes."""

import functools

import torch
from transformers import TrainerCallback

from dppo_trl import DPPOTrainer

# What each training generation batch looked like after pruning.
BATCH_KEYS = ("completion_ids", "prompt_mask", "completion_mask", "advantages", "dppo_keep", "dppo_weight",
              "dppo_iteration_weights")


def append(trainer, name, value):
    """Append ``value`` to the list ``trainer.<name>`` (made on first use, in the instance's own ``__dict__``)."""
    trainer.__dict__.setdefault(name, []).append(value)


def wrap(obj, name, around):
    """Replace the method ``obj.name`` on this instance by ``around(original, *args, **kwargs)`` (a component's
    method, whose calls a test records or changes)."""
    original = getattr(obj, name)
    setattr(obj, name, functools.wraps(original)(lambda *args, **kwargs: around(original, *args, **kwargs)))


def _copy(value, dtype):
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().clone()
    return value if dtype is None else value.to(dtype)


class Recorder:
    """Records what a run did, each recorder switched on by a class attribute (all off by default):

    - ``batch_keys``: of each training generation batch, these keys of what ``_generate_and_score_completions``
      returns (after DPPO's pruning), detached copies (cast to ``batch_dtype`` if set), in ``records``;
    - ``record_prompts``: each generation batch's prompts, in ``prompts_seen``;
    - ``record_masks``: each training generation batch's global keep mask (0/1 list) in ``masks`` and the rows
      this process kept in ``local_kept``;
    - ``record_audits``: each gradient audit's two reduced gradients ``(dppo, grpo)``, in ``audits``;
    - ``record_error_scales``: ``(audit ratios so far, scale)`` of each measured-error scale, in ``scales``;
    - ``record_prompt_decisions``: ``(weights, token count, PromptCut)`` of each prompt-pruning decision, in
      ``prompt_decisions``;
    - ``record_keep_draws``: ``(advantages, scores)`` of each keep-mask draw, in ``drawn``."""

    batch_keys = ()
    batch_dtype = None
    record_prompts = False
    record_masks = False
    record_audits = False
    record_error_scales = False
    record_prompt_decisions = False
    record_keep_draws = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.record_keep_draws and hasattr(self, "keep_decision"):  # DPPO's components (GRPO has none)
            wrap(self.keep_decision, "draw", self._record_keep_draw)
        if self.record_prompt_decisions and hasattr(self, "prompt_cutter"):
            wrap(self.prompt_cutter, "take_decision", self._record_prompt_decision)

    def _record_keep_draw(self, draw, output, batch, scores):
        append(self, "drawn", (output["advantages"].clone(), scores.clone()))
        append(self, "rewards", batch.rewards_per_func.clone())
        return draw(output, batch, scores)

    def _generate_and_score_completions(self, inputs):
        if self.record_prompts:
            append(self, "prompts_seen", [x["prompt"] for x in inputs])
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            if self.batch_keys:
                append(self, "records", {k: _copy(out[k], self.batch_dtype) for k in self.batch_keys if k in out})
            if self.record_masks:
                append(self, "masks", self.last_global_keep.int().tolist())
                append(self, "local_kept", int(out["dppo_keep"].sum()))
        return out

    def _record_audit(self, dppo, grpo, seconds, batch):
        if self.record_audits:
            append(self, "audits", (dppo.clone(), grpo.clone()))
        super()._record_audit(dppo, grpo, seconds, batch)

    def _measured_error_scale(self):
        scale = super()._measured_error_scale()
        if self.record_error_scales:
            append(self, "scales", (list(self.audit_ledger.records["ratio"]), scale))
        return scale

    def _record_prompt_decision(self, take_decision, scores, batch):
        weights, count = take_decision(scores, batch)
        append(self, "prompt_decisions", (weights, count, batch.cut))
        return weights, count


RECORDERS = ("batch_keys", "batch_dtype", "record_prompts", "record_masks", "record_audits", "record_error_scales",
             "record_prompt_decisions", "record_keep_draws")


def recording(base=DPPOTrainer, *mixins, **recorders):
    """A trainer class: ``mixins``, then ``Recorder`` with ``recorders`` (its class attributes) set, then ``base``."""
    unknown = set(recorders) - set(RECORDERS)
    if unknown:
        raise TypeError(f"unknown recorders {sorted(unknown)}: the recorders are {RECORDERS}")
    names = "".join(m.__name__ for m in mixins)
    return type(f"Recording{names}{base.__name__}", (*mixins, Recorder, base), dict(recorders))


class RecordingTrainer(Recorder, DPPOTrainer):
    """DPPOTrainer keeping what each training generation batch looked like after pruning (``records``)."""

    batch_keys = BATCH_KEYS


class OptimizerGradients(TrainerCallback):
    """At each optimizer step (after any reduction across processes), ``(name, gradient or None, numel)`` of every
    trainable parameter of ``model`` (set it once the trainer is built), in ``steps``."""

    def __init__(self, model=None):
        self.model, self.steps = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        named = [(n, p.grad.detach().clone() if p.grad is not None else None, p.numel())
                 for n, p in self.model.named_parameters() if p.requires_grad]
        self.steps.append(named)

    def flat(self, missing_as_zeros=True) -> list:
        """Each step's gradient as one float64 vector (parameters in order); a parameter without a gradient as
        zeros, or left out (``missing_as_zeros=False``)."""
        return [
            torch.cat([(torch.zeros(n) if g is None else g.flatten()) for _, g, n in step
                       if g is not None or missing_as_zeros]).double()
            for step in self.steps
        ]


def count_logprob_rows(trainer):
    """Sequences and real (non-pad) tokens through the model in the log-prob passes (old, ref, loss), counted as
    training runs: TRL's padded calls carry `labels`; packed calls carry `shift_labels`, a sequence starting
    wherever `position_ids` do not go on from the token before (at 0, or with prefix sharing where a completion's
    branch goes back to the end of its shared prompt), rows ending in pad-token fillers. A shared prompt's tokens
    count once."""
    counter = {"rows": 0, "tokens": 0, "no_grad_rows": 0}  # no_grad_rows: those of the passes without autograd
    pad = trainer.processing_class.pad_token_id

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if "labels" in kwargs:
            rows = ids.size(0)
        elif "shift_labels" in kwargs:
            positions = kwargs["position_ids"]
            starts = torch.ones_like(positions, dtype=torch.bool)
            starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
            rows = int((starts & (ids != pad)).sum())
        else:
            return
        counter["rows"] += rows
        counter["no_grad_rows"] += 0 if torch.is_grad_enabled() else rows
        counter["tokens"] += int((ids != pad).sum())

    for model in (trainer.model, trainer.ref_model):
        if model is not None:
            model.register_forward_pre_hook(hook, with_kwargs=True)
    return counter
