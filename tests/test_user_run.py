"""The user's own run: it says what DPPO saved (the speed check, without the audit), it names itself in the model
card and the completions table, it never touches files in ``output_dir`` that it did not write, and swapping only
the trainer class says so."""

import json
import re

import pytest
import torch
from support.models import lora_config
from support.training import StopAt, build, params_of, train
from transformers import TrainerCallback
from trl import GRPOConfig

from dppo_trl import DPPOTrainer
from dppo_trl.core.audit import representative_timing, run_speed_metrics, speed_check_batch
from dppo_trl.output_dir import OUTPUTS_RECORD, check_output_dir, foreign_outputs, record_outputs


class Tracker(TrainerCallback):
    """What a tracker of ``report_to`` receives: every log."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def summary_line(capsys) -> str:
    return [x for x in capsys.readouterr().out.splitlines() if x.startswith("DPPO summary:")][-1]


# ---------------------------------------------------------------- what the run saved


def test_the_summary_and_the_tracker_carry_the_measured_ratio_without_the_audit(tmp_path, tiny_model_dir,
                                                                                 train_dataset, capsys):
    tracker = Tracker()
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=3, callbacks=[tracker])
    assert trainer.args.audit_every == 0 and trainer.audit_ledger.records["audits"] == 0
    timed = [h for h in trainer.state.log_history if "dppo/audit_step_time_ratio" in h]
    assert len(timed) == 1 and timed[0]["step"] == 2  # the second generation batch, once
    final = tracker.logs[-1]
    assert "train_runtime" in final
    step, run = final["dppo/speed_step_time_ratio"], final["dppo/speed_run_seconds"]
    measuring = final["dppo/speed_measuring_seconds"]
    assert step == pytest.approx(timed[0]["dppo/audit_step_time_ratio"], rel=1e-6) and 0 < step
    # the speed check's own passes are not training: taken out of GRPO's projected time, counted in the run's
    assert measuring == pytest.approx(timed[0]["dppo/audit_seconds"], rel=1e-6) and 0 < measuring < run
    assert final["dppo/speed_projected_grpo_seconds"] == pytest.approx((run - measuring) / step)
    assert final["dppo/speed_projected_seconds_saved"] == pytest.approx((run - measuring) / step - run)
    assert 0 < final["dppo/speed_generation_share"] < 1 and final["dppo/speed_train_time_ratio"] > 0
    output = capsys.readouterr().out
    line = [x for x in output.splitlines() if x.startswith("DPPO summary:")][-1]
    assert f"a step takes {step:.2f} of GRPO's time" in line and "projected time saved" in line
    assert f"(the speed check took {measuring:.0f} s of this run, counted against the saving)" in line
    assert "NOT REPRESENTATIVE" not in line
    # the run says what it trains and where it writes, when it starts
    folder = tmp_path / "out"
    assert f"DPPO: training {tiny_model_dir} for 3 steps into output_dir {folder.resolve()}" in output
    # the summary outlives the terminal: beside the model, recorded as the package's own
    saved = json.loads((folder / "dppo_summary.json").read_text())
    assert saved["line"] == line and saved["steps"] == 3 and saved["seconds"] == pytest.approx(run, rel=0.05)
    assert saved["speed"]["step_time_ratio"] == step and saved["speed"]["measuring_seconds"] == measuring
    assert "dppo_summary.json" in json.loads((folder / OUTPUTS_RECORD).read_text())


def test_a_timed_batch_unlike_the_runs_is_flagged(tmp_path, tiny_model_dir, train_dataset, capsys, monkeypatch):
    from dppo_trl.components import audit

    seen = []
    monkeypatch.setattr(audit, "representative_timing", lambda timed, run: seen.append((timed, run)) or False)
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=3)
    (timed, run), = seen
    logged = [h["dppo/kept_token_fraction"] for h in trainer.state.log_history if "dppo/kept_token_fraction" in h]
    assert run == pytest.approx(sum(logged) / len(logged)) and len(timed) == 1 and 0 <= timed[0] <= 1
    assert f"NOT REPRESENTATIVE: the timed batch kept {timed[0]:.0%} of its completion tokens" in summary_line(capsys)


def test_the_speed_check_leaves_training_unchanged(tmp_path, tiny_model_dir, train_dataset):
    runs = {}
    for check in (False, True):
        trainer = train(DPPOTrainer, tmp_path / str(check), tiny_model_dir, train_dataset, max_steps=3,
                        speed_check=check, peft_config=lora_config(lora_dropout=0.05))
        runs[check] = (params_of(trainer), [h.get("loss") for h in trainer.state.log_history if "loss" in h])
    assert runs[True][1] == runs[False][1]
    for name, value in runs[True][0].items():
        assert torch.equal(value, runs[False][0][name]), name


def test_what_the_summary_says_where_the_speed_is_not_measured(tmp_path, tiny_model_dir, train_dataset, capsys):
    train(DPPOTrainer, tmp_path / "p", tiny_model_dir, train_dataset, max_steps=1, prompt_keep_rate=0.5)
    assert "speed not measured: prompt pruning" in summary_line(capsys)
    trainer = train(DPPOTrainer, tmp_path / "g", tiny_model_dir, train_dataset, max_steps=1,
                    completion_keep_rate=1.0, packing=False)
    line = summary_line(capsys)
    assert "speed" not in line and "dppo/speed_step_time_ratio" not in trainer.state.log_history[-1]


def test_the_speed_metrics_and_the_timed_batch():
    assert run_speed_metrics([], [], [], 10.0) == {}
    metrics = run_speed_metrics([0.2, 0.4, 0.3], [0.5, 0.7, 0.6], [0.3, 0.5, 0.4], 60.0)
    assert metrics["dppo/speed_step_time_ratio"] == 0.6 and metrics["dppo/speed_train_time_ratio"] == 0.3
    assert metrics["dppo/speed_projected_grpo_seconds"] == pytest.approx(100.0)
    assert metrics["dppo/speed_projected_seconds_saved"] == pytest.approx(40.0)
    # the run: 502 s, 108 s of them the speed check's, a step at 0.694 of GRPO's: GRPO ~567 s, saved ~66 s
    honest = run_speed_metrics([0.1], [502 / 723], [0.6], 502.0, 108.0)
    assert honest["dppo/speed_projected_grpo_seconds"] == pytest.approx(394 * 723 / 502)
    assert round(honest["dppo/speed_projected_seconds_saved"]) == 65
    assert [speed_check_batch(n) for n in (1, 2, 9)] == [0, 1, 1]


def test_a_timed_batch_stands_for_the_run_within_a_factor_of_two_of_its_kept_tokens():
    assert representative_timing([0.3], 0.5) and representative_timing([0.9], 0.5)
    assert not representative_timing([0.04], 0.47) and not representative_timing([0.9], 0.4)
    assert representative_timing([], 0.5) and representative_timing([0.1], 0.0)  # nothing to compare


def test_a_resumed_runs_summary_counts_the_whole_run(tmp_path, tiny_model_dir, train_dataset, capsys):
    first = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=4, callbacks=[StopAt(2)])
    first.train()
    earlier = json.loads((tmp_path / "out" / "checkpoint-2" / "dppo_state.json").read_text())["run"]["seconds"]
    capsys.readouterr()
    tracker = Tracker()
    second = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=4, callbacks=[tracker])
    second.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    line = summary_line(capsys)
    assert "(the whole run; resumed at step 2)" in line
    seconds = float(re.search(r"4 steps, (\d+) s", line).group(1))
    assert tracker.logs[-1]["dppo/speed_run_seconds"] >= earlier and seconds >= round(earlier) - 1
    # the speed check ran before the checkpoint: its timing comes back with it, and is not run again
    assert second.audit_ledger.records["speed_check_at"] is not None
    assert not [h for h in second.state.log_history if h.get("step", 0) > 2 and "dppo/audit_step_time_ratio" in h]
    assert "dppo/speed_step_time_ratio" in tracker.logs[-1]


# ---------------------------------------------------------------- it names itself


def test_the_model_card_names_dppo_its_paper_this_package_and_its_settings(tmp_path, tiny_model_dir, train_dataset):
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, completion_keep_rate=0.4)
    trainer.create_model_card(model_name="my-model")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "This model was trained with DPPO, a method introduced in [Dynamic Pruning Policy Optimization]" in card
    assert "https://huggingface.co/papers/2603.04135" in card and "arXiv 2603.04135" in card
    assert "Trained with dppo-trl" in card and "| `completion_keep_rate` | `0.4` |" in card
    assert "| `prune_sampling` | `'stratified'` |" in card and "| `loss_type` | `'dapo'` |" in card
    assert "trained with GRPO" not in card and "dppo" in card.split("---")[1]  # the tag, in the card's metadata
    assert "shao2024deepseekmath" in card  # GRPO's objective, cited beside DPPO


def test_the_saved_model_s_card_names_dppo_too(tmp_path, tiny_model_dir, train_dataset):
    """TRL's script saves the model into output_dir at the end; with LoRA, PEFT writes a template card there."""
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, peft_config=lora_config())
    trainer.save_model(str(tmp_path / "out"))
    card = (tmp_path / "out" / "README.md").read_text()
    assert "This model was trained with DPPO" in card and "| `completion_keep_rate` | `0.5` |" in card
    assert "More Information Needed" not in card  # not PEFT's template
    # a model loaded from a folder: TRL's template names no base model; the card names the folder
    assert "None" not in card.split("## Quick start")[0] and f"the local model `{tiny_model_dir}`" in card
    assert f'model="{tmp_path / "out"}"' in card and 'model="None"' not in card


