"""Training runs under the clock: TRL's GRPOTrainer or DPPOTrainer subclassed to time TRL's phases and record each
generation batch, a callback for the per-step wall clock and the held-out evaluations (outside the clock), one run
of a method, and the runs of several methods over seeds."""

from __future__ import annotations

import functools
import hashlib
import tempfile
import time

import torch

PHASES = ("generation", "scoring", "loss", "other")
# How a run's times were taken (each run's "timing"): in turns with the other methods of its seed (one optimizer step
# each, in processes of their own: harness.interleave), or one after the other in one process (older records, and
# the learning runs, whose steps to a target do not depend on the machine).
TIMING_IN_TURNS = "in turns"
TIMING_ONE_AFTER_THE_OTHER = "one after the other"
AUDIT_TIMES = ("train_time_ratio", "step_time_ratio", "generation_share")
PHASE_LABELS = {
    "generation": "generation",
    "scoring": "rewards + log-prob passes",
    "loss": "loss forward + backward",
    "other": "optimizer, logging, other",
}


def timed(trainer_cls):
    """A subclass of ``trainer_cls`` that clocks TRL's phases: ``_generate`` (rollouts), the rest of
    ``_generate_and_score_completions`` (rewards, advantages, log-prob passes, DPPO's pruning; of which the
    log-prob passes, ``bench_logps``, apart), and the rest of ``training_step`` (loss forward + backward). It also
    records each generation batch's reward and tokens."""

    class Timed(trainer_cls):
        def _bench_reset(self):
            self.bench_phase = dict.fromkeys(PHASES[:-1], 0.0)
            self.bench_logps = 0.0  # the log-prob passes of scoring (part of its phase), timed apart
            self._bench_in_scoring = False
            self.bench_generations = []
            self._bench_prompt_weights = None

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.bench_phase["generation"] += time.perf_counter() - start

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            cutter = getattr(self, "prompt_cutter", None)  # DPPO's prompt cut: each decision's weights recorded
            if cutter is not None:
                take_decision = cutter.take_decision

                def recorded(scores, batch):
                    weights, normalizer = take_decision(scores, batch)
                    self._bench_prompt_weights = weights.detach().double().cpu()
                    return weights, normalizer

                cutter.take_decision = recorded

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if not getattr(self, "_bench_in_scoring", False):  # the loss pass: its own phase
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            start = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            finally:
                self.bench_logps += time.perf_counter() - start

        def _generate_and_score_completions(self, inputs):
            start, generation_before = time.perf_counter(), self.bench_phase["generation"]
            self._bench_in_scoring = True
            try:
                output = super()._generate_and_score_completions(inputs)
            finally:
                self._bench_in_scoring = False
            total = time.perf_counter() - start
            self.bench_phase["scoring"] += total - (self.bench_phase["generation"] - generation_before)
            self.bench_phase["loss"] -= total  # training_step's clock below contains this call
            self._bench_record_generation(output, self._bench_generated_rows(output, inputs))
            return output

        def _bench_generated_rows(self, output, inputs):
            """The rows that were generated: under prompt pruning's cut, the accepted groups of ``inputs``."""
            cut = getattr(output.get("dppo_generation_batch"), "cut", None)
            if cut is None:
                return inputs
            group = self.num_generations
            accepted = cut.local(self.accelerator.process_index).tolist()
            return [row for j, taken in enumerate(accepted) if taken for row in inputs[j * group : (j + 1) * group]]

        def training_step(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super().training_step(*args, **kwargs)
            finally:
                self.bench_phase["loss"] += time.perf_counter() - start

        def _bench_record_generation(self, output, inputs):
            rewards = self._bench_rewards.float().cpu()
            completion_tokens = output["completion_mask"].sum(1).float().cpu()
            width = output["completion_mask"].size(1)
            sequence_tokens = completion_tokens + output["prompt_mask"].sum(1).float().cpu()
            keep = output.get("dppo_keep")
            keep = torch.ones_like(rewards, dtype=torch.bool) if keep is None else keep.cpu()
            weights = self._bench_prompt_weights
            self._bench_prompt_weights = None
            spread = rewards.view(-1, self.num_generations)
            zero_variance = float((spread.amax(1) == spread.amin(1)).float().mean())
            # With prompt pruning the generated prompts are a weighted sample: the Hajek estimate (weights
            # q_bar / q) is the reward of the policy on the whole training set, comparable with GRPO's.
            population = float((weights * rewards).sum() / weights.sum()) if weights is not None else None
            self.bench_generations.append(
                {
                    "step": self.state.global_step,
                    "reward": float(rewards.mean()),
                    "population_reward": population if population is not None else float(rewards.mean()),
                    "zero_variance_groups": zero_variance,
                    "completions": int(rewards.numel()),
                    "padded_tokens": float(rewards.numel() * (output["prompt_mask"].size(1) + width)),
                    "kept_completions": int(keep.sum()),
                    "completion_tokens": float(completion_tokens.sum()),
                    "trained_sequence_tokens": float(sequence_tokens[keep].sum()),
                    "sequence_tokens": float(sequence_tokens.sum()),
                    # Per group (this rank's): its prompt (a short hash), mean reward, prompt weight, whether its
                    # rewards were all equal, and its rewards in order (a probe's completions first): which prompts
                    # a sampler takes, what they give at each visit, and what a probe of the first k would show.
                    "groups": [
                        [hashlib.sha1(str(row["prompt"]).encode()).hexdigest()[:8], round(float(reward), 4),
                         None if weight is None else round(float(weight), 4), bool(flat),
                         [round(float(r), 4) for r in group]]
                        for row, reward, weight, flat, group in zip(
                            inputs[:: self.num_generations], spread.mean(1).tolist(),
                            [None] * spread.size(0) if weights is None else weights[:: self.num_generations].tolist(),
                            (spread.amax(1) == spread.amin(1)).tolist(), spread.tolist(),
                        )
                    ],
                }
            )

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            weights = self.reward_weights.to(rewards_per_func.device)
            rank = self.accelerator.process_index
            local = slice(rank * len(prompts), (rank + 1) * len(prompts))  # TRL gathered every rank's rows
            self._bench_rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)[local]
            return rewards_per_func

    Timed.__name__ = f"Timed{trainer_cls.__name__}"
    return Timed


