"""Each benchmark program runs on a minimal setting, so none can rot."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import bench_train  # noqa: E402


def test_bench_train_runs_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rows = bench_train.main(["--rounds", "1", "--warmup", "0", "--hidden-size", "32", "--layers", "1",
                             "--json", str(out)])
    assert [r["variant"] for r in rows] == ["grpo", "dppo", "dppo+packing"]
    assert json.loads(out.read_text())["results"][0]["time_ratio_to_grpo"] == 1.0
    packed, grpo = rows[2], rows[0]
    assert packed["real_tokens"] < grpo["real_tokens"] and packed["token_density"] > grpo["token_density"]
    assert "x the ideal ratio" in capsys.readouterr().out


import bench_e2e  # noqa: E402


def test_time_to_target_reads_the_first_crossing_of_the_trailing_mean():
    assert bench_e2e.trailing_mean([0.0, 1.0, 1.0, 0.0], 2) == [0.0, 0.5, 1.0, 0.5]
    run = {
        "steps": [{"step": s, "wall": 10.0 * s} for s in range(1, 9)],
        "generations": [{"step": s, "population_reward": r} for s, r in zip((0, 2, 4, 6), (0.2, 0.4, 0.8, 0.6))],
    }
    walls, rewards = bench_e2e.reward_curve(run, window=1)
    assert walls == (20.0, 40.0, 60.0, 80.0) and rewards == (0.2, 0.4, 0.8, 0.6)  # a generation ends 2 steps on
    assert bench_e2e.time_to((walls, rewards), 0.5) == 60.0
    assert bench_e2e.time_to((walls, rewards), 0.9) is None
    assert bench_e2e.reward_curve(run, window=2, last_step=4) == ((20.0, 40.0), (0.2, 0.30000000000000004))


@pytest.mark.slow
def test_bench_e2e_runs_every_method_and_sweep_and_plots(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    tables = bench_e2e.main(
        [
            "--seeds",
            "0",
            "--sweep-seeds",
            "0",
            "--steps",
            "12",
            "--extension",
            "0.5",
            "--eval-every",
            "4",
            "--train-prompts",
            "16",
            "--heldout",
            "16",
            "--batch-size",
            "16",
            "--steps-per-generation",
            "2",
            "--window",
            "1",
            "--warmup",
            "0",
            "--sft-steps",
            "120",
            "--model-cache",
            str(tmp_path / "toy"),
            "--plots",
            str(tmp_path / "plots"),
            "--json",
            str(out),
        ]
    )
    assert set(tables) == {"methods", "completion_keep_rate", "prompt_keep_rate"}
    rows = {r["method"]: r for r in tables["methods"]}
    assert list(rows) == list(bench_e2e.METHODS)
    grpo, dppo = rows["grpo"], rows["dppo"]
    assert grpo["total_ratio"] == 1.0 and grpo["time_to_target_ratio"] == 1.0 and grpo["kept_fraction"] == 1.0
    # at most half (fewer when whole groups got equal rewards: such rows contribute nothing and are dropped)
    assert 0 < dppo["kept_fraction"] <= 0.5 and 0 < rows["topk"]["kept_fraction"] <= 0.5
    assert dppo["trained_tokens"] < grpo["trained_tokens"]
    for row in rows.values():
        assert row["steps"] == 12  # the common budget, whatever the extension
        shares = row["phase_share"]
        assert shares["generation"] > 0 and shares["loss"] > 0 and abs(sum(shares.values()) - 1) < 1e-6
    data = json.loads(out.read_text())
    runs = json.loads((tmp_path / data["runs_file"]).read_text())
    pruned = [r for r in runs if r["method"] == "dppo+prompt"][0]
    assert len(pruned["steps"]) == 12 + 8 and pruned["evals"][-1]["step"] == 20  # extension: 6 rounded up to 8
    # The cut at 0.5 with the ema score: every group at the first step (nothing seen), half of GRPO's after (what
    # prompt pruning reweights is tested on built inputs in test_prompt_pruning.py, not here).
    grpo_run = [r for r in runs if r["method"] == "grpo"][0]
    full = grpo_run["generations"][0]["completions"]
    assert [g["completions"] for g in pruned["generations"]] == [full] + [full // 2] * (len(pruned["generations"]) - 1)
    assert [r["method"] for r in tables["completion_keep_rate"]] == ["grpo", "keep=1.0", "keep=0.75", "keep=0.5",
                                                                      "keep=0.25"]
    assert len(data["plots"]) == 6 and all(Path(p).stat().st_size > 10_000 for p in data["plots"])
    assert "to target" in capsys.readouterr().out
    replotted = bench_e2e.main(["--from-json", str(out), "--plots", str(tmp_path / "again")])
    assert replotted == data["tables"] and len(list((tmp_path / "again").glob("*.png"))) == 6


@pytest.mark.slow
@pytest.mark.subprocess
def test_gpu_script_runs_on_cpu_and_writes_its_comparison(tmp_path):
    import os
    import subprocess

    out = tmp_path / "gpu.json"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), CUDA_VISIBLE_DEVICES="",
               CHECK_OUT=str(tmp_path / "check.json"), REASONING_OUT=str(tmp_path / "reasoning.json"),
               PHASES_OUT=str(tmp_path / "phases.json"))
    script = Path(__file__).parent.parent / "benchmarks" / "gpu.sh"
    result = subprocess.run(["bash", str(script), "--steps", "4", "--cache", str(tmp_path / "cache")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    grpo, dppo = data["results"]
    assert (grpo["method"], dppo["method"]) == ("grpo", "dppo") and data["device"].startswith("cpu")
    assert grpo["step_ratio_to_grpo"] == 1.0 and dppo["kept_fraction"] == 0.5
    assert dppo["training_phase_s"] > 0 and "step s" in result.stdout
    check = json.loads((tmp_path / "check.json").read_text())  # packed == padded ran first, on every CPU kernel
    assert {"sdpa", "eager", "varlen_reference"} <= set(check) and "MISMATCH" not in result.stdout
    reasoning = json.loads((tmp_path / "reasoning.json").read_text())  # then the reasoning shape, GA 2 < spg 4
    assert reasoning["config"]["task"] == "countdown" and reasoning["trainer_args"]["gradient_accumulation_steps"] == 2
    assert [r["method"] for r in reasoning["results"]] == ["grpo", "dppo"]
    assert all(0 <= r["zero_variance_share"] <= 1 and 0 < r["padded_density"] <= 1 for r in reasoning["results"])
    phases = json.loads((tmp_path / "phases.json").read_text())  # first: the per-phase times, no TRL needed
    assert [(r["completion_length"], r["method"]) for r in phases["results"]] == [
        (16, "grpo"), (16, "dppo"), (64, "grpo"), (64, "dppo")]
    for grpo, dppo in zip(phases["results"][::2], phases["results"][1::2]):
        assert grpo["step_ratio"] == 1.0 and dppo["rows"] < grpo["rows"] == 64 and dppo["generation"] == grpo["generation"]
        assert all(dppo[p] > 0 for p in ("generation", "logps", "loss"))


def test_gpu_phases_runs_without_trl(tmp_path):
    """The bare GPU machine has no TRL: the script imports the package's pure core without its __init__."""
    import os
    import subprocess

    out = tmp_path / "phases.json"
    script = Path(__file__).parent.parent / "benchmarks" / "gpu_phases.py"
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "trl.py").write_text("raise ImportError('no TRL on this machine')\n")
    (blocker / "sitecustomize.py").write_text(
        "import importlib.util, sys\n"
        "_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'trl' else _find(name, *a)\n")
    env = dict(os.environ, PYTHONPATH=str(blocker), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, str(script), "--models", "tiny", "--completion-lengths", "8",
                             "--prompts", "2", "--group", "4", "--prompt-length", "4", "--steps", "2",
                             "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["method"] for r in rows] == ["grpo", "dppo"] and "train/GRPO" in result.stdout


def test_bench_balance_reports_the_imbalance_before_and_after(tmp_path):
    import bench_balance

    rows = bench_balance.main(["--worlds", "2", "4", "--keep-rates", "0.5", "--batches", "20",
                               "--json", str(tmp_path / "b.json")])
    assert [r["world"] for r in rows] == [2, 4]
    for r in rows:
        assert r["imbalance_after_median"] <= r["imbalance_before_median"]
        assert r["imbalance_after_p95"] <= 1.1 + 1e-9 < r["imbalance_before_p95"] and 0 < r["rows_moved_fraction"] < 0.5


import bench_reasoning  # noqa: E402


def test_bench_reasoning_time_to_target_is_the_first_evaluation_at_grpo_final_accuracy():
    run = {"evals": [{"wall": w, "accuracy": a} for w, a in ((0.0, 0.2), (5.0, 0.6), (9.0, 0.4), (12.0, 0.6))]}
    walls, smooth = bench_reasoning.smoothed_accuracy(run, window=2)
    assert walls == [0.0, 5.0, 9.0, 12.0] and [round(a, 9) for a in smooth] == [0.2, 0.4, 0.5, 0.5]
    assert bench_reasoning.time_to((walls, smooth), 0.45) == 9.0  # the single 0.6 at 5 s is not enough
    assert bench_reasoning.time_to((walls, smooth), 0.6) is None


@pytest.mark.slow
def test_bench_reasoning_runs_every_method_over_the_same_epochs(tmp_path, capsys):
    out = tmp_path / "reasoning.json"
    rows = bench_reasoning.main(["--seeds", "0", "--epochs", "2", "--train-prompts", "16", "--heldout", "4",
                                 "--eval-every", "0.5", "--sft-steps", "20", "--hidden-size", "32", "--layers", "1",
                                 "--max-completion-length", "24",
                                 "--batch-size", "16", "--window", "2",
                                 "--warmup", "0", "--model-cache", str(tmp_path / "model"), "--json", str(out),
                                 "--plots", str(tmp_path / "plots")])
    by = {r["method"]: r for r in rows}
    assert list(by) == list(bench_reasoning.METHODS)
    grpo = by["grpo"]
    assert grpo["time_per_epoch_ratio"] == 1.0 and grpo["training_phase_ratio"] == 1.0 and grpo["kept_fraction"] == 1
    # 16 prompts x 2 epochs, 8 prompts per generation batch: 4 generation batches of 64 completions
    for method in ("grpo", "packing", "dppo", "topk", "zero_variance"):
        assert by[method]["generation_batches"] == 4 and by[method]["generated_completions"] == 256
    assert by["packing"]["kept_fraction"] == 1.0 and by["packing"]["trained_tokens"] == grpo["trained_tokens"]
    assert 0 <= by["dppo"]["kept_fraction"] <= 0.5 and by["dppo"]["trained_tokens"] <= grpo["trained_tokens"]
    # the ideal ratio of GRPO itself: its real tokens over the tokens its padded batches allocate
    assert 0 < grpo["ideal_training_ratio"] <= 1
    assert by["dppo+prompt"]["generated_completions"] <= 256  # prompt pruning may generate fewer in epoch 2
    for row in rows:
        assert 0 <= row["zero_variance_share"] <= 1 and abs(sum(row["phase_share"].values()) - 1) < 1e-6
        assert row["seeds"] == 1 and row["heldout_final_diff_ci"] is None  # one seed: no interval
    # the 90%-of-rise figures: GRPO against itself is 1 wherever its curve rose (None where it did not)
    for key in ("steps_to_90_ratio", "time_to_90_ratio", "heldout_steps_to_90_ratio", "heldout_time_to_90_ratio"):
        assert grpo[key + "_per_seed"] in ([1.0], [None])
    saved = json.loads(out.read_text())
    assert [r["method"] for r in saved["results"]] == list(bench_reasoning.METHODS)
    runs = json.loads((tmp_path / saved["runs_file"]).read_text())
    last = {r["method"]: r["evals"][-1]["accuracy"] for r in runs}
    assert by["dppo"]["heldout_final_diff_mean"] == pytest.approx(last["dppo"] - last["grpo"], abs=1e-12)
    progress = [e["progress"] for e in runs[0]["evals"]]
    assert progress[0] == 0 and progress[-1] == 8 and len(progress) >= 3  # 2 epochs x 4 steps, every half epoch
    assert len(saved["plots"]) == 2 and all(Path(p).stat().st_size > 10_000 for p in saved["plots"])
    printed = capsys.readouterr().out
    assert "epoch/GRPO" in printed and "To 90% of GRPO's rise" in printed
    replotted = bench_reasoning.main(["--from-json", str(out), "--plots", str(tmp_path / "again")])
    assert replotted == saved["results"] and len(list((tmp_path / "again").glob("*.png"))) == 2


import bench_real  # noqa: E402


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_real_runs_on_the_real_model_and_summarizes_its_saved_runs(tmp_path, capsys):
    out = tmp_path / "real.json"
    argv = ["--seeds", "0", "--steps", "2", "--methods", "grpo", "dppo+prompt", "dppo", "dppo+repeated", "--warmup",
            "0", "--heldout", "4", "--threads", "1", "--generations", "4",
            "--train-prompts", "2", "--prompts-per-step", "1", "--max-completion-length", "4", "--eval-every", "2",
            "--window", "2", "--json", str(out)]
    rows = bench_real.main(argv)
    saved = json.loads(out.read_text())
    assert [r["method"] for r in saved["results"]] == ["grpo", "dppo+prompt", "dppo", "dppo+repeated"]
    # The methods took turns: each in a process of its own, one optimizer step at a time, their turns never
    # overlapping; the first four turns went to four methods (one after the other, they would all be GRPO's).
    records = json.loads((tmp_path / "real_runs.json").read_text())["runs"]
    assert saved["timing"] == "in turns" and {run["timing"] for run in records} == {"in turns"}
    turns = sorted((start, end, run["method"]) for run in records for start, end in run["turns"])
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(turns, turns[1:]))
    assert len({method for *_, method in turns[:4]}) == 4 and all(len(run["turns"]) == 2 for run in records)
    # Each method's clock counts its own turns only: its last step's wall is the sum of its turns, give or take
    # the evaluation it leaves out.
    for run in records:
        assert run["steps"][-1]["wall"] <= sum(end - start for start, end in run["turns"]) + 1e-6
    # One figure per quantity: the time per step by phase, under the name that says how it was taken.
    assert all("phase_ratios" in r and "generation_ratio" not in r for r in saved["results"])
    grpo, pruned = saved["results"][:2]
    sharing = saved["prefix_sharing"]  # DPPO with prefix sharing (the default) over DPPO without it, paired
    assert sharing["seeds"] == [0] and 0 <= sharing["prefix_tokens_saved"] < 1  # 0 where a batch kept nothing
    assert all(sharing["ratios"][phase][0] > 0 for phase in ("loss", "training", "step"))  # no log-prob pass here
    assert grpo["time_to_target_ratio"] == 1.0 and grpo["reached_target"] == "1/1"
    assert grpo["final_reward_diff_mean"] == 0.0 and grpo["total_ratio_mean"] == 1.0
    assert pruned["kept_fraction"] <= 1.0 and "time_to_target_ratio" in pruned
    assert {"rise", "rise_se", "heldout_rise", "heldout_rise_se"} <= set(saved["grpo_rise"])
    assert "GRPO's curve:" in capsys.readouterr().out
    per_step = {run["method"]: run["generations"] for run in records}
    for method, generations in per_step.items():  # each group's prompt, mean reward, prompt weight and rewards
        for generation in generations:
            [(prompt, reward, weight, flat, rewards)] = generation["groups"]
            assert len(prompt) == 8 and reward == pytest.approx(generation["reward"], abs=1e-4)
            assert sum(rewards) / len(rewards) == pytest.approx(reward, abs=1e-3)
            assert flat == (generation["zero_variance_groups"] == 1.0)
            assert (weight is None) == (method in ("grpo", "dppo", "dppo+repeated"))
    again = bench_real.main(
        [*argv, "--from-runs", str(tmp_path / "real_runs.json"), "--json", str(tmp_path / "b.json")]
    )
    assert [r["time_to_target_ratio"] for r in again] == [r["time_to_target_ratio"] for r in rows]
    # Runs taken one after the other (records without "timing", from before the turns): their time figures are
    # labelled so, and the summary says it.
    older = tmp_path / "older_runs.json"
    older.write_text(json.dumps({**json.loads((tmp_path / "real_runs.json").read_text()),
                                 "runs": [{k: v for k, v in run.items() if k != "timing"} for run in records]}))
    bench_real.main([*argv, "--from-runs", str(older), "--json", str(tmp_path / "c.json")])
    labelled = json.loads((tmp_path / "c.json").read_text())
    assert labelled["timing"] == "one after the other"
    for row, turned in zip(labelled["results"], saved["results"]):
        assert "phase_ratios" not in row and row["phase_ratios_one_after_the_other"] == turned["phase_ratios"]