@pytest.mark.parametrize("dataset, named", [
    ("trl-lib/DeepMath-103K", "on the [trl-lib/DeepMath-103K](https://huggingface.co/datasets/trl-lib/DeepMath-103K)"),
    ("the reasoning-gym task `chain_sum`", "on the reasoning-gym task `chain_sum`."),
])
def test_the_card_names_the_training_set_where_known(tmp_path, tiny_model_dir, train_dataset, dataset, named):
    """A Hub dataset by TRL's link; a reasoning-gym task or a local dataset in words (``dppo-trl`` sets it)."""
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset)
    trainer.create_model_card(model_name="my-model")
    assert " on the " not in (tmp_path / "out" / "README.md").read_text().split("\n## Quick start")[0]  # unknown
    trainer.model_card_dataset = dataset
    trainer.create_model_card(model_name="my-model")
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"the local model `{tiny_model_dir}` {named}" in card and "datasets/the" not in card


def test_training_set_name_from_the_command_line(tmp_path):
    from types import SimpleNamespace

    from dppo_trl.cli.runtime import training_set_name

    def named(task=None, name=None):
        return training_set_name(SimpleNamespace(reasoning_gym_task=task, dataset_name=name))

    assert named(task="chain_sum") == "the reasoning-gym task `chain_sum`"
    assert named(name=str(tmp_path)) == f"the local dataset `{tmp_path}`"
    assert named(name="trl-lib/DeepMath-103K") == "trl-lib/DeepMath-103K" and named() is None


