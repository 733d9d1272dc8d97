"""Claims the docs state as fact, each checked here where no other test does: every `benchmarks/*.py` command the
docs give parses with its script's own parser; multimodal batches are refused on DPPO's whole training path
(`docs/estimator.md`, section 7); under `multi_objective_aggregation="normalize_then_sum"` a group whose weighted
rewards are equal still has an advantage and is scored from it (`docs/estimator.md`, section 2); under prompt
pruning the entropy bonus divides by the planned token count `D` (`docs/prompt_pruning.md`)."""

import argparse
import functools
import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from support.recording import recording
from support.training import build, train
from trl import GRPOTrainer

from dppo_trl import DPPOTrainer

REPO = Path(__file__).parent.parent
BENCHMARKS = REPO / "benchmarks"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


# ----------------------------------------------------------------------- the benchmark commands of the docs
def code_texts(text: str) -> list[str]:
    """The lines of the fenced code blocks and the inline code spans (which may wrap) of a markdown text."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.DOTALL)
    rest = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()]
    return lines + [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", rest)]


def documented_benchmark_commands() -> list[tuple[str, str, list[str]]]:
    """(doc, script, arguments) of every command `python [benchmarks/]SCRIPT.py [ARGS]` or `SCRIPT.py ARGS` in the
    docs' code, SCRIPT a file of benchmarks/ (a bare `SCRIPT.py` names the file, not a command); ARGS end at a
    comment, a pipe or a `;`/`&&`, and a `<placeholder>` stands for one value."""
    found = []
    for doc in DOCS:
        for code in code_texts(doc.read_text()):
            pattern = r"(python3?\s+)?(?:benchmarks/)?\b(\w+)\.py\b([^#|;&]*)"
            for python, script, rest in re.findall(pattern, code):
                args = shlex.split(re.sub(r"<[^>]*>", "VALUE", rest))
                if not (BENCHMARKS / f"{script}.py").is_file() or not (python or args):
                    continue
                if args and not args[0].startswith("-"):  # prose after a file name, not a command
                    continue
                if (doc.name, script, args) not in found:
                    found.append((doc.name, script, args))
    return found


COMMANDS = documented_benchmark_commands()


class _Parsed(Exception):
    """Raised in place of running a script once its parser has read the arguments."""


@functools.cache
def load_script(script: str):
    """benchmarks/SCRIPT.py as a module (not run: its ``__name__`` is not ``__main__``)."""
    name = f"documented_{script}"
    sys.path.insert(0, str(BENCHMARKS))  # the scripts import each other as top-level modules
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_the_docs_give_benchmark_commands_with_arguments():
    assert any(script == "bench_reasoning" and "--methods" in args for _, script, args in COMMANDS)
    assert len({script for _, script, _ in COMMANDS}) >= 5


def parse_with_the_scripts_parser(script: str, args: list[str], monkeypatch) -> argparse.Namespace:
    """``script.main(args)`` stopped as soon as its argparse has read ``args``: the namespace it read, or the
    SystemExit of argparse's error (an unknown flag, a value of the wrong type or outside its choices)."""
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, argv=None, namespace=None):
        raise _Parsed(original(self, argv, namespace))

    module = load_script(script)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    try:
        module.main(args)
    except _Parsed as parsed:
        return parsed.args[0]
    raise AssertionError(f"{script}.main returned without parsing its arguments")