def clock(trainer, evaluate, eval_every, budget, progress=None, turns=None):
    """Per-step wall clock (evaluation excluded), phase split, and held-out evaluation each time ``progress``
    (optimizer steps by default; a function of the trainer, e.g. ``data_progress``) passes a multiple of
    ``eval_every``, at the start, at the step budget and at the end. With ``turns`` (``harness.interleave.Turns``:
    the run takes turns with others) the wall clock is the run's own clock of turns, which stops while the others
    take theirs."""
    progress = progress or (lambda trainer: trainer.state.global_step)
    now = turns.elapsed if turns is not None else time.perf_counter
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.steps, self.evals, self.excluded = [], [], 0.0

        def _evaluate(self, state):
            if evaluate is None:
                return
            start = now()
            model = trainer.accelerator.unwrap_model(trainer.model)
            was_training = model.training
            model.eval()
            result = evaluate(model)  # a float, or a dict with the main figure under "accuracy"
            model.train(was_training)
            self.excluded += now() - start
            result = result if isinstance(result, dict) else {"accuracy": result}
            self.evals.append({"step": state.global_step, "progress": progress(trainer), "wall": self.wall(), **result})

        def wall(self):
            return now() - self.start - self.excluded

        def on_train_begin(self, args, state, control, **kwargs):
            trainer._bench_reset()
            self.start = now()
            self.last_phase, self.last_logps = dict(trainer.bench_phase), trainer.bench_logps
            self.last_wall, self.next_eval = 0.0, eval_every
            self._evaluate(state)

        def on_step_end(self, args, state, control, **kwargs):
            wall = self.wall()
            phase = {k: trainer.bench_phase[k] - self.last_phase[k] for k in trainer.bench_phase}
            phase["other"] = (wall - self.last_wall) - sum(phase.values())
            phase["logps"] = trainer.bench_logps - self.last_logps  # of which the scoring's log-prob passes
            self.steps.append({"step": state.global_step, "wall": wall, "seconds": wall - self.last_wall, **phase})
            self.last_phase, self.last_logps, self.last_wall = dict(trainer.bench_phase), trainer.bench_logps, wall
            if progress(trainer) >= self.next_eval or state.global_step == budget:
                self._evaluate(state)
                while self.next_eval <= progress(trainer):
                    self.next_eval += eval_every

        def on_train_end(self, args, state, control, **kwargs):
            if not self.evals or self.evals[-1]["step"] != state.global_step:
                self._evaluate(state)

    return Clock()


def data_progress(trainer) -> int:
    """How far through the data a run is, in GRPO's optimizer steps: every method's own (prompt pruning's cut walks
    GRPO's candidates step for step; its retired fill mode walked faster)."""
    return trainer.state.global_step


