"""bench_entropy_filter: the turns that interleave the methods step by step (a fixed rotation, each thread's random
state its own), the paired figures on hand-made runs, and a minimal run of the program on the real model."""

import json
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

import bench_entropy_filter as bef  # noqa: E402


def test_the_turns_rotate_one_step_at_a_time_and_keep_each_threads_random_state():
    turns, order, draws = bef.Turns(3, seed=7), [], {}
    steps = {0: 3, 1: 2, 2: 3}  # a thread that finishes early leaves the rotation

    def work(i):
        turns.wait(i)
        mine = []
        for _ in range(steps[i]):
            order.append(i)
            mine.append(float(torch.rand(())))
            torch.rand(5)
            turns.step(i)
        draws[i] = mine
        turns.finish(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    turns.gates[0].release()
    for thread in threads:
        thread.join(timeout=30)
    assert order == [0, 1, 2, 0, 1, 2, 0, 2]
    torch.manual_seed(7)
    alone = []
    for _ in range(3):
        alone.append(float(torch.rand(())))
        torch.rand(5)
    assert draws == {0: alone, 1: alone[:2], 2: alone}  # as each thread alone from the same seed


def make_run(method, seed, training, generation=1.0, unkept=0.0, filtered=False, settings=None):
    steps = [{"step": k + 1, "generation": generation, "scoring": 0.1, "logps": 0.0, "loss": t - 0.2, "other": 0.1,
              "unkept": unkept} for k, t in enumerate(training)]
    generations = [{"completions": 32, "kept_completions": 32 if settings is None else 8, "zero_variance_groups": 0.5}
                   for _ in training]
    return {"method": method, "seed": seed, "settings": settings, "filter": filtered, "steps": steps,
            "generations": generations}


def test_the_figures_pair_each_step_with_grpos_and_skip_the_first():
    keep = {"completion_keep_rate": 0.5}
    runs = [make_run("grpo", 0, [9.0, 4.0, 8.0], filtered=True), make_run("grpo", 1, [9.0, 2.0, 2.0], filtered=True),
            make_run("dppo+filter", 0, [5.0, 2.0, 2.0], unkept=0.5, filtered=True, settings=keep),
            make_run("dppo+filter", 1, [5.0, 1.0, 1.0], unkept=0.5, filtered=True, settings=keep),
            make_run("dppo", 0, [5.0, 1.0, 1.0], settings=keep), make_run("dppo", 1, [5.0, 0.5, 0.5], settings=keep)]
    grpo, exact, plain = bef.figures(runs, ["grpo", "dppo+filter", "dppo"])
    assert grpo["training_ratio_mean"] == 1.0 and grpo["training_ratio_se"] == 0.0 and grpo["kept_fraction"] == 1.0
    assert exact["paired_steps"] == 4 and exact["training_ratio_mean"] == pytest.approx((0.5 + 0.25 + 0.5 + 0.5) / 4)
    assert exact["training_ratio_per_seed"] == pytest.approx([4 / 12, 0.5])  # each seed's ratio of means
    assert exact["unkept_s"] == 0.5 and exact["unkept_share"] == pytest.approx(0.5 / 1.5)
    assert exact["unkept_ratio_mean"] == pytest.approx((0.5 / 4 + 0.5 / 8 + 0.5 / 2 + 0.5 / 2) / 4)
    assert exact["training_ratio_to_unfiltered_per_seed"] == [2.0, 2.0]  # per seed: ratios of means
    assert exact["training_ratio_to_unfiltered_mean"] == 2.0 and exact["training_ratio_to_unfiltered_se"] == 0.0
    assert exact["step_ratio_mean"] == pytest.approx((3 / 5 + 3 / 9 + 2 / 3 + 2 / 3) / 4)
    assert "training_ratio_to_unfiltered_mean" not in plain and plain["kept_fraction"] == 0.25
    assert plain["zero_variance_share"] == 0.5


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_entropy_filter_runs_on_the_real_model_and_adds_seeds(tmp_path, capsys):
    out = tmp_path / "filter.json"
    argv = ["--seeds", "0", "--steps", "2", "--train-prompts", "2", "--prompts-per-step", "1",
            "--max-completion-length", "4", "--json", str(out)]
    rows = bef.main(argv)
    assert [r["method"] for r in rows] == list(bef.METHODS)
    grpo, exact, plain = rows
    assert grpo["training_ratio_mean"] == 1.0 and exact["filter"] and not plain["filter"]
    # The unkept rows' forward runs under the filter only: without it the call returns at once (a forward of the
    # real model takes over 0.1 s). With the filter it may run in no step here: a micro-batch that kept no row
    # skips it, and with one prompt a step every group may be flat.
    assert exact["unkept_s"] >= 0 and plain["unkept_s"] < 1e-2
    assert exact["training_ratio_to_unfiltered_mean"] > 0 and exact["paired_steps"] == 1
    saved = json.loads(out.read_text())
    assert saved["config"]["quantile"] == 0.2 and len(saved["runs"]) == 3 and saved["machine"]["cores"] > 0
    assert all(len(run["steps"]) == 2 for run in saved["runs"])
    assert "over DPPO without the filter" in capsys.readouterr().out
    again = bef.main([*argv[:1], "0", "1", *argv[2:], "--resume"])  # seed 0 kept, seed 1 added
    assert again[1]["seeds"] == [0, 1]
    resumed = json.loads(out.read_text())
    assert resumed["runs"][:3] == saved["runs"] and len(resumed["runs"]) == 6