@pytest.mark.parametrize("doc,script,args", COMMANDS, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_every_benchmark_command_in_the_docs_parses(doc, script, args, monkeypatch):
    """The script's own argparse reads the doc's arguments (every flag known, every value of its type and among
    its choices); the script stops there, before it does anything."""
    try:
        parse_with_the_scripts_parser(script, args, monkeypatch)
    except SystemExit as error:
        pytest.fail(f"{doc}: `{script}.py {' '.join(args)}` does not parse (exit {error.code}): see its --help")


def test_the_command_check_catches_a_method_the_script_does_not_know(monkeypatch):
    """What `--methods grpo dppo stratified balanced` was once `stratified` became the default."""
    assert parse_with_the_scripts_parser("bench_reasoning", ["--methods", "grpo", "dppo"], monkeypatch).methods
    with pytest.raises(SystemExit) as error:
        parse_with_the_scripts_parser("bench_reasoning", ["--methods", "grpo", "stratified"], monkeypatch)
    assert error.value.code == 2


# ------------------------------------------------------------------------------ multimodal batches are refused
MULTIMODAL_PATHS = {
    "packing only": dict(completion_keep_rate=1.0, packing=True),
    "completion pruning": dict(completion_keep_rate=0.5, packing=False),
    "zero_variance": dict(prune_sampling="zero_variance", packing=False),
    "prompt pruning": dict(completion_keep_rate=1.0, prompt_keep_rate=0.5, packing=False),
}


def multimodal_output(self, inputs):
    """What GRPOTrainer returns for a batch with images: its usual keys plus ``num_images`` (and pixels)."""
    return {"advantages": torch.zeros(8), "num_images": [1] * 8, "pixel_values": torch.zeros(8, 3)}


@pytest.mark.parametrize("overrides", MULTIMODAL_PATHS.values(), ids=MULTIMODAL_PATHS.keys())
def test_multimodal_batches_are_refused_on_the_whole_dppo_training_path(tmp_path, tiny_model_dir, train_dataset,
                                                                        monkeypatch, overrides):
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, **overrides)
    assert trainer.args.dppo_training_path
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", multimodal_output)
    trainer.model.train()
    with pytest.raises(NotImplementedError, match="multimodal"):  # prompt pruning refuses before generating
        trainer._generate_and_score_completions([{"prompt": "1+1=", "image": None}] * 8)


def test_multimodal_batches_pass_where_the_trainer_is_grpos_own(tmp_path, tiny_model_dir, train_dataset, monkeypatch):
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, completion_keep_rate=1.0, packing=False)
    assert not trainer.args.dppo_training_path
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", multimodal_output)
    trainer.model.train()
    assert "num_images" in trainer._generate_and_score_completions([])


# ------------------------------------------------------------------- normalize_then_sum: equal-reward groups
def _varying(completion: str) -> float:
    return float((sum(map(ord, completion)) * 7919) % 5)


def first_prompt_constant(prompts, completions, **kwargs):
    """0-4 from the completion's text, but 1 on every row of the batch's first prompt (a constant group)."""
    return [1.0 if p == prompts[0] else _varying(c) for p, c in zip(prompts, completions)]


def complement(prompts, completions, **kwargs):
    """(4 - first_prompt_constant) / 2: with weights 1 and 2 the weighted total is 4 on every row."""
    return [(4.0 - r) / 2 for r in first_prompt_constant(prompts, completions)]


ScoreRecorder = recording(record_keep_draws=True)


GROUP = 4


def scores_of_equal_total_groups(tmp_path, model_dir, dataset, aggregation):
    """(advantages, scores, which groups' rewards vary) of one generation batch of six groups, every row's weighted
    reward total 4: the batch's first prompt, whose two rewards are constant, and five whose rewards vary (each
    with probability 1 - 5 / 5^4)."""
    trainer = train(ScoreRecorder, tmp_path, model_dir, dataset, reward=[first_prompt_constant, complement],
                    max_steps=1, completion_keep_rate=0.5, reward_weights=[1.0, 2.0],
                    per_device_train_batch_size=6 * GROUP, num_generations=GROUP,
                    multi_objective_aggregation=aggregation)
    (advantages, scores), *_ = trainer.drawn
    rewards = trainer.rewards[0]
    assert torch.equal(rewards @ torch.tensor([1.0, 2.0]), torch.full((6 * GROUP,), 4.0))  # equal totals everywhere
    varies = torch.tensor([g[:, 0].unique().numel() > 1 for g in rewards.view(-1, GROUP, 2)])
    assert not varies[0] and varies.sum() >= 3
    return advantages.view(-1, GROUP), scores.view(-1, GROUP), varies