def generation_progress(trainer) -> int:
    """Generation batches trained so far: optimizer steps over ``num_iterations`` (each generation feeds
    ``num_iterations`` optimizer steps at GA = ``steps_per_generation``)."""
    return trainer.state.global_step // trainer.args.num_iterations


GRPO_TRAINER = "grpo"  # settings {"trainer": "grpo", **fields}: TRL's GRPOTrainer with these GRPOConfig fields


def run_one(name, settings, seed, setup, turns=None):
    """Train one method (``settings``: DPPOConfig fields; None for TRL's GRPO, or ``{"trainer": "grpo", **fields}``
    for TRL's GRPO with these ``GRPOConfig`` fields) from ``setup["model_dir"]`` for ``setup["steps"]`` generation
    batches, ``num_iterations`` optimizer steps each (pruned methods go on for ``setup["extension"]`` more, used
    only to see when they reach GRPO's final reward), or for ``setup["epochs"]`` epochs where given; return its
    per-step, per-generation and evaluation records.

    ``setup`` also holds ``reward_funcs``, ``train_dataset``, ``trainer_args`` (config fields of every method),
    ``eval_every``, and optionally ``evaluate`` (a function of the model and ``tokenizer=``), ``progress`` (what
    ``eval_every`` counts, ``clock``) and ``trainer_kwargs`` (e.g. ``peft_config``).

    DPPO runs without its speed check (``speed_check=False`` unless ``settings`` say otherwise): it would time
    GRPO's training passes once on DPPO's clock. ``turns``: the run takes turns with others (``run_in_turns``),
    one optimizer step at a time, and its clock counts its own steps only."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    from dppo_trl import DPPOConfig, DPPOTrainer
    from dppo_trl.host.summary import DPPOSummaryCallback

    grpo = settings is None or settings.get("trainer") == GRPO_TRAINER
    fields = {k: v for k, v in (settings or {}).items() if k != "trainer"}
    iterations = fields.get("num_iterations", 1)
    budget = setup["steps"] * iterations if setup.get("steps") else None
    if setup.get("epochs"):  # the epoch protocol (bench_reasoning.py): no step budget
        length = dict(num_train_epochs=setup["epochs"])
    else:
        length = dict(max_steps=(setup["steps"] + (0 if grpo else setup["extension"])) * iterations)
    common = dict(
        output_dir=tempfile.mkdtemp(prefix="dppo-bench-"),
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
        logging_steps=10**6,
        seed=seed,
        **length,
        **setup["trainer_args"],
    )
    if grpo:
        trainer_cls, args = timed(GRPOTrainer), GRPOConfig(**{**common, **fields})
    else:
        trainer_cls, args = timed(DPPOTrainer), DPPOConfig(**{**common, "speed_check": False, **fields})
    trainer = trainer_cls(
        setup["model_dir"],
        setup["reward_funcs"],
        args=args,
        train_dataset=setup["train_dataset"],
        **setup.get("trainer_kwargs", {}),
    )
    evaluate = setup.get("evaluate")
    if evaluate is not None:
        evaluate = functools.partial(evaluate, tokenizer=trainer.processing_class)
    timer = clock(trainer, evaluate, setup["eval_every"], budget, setup.get("progress"), turns)
    trainer.add_callback(timer)
    if turns is not None:
        from .interleave import turns_callback

        trainer.add_callback(turns_callback(turns))
    for quiet in (PrinterCallback, ProgressCallback, DPPOSummaryCallback):  # the table is the report
        trainer.remove_callback(quiet)
    torch.manual_seed(seed)
    trainer.train()
    return {
        "method": name,
        "settings": settings,
        "seed": seed,
        "budget": setup.get("steps"),
        "timing": TIMING_IN_TURNS if turns is not None else TIMING_ONE_AFTER_THE_OTHER,
        "steps": timer.steps,
        "generations": trainer.bench_generations,
        "evals": timer.evals,
        # The share of the kept rows' token positions prefix sharing removed, per logged step (DPPO only).
        "prefix_tokens_saved": [h["dppo/prefix_tokens_saved"] for h in trainer.state.log_history
                                if "dppo/prefix_tokens_saved" in h] or None,
        # The audit's measured time ratios (DPPOConfig.audit_every > 0), one per audited batch.
        "audit_times": {k: audit_log[k] for k in AUDIT_TIMES} if (audit_log := getattr(getattr(trainer, "audit_ledger", None), "records", None))
        else None,
    }


def warm_up(setup, settings, count=1, **overrides):
    """``count`` untimed runs of ``settings`` for two steps (``overrides`` replace more of ``setup``), so that
    first-call costs (imports, kernels) land there, not in GRPO's first timed run."""
    for _ in range(count):
        run_one("warmup", settings, 0, {**setup, "epochs": None, "steps": 2, "extension": 0, **overrides})