def test_the_card_of_a_trained_model_carries_the_runs_summary(tmp_path, tiny_model_dir, train_dataset):
    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=3)
    trainer.save_model(str(tmp_path / "out"))
    card = (tmp_path / "out" / "README.md").read_text()
    summary = json.loads((tmp_path / "out" / "dppo_summary.json").read_text())
    assert "### This run" in card and f"`{summary['line']}`" in card and "| steps | 3 |" in card
    assert f"| reward, first -> last log | {summary['reward_first_log']:.3f} -> " in card
    assert f"{summary['speed']['projected_seconds_saved']:.0f} s of GRPO's" in card


def test_a_users_own_summary_file_is_refused(tmp_path):
    (tmp_path / "dppo_summary.json").write_text("{}")
    assert foreign_outputs(tmp_path) == ["dppo_summary.json"]


def test_the_completions_table_carries_each_rows_keep_decision_and_weight(tmp_path, tiny_model_dir, train_dataset):
    import pandas as pd

    trainer = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=1, log_completions=True)
    table = pd.read_parquet(tmp_path / "out" / "completions" / "completions_00001.parquet")
    keep, weight = table["dppo_keep"].tolist(), table["dppo_weight"].tolist()
    batch = trainer.last_global_keep
    assert keep == batch.tolist() and len(keep) == len(table["advantage"])
    assert all((w > 0) == k for k, w in zip(keep, weight)) and all(w >= 1 for w in weight if w > 0)
    logged = trainer.state.log_history[0]["dppo/kept_fraction"]
    assert sum(keep) / len(keep) == pytest.approx(logged)