import bench_prefix  # noqa: E402


def test_bench_prefix_measures_shared_against_repeated_rows(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    bench_prefix.main(["--prompt-lengths", "24", "--completion-lengths", "4", "--kept", "1", "3", "--repeats", "1",
                       "--threads", "1", "--json", str(out)])
    one, three = json.loads(out.read_text())["results"]
    assert one["positions_ratio"] == 1.0 and one["max_logp_difference"] == 0.0  # one kept row: nothing shared
    assert three["positions_ratio"] == pytest.approx((23 + 3 * 5) / (3 * 28))  # 23 once, 3 branches of 1 + 4
    assert three["max_logp_difference"] < 1e-4 and three["shared_peak_mb"] > 0
    assert "peak memory" in capsys.readouterr().out


import bench_audit  # noqa: E402


@pytest.mark.slow
@pytest.mark.real_model  # bench_audit trains SmolLM2-135M-Instruct
def test_bench_audit_reports_each_designs_audit_readings(tmp_path, capsys):
    out = tmp_path / "audit.json"
    rows = bench_audit.main(["--steps", "2", "--runs", "stratified@0.25", "topk@0.25", "--prompts-per-step", "1",
                             "--generations", "4", "--max-completion-length", "4", "--threads", "1",
                             "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [r["design"] for r in saved["rows"]] == ["stratified", "topk"] == [r["design"] for r in rows]
    for row, run in zip(saved["rows"], saved["runs"]):
        assert row["audits"] == len(run["audits"]) == 2 and row["exact"]
        assert row["audit_share"] > 0 and (row["mean_rel_error"] is None or row["mean_rel_error"] >= 0)
    assert saved["rows"][1]["mean_model_error"] is None  # topk has no keep probabilities: no model-based error
    assert all(r["keep_rate"] == 0.25 and 0 <= r["kept_fraction"] <= 1 for r in rows)
    assert "| stratified | 0.25 |" in capsys.readouterr().out


import bench_reuse  # noqa: E402


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_reuse_counts_generations_times_the_training_in_turns_and_reports(tmp_path, capsys):
    """The reuse benchmark at a minimal setting: learning runs of GRPO at mu 1 and DPPO at mu 2 (records
    kept per seed; a second call runs nothing), their held-out scores at the same generation counts, the training
    phase per generation timed in turns, and the summary with its projection."""
    small = ["--train-prompts", "2", "--heldout", "4", "--prompts-per-step", "1", "--group-size", "4",
             "--max-completion-length", "4", "--records", str(tmp_path / "records"), "--learning-records",
             str(tmp_path / "none")]
    methods = ["--methods", "grpo", "dppo@mu2"]
    bench_reuse.main(["run", "--seeds", "0", *methods, "--generations", "2", "--eval-every", "1", *small])
    records = json.loads((tmp_path / "records" / "reuse_seed0_runs.json").read_text())["runs"]
    steps = {run["method"]: len(run["steps"]) for run in records}
    assert steps == {"grpo": 2, "dppo@mu2": 4}  # two generation batches each
    for run in records:  # evaluated at 0, 1 and 2 generation batches
        assert [e["progress"] for e in run["evals"]] == [0, 1, 2]
    bench_reuse.main(["run", "--seeds", "0", *methods, "--generations", "2", "--eval-every", "1", *small])
    assert json.loads((tmp_path / "records" / "reuse_seed0_runs.json").read_text())["runs"] == records
    bench_reuse.main(["timing", "--seeds", "0", *methods, "--generations", "2", *small])
    timed = json.loads((tmp_path / "records" / "timing_seed0_runs.json").read_text())["runs"]
    assert {run["timing"] for run in timed} == {"in turns"}
    out = tmp_path / "reuse.json"
    summary = bench_reuse.main(["report", "--generations", "2", "--eval-every", "1", "--json", str(out),
                                "--plots", str(tmp_path / "plots"), *small])
    assert json.loads(out.read_text()) == summary
    rows = {r["name"]: r for r in summary["results"]}
    assert set(rows) == {"grpo", "dppo@mu2"} and rows["dppo@mu2"]["num_iterations"] == 2
    assert rows["grpo"]["training_ratio_per_generation"] == [1.0, 0.0]
    assert rows["dppo@mu2"]["training_ratio_per_generation"][0] > 0
    assert summary["timing_seeds"] == [0] and summary["elapsed_s"] > 0
    assert len(list((tmp_path / "plots").glob("*.png"))) == 1
    assert "Learning per generation" in capsys.readouterr().out