def test_equal_total_rewards_under_sum_then_normalize_score_zero(tmp_path, tiny_model_dir, train_dataset):
    _, scores, _ = scores_of_equal_total_groups(tmp_path, tiny_model_dir, train_dataset, "sum_then_normalize")
    assert torch.equal(scores, torch.zeros_like(scores))


def test_equal_total_rewards_under_normalize_then_sum_are_scored_from_their_advantages(tmp_path, tiny_model_dir,
                                                                                       train_dataset):
    """Each reward function is normalized within its group before the weighted sum: a group whose rewards vary
    has an advantage though its total reward is equal on every row, and DPPO scores it from that advantage
    (zeroing it, as under sum_then_normalize, would drop a group with signal). A group whose every reward is
    constant has A = 0 in exact arithmetic (the batch mean of group-normalized rewards is 0); TRL's float32 leaves
    a residue, which DPPO scores 0 (the test below)."""
    advantages, scores, varies = scores_of_equal_total_groups(tmp_path, tiny_model_dir, train_dataset,
                                                              "normalize_then_sum")
    assert advantages[varies].abs().amax(1).min() > 0.1
    assert torch.equal(scores[varies], advantages[varies])
    assert 0 < advantages[0].abs().max() < 1e-6  # the constant group: a float32 residue of an exact 0


def test_a_group_with_every_reward_constant_scores_zero_under_normalize_then_sum(tmp_path, tiny_model_dir,
                                                                                  train_dataset):
    _, scores, _ = scores_of_equal_total_groups(tmp_path, tiny_model_dir, train_dataset, "normalize_then_sum")
    assert torch.equal(scores[0], torch.zeros(GROUP))


# ------------------------------------------------------------------ the entropy bonus under prompt pruning
class EntropyBonusRecorder(recording(batch_keys=("completion_mask",), record_prompt_decisions=True)):
    """Records, per generation batch, its completion mask and the token count that prompt pruning planned for it,
    and, per micro-batch, the entropy bonus DPPO subtracted (the loss without it minus the loss with it) and the
    Horvitz-Thompson sum of the kept tokens' entropies that it is ``coef x`` that sum over its token count."""

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        coef, self.entropy_coef = self.entropy_coef, 0.0
        try:
            without = super()._compute_loss(model, inputs)
        finally:
            self.entropy_coef = coef
        with torch.no_grad():
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
            mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
            _, entropies, _ = self._get_per_token_logps_and_entropies(
                model, ids, mask, inputs["completion_ids"].size(1), compute_entropy=True
            )
        weighted = (entropies * inputs["completion_mask"] * inputs["dppo_weight"].unsqueeze(1)).sum()
        self.__dict__.setdefault("bonuses", []).append((float((without - loss).detach()), float(weighted)))
        return loss


def test_the_entropy_bonus_divides_by_the_planned_token_count_under_prompt_pruning(tmp_path, tiny_model_dir,
                                                                                   train_dataset):
    """`docs/prompt_pruning.md`: the same D as the policy term. One micro-batch per generation batch (spg = GA = 1,
    one process), so the bonus is coef x (weighted entropy sum) / D, D the count fixed before the acceptance draw
    (from the probe), which differs from the accepted batch's own."""
    coef = 0.1
    trainer = train(EntropyBonusRecorder, tmp_path, tiny_model_dir, train_dataset.select(range(4)), max_steps=6,
                    prompt_keep_rate=0.5, completion_keep_rate=1.0, loss_type="dapo", entropy_coef=coef,
                    learning_rate=0.0)
    planned_counts = [count for _, count, _ in trainer.prompt_decisions]
    own_tokens = [float(r["completion_mask"].sum()) for r in trainer.records]
    assert len(trainer.bonuses) == len(planned_counts) == len(own_tokens) == 6
    for (bonus, weighted), planned, own in zip(trainer.bonuses, planned_counts, own_tokens):
        assert bonus == pytest.approx(coef * weighted / planned, rel=1e-4, abs=1e-7), (planned, own)
    assert any(planned != own for planned, own in zip(planned_counts, own_tokens))