def test_swapping_only_the_trainer_class_warns(tmp_path, tiny_model_dir, train_dataset):
    from transformers.testing_utils import CaptureLogger

    from dppo_trl import config

    config.logger.warning_once.cache_clear()
    with CaptureLogger(config.logger) as captured:
        build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, config_cls=GRPOConfig)
    assert "DPPOTrainer got a GRPOConfig" in captured.out and "completion_keep_rate=0.5" in captured.out


# ---------------------------------------------------------------- a user's files


def users_folder(folder):
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("my notes\n")
    (folder / "tokenizer.json").write_text('{"mine": true}')
    (folder / "checkpoint-100").mkdir()
    (folder / "checkpoint-100" / "model.safetensors").write_bytes(b"\x00weights")
    (folder / "data.csv").write_text("a,b\n")  # nothing a save writes: not at risk


def snapshot(folder):
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None) for p in sorted(folder.rglob("*"))}


def test_a_folder_holding_a_users_files_is_refused_and_left_byte_identical(tmp_path, tiny_model_dir, train_dataset):
    folder = tmp_path / "out"
    users_folder(folder)
    before = snapshot(folder)
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, save_strategy="steps", save_steps=1,
                    save_total_limit=1)
    with pytest.raises(ValueError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "README.md, checkpoint-100/, tokenizer.json" in message and "data.csv" not in message
    assert "\n" not in message and "output_dir" in message
    assert snapshot(folder) == before


def test_a_run_may_write_over_what_dppo_wrote_and_resume_from_its_checkpoints(tmp_path, tiny_model_dir, train_dataset):
    settings = dict(save_strategy="steps", save_steps=1, save_total_limit=1, max_steps=2)
    train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, **settings)
    folder = tmp_path / "out"
    recorded = set(json.loads((folder / OUTPUTS_RECORD).read_text()))
    assert "checkpoint-2" in recorded and "README.md" in recorded and "checkpoint-1" not in recorded
    train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, **settings)  # the same command again
    trainer = build(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, **{**settings, "max_steps": 3})
    trainer.train(resume_from_checkpoint=str(folder / "checkpoint-2"))
    assert trainer.state.global_step == 3


def test_a_run_after_one_that_logged_completions_without_saving_proceeds(tmp_path, tiny_model_dir, train_dataset):
    """TRL writes completions/*.parquet at every log, not at a save: the package records them when they are written,
    so the same command runs again into the same folder; a user's own completions/ is still refused, untouched."""
    table = tmp_path / "out" / "completions" / "completions_00001.parquet"
    train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=1, log_completions=True)
    first = table.stat().st_mtime_ns
    second = train(DPPOTrainer, tmp_path, tiny_model_dir, train_dataset, max_steps=1, log_completions=True)
    assert second.state.global_step == 1 and table.stat().st_mtime_ns > first
    users = tmp_path / "users"
    (users / "out" / "completions").mkdir(parents=True)
    (users / "out" / "completions" / "completions_00001.parquet").write_bytes(b"my own table")
    before = snapshot(users / "out")
    trainer = build(DPPOTrainer, users, tiny_model_dir, train_dataset, max_steps=1, log_completions=True)
    with pytest.raises(ValueError, match=r"holds completions/, which .* dppo-trl did not write"):
        trainer.train()
    assert snapshot(users / "out") == before


def test_which_entries_are_at_risk(tmp_path):
    folder = tmp_path / "out"
    users_folder(folder)
    assert foreign_outputs(folder) == ["README.md", "checkpoint-100/", "tokenizer.json"]
    assert foreign_outputs(folder, saves_checkpoints=False) == ["README.md", "tokenizer.json"]
    assert foreign_outputs(folder, resume_from_checkpoint=str(folder / "checkpoint-100")) == []
    assert foreign_outputs(folder, resume_from_checkpoint=True) == []
    assert foreign_outputs(folder, resume_from_checkpoint=str(tmp_path / "elsewhere" / "checkpoint-1")) != []
    assert foreign_outputs(tmp_path / "missing") == []
    check_output_dir(tmp_path / "missing")
    record_outputs(folder, since=float("inf"))  # nothing written since: nothing becomes dppo-trl's
    assert json.loads((folder / OUTPUTS_RECORD).read_text()) == []
    record_outputs(folder, since=0.0)
    assert foreign_outputs(folder) == []
    (folder / OUTPUTS_RECORD).write_text("not json")
    assert foreign_outputs(folder, saves_checkpoints=False) == ["README.md", "tokenizer.json"]