def run_methods(methods, seeds, setup, runs=None, started=None, label="", note=None, after_run=None,
                in_turns=False, threads=None, warmup=0):
    """Train each of ``methods`` (name -> DPPOConfig settings, None for GRPO) in each of ``seeds``, appending to
    ``runs`` (returned). A (method, seed) already in ``runs`` is not run again; one whose settings match a run of
    that seed reuses that run under its own name. Prints a progress line per run (``label`` first, ``note(run)``
    before the held-out figures); ``after_run(runs)`` after each new run (in turns: after each seed).

    ``in_turns``: a seed's methods take turns (``harness.interleave.run_in_turns``), each in a process of its own
    with ``threads`` torch threads and ``warmup`` untimed warm-up runs of its own settings first, one optimizer step
    at a time, the first turn going to another method in each seed; so a load that changes falls alike on every
    method, and each method's clock counts its own steps only. Otherwise the methods run back to back in this
    process (their times then carry whatever load each met)."""
    runs = [] if runs is None else runs
    started = time.perf_counter() if started is None else started

    def report(run, seed):
        evals = run["evals"]
        held_out = f"held-out {evals[0]['accuracy']:.3f} -> {evals[-1]['accuracy']:.3f}" if evals else ""
        print(f"[{time.perf_counter() - started:7.0f} s] {label}{run['method']} seed {seed}: {len(run['steps'])} "
              f"steps, {run['steps'][-1]['wall']:.1f} s ({run['timing']}), {note(run) if note else ''}{held_out}",
              flush=True)

    for seed in seeds:
        todo, reused = [], []
        for name, settings in methods.items():
            if any(r["method"] == name and r["seed"] == seed for r in runs):
                continue
            cached = [r for r in runs if r["seed"] == seed and r["settings"] == settings]
            if cached:  # the same settings under another name (e.g. keep=0.5 is `dppo`): reuse the run
                runs.append(dict(cached[0], method=name))
            elif any(other == settings for _, other in todo):
                reused.append((name, settings))  # the same settings as a run of this seed still to come
            else:
                todo.append((name, settings))
        if in_turns and todo:
            shift = seed % len(todo)  # each seed gives the first turn to another method
            order = todo[shift:] + todo[:shift]
            from .interleave import run_in_turns

            done = run_in_turns([(turn_job, name, settings, seed, setup, threads, warmup) for name, settings in order],
                                preload=("dppo_trl.trainer",))
            by_name = {run["method"]: run for run in done}
            for name, _ in todo:
                report(by_name[name], seed)
                runs.append(by_name[name])
            if after_run is not None:
                after_run(runs)
        else:
            for name, settings in todo:
                run = run_one(name, settings, seed, setup)
                report(run, seed)
                runs.append(run)
                if after_run is not None:
                    after_run(runs)
        for name, settings in reused:
            runs.append(dict(next(r for r in runs if r["seed"] == seed and r["settings"] == settings), method=name))
    return runs


def turn_job(turns, name, settings, seed, setup, threads=None, warmup=0):
    """One method's run as a job of ``harness.interleave.run_in_turns``, in a process of its own: ``threads``
    torch threads, the vLLM shim where the setup generates with vLLM, ``warmup`` untimed runs of two steps of the
    same settings (first-call costs), all off the clock; then the run, its optimizer steps in turns, and the spans of
    its turns (``turns``: one clock for every process)."""
    if threads:
        torch.set_num_threads(threads)
    if setup["trainer_args"].get("use_vllm"):
        import os
        import socket

        from .setups import vllm_on_cpu

        vllm_on_cpu()  # the CPU shim is applied per process
        with socket.socket() as free:  # a colocated engine's process group: a port of its own beside the others'
            free.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(free.getsockname()[1])
    if warmup:
        warm_up(setup, settings, warmup, evaluate=None)
    run = run_one(name, settings, seed, setup, turns=turns)
    run["turns"] = [list(span) for span in turns.spans]  # (start, end) of each turn on its clock, time.monotonic()
    return run
