"""The speedup split in two factors (benchmarks/harness/targets.py): the target at 90% of GRPO's own rise, the
steps and the time to it, the held-out interval, time per step by phase and the projection, on hand-made runs."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))

from harness import targets  # noqa: E402


def make_run(rewards, heldout, seconds_per_step=1.0, method="grpo", seed=0, eval_every=2):
    """One generation batch per optimizer step (GA = steps_per_generation = 1), evaluations every ``eval_every``
    steps from step 0."""
    steps = [{"step": s, "wall": seconds_per_step * s} for s in range(1, len(rewards) + 1)]
    generations = [{"step": s, "population_reward": r} for s, r in enumerate(rewards)]
    evals = [{"step": eval_every * i, "wall": seconds_per_step * eval_every * i, "accuracy": a}
             for i, a in enumerate(heldout)]
    return {"method": method, "seed": seed, "steps": steps, "generations": generations, "evals": evals}


GRPO = make_run([0.0] * 4 + [0.1 * k for k in range(1, 13)], [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])


def test_the_training_target_is_90_percent_of_grpos_rise_between_its_first_and_last_windows():
    # first window of 4: 0.0; last: mean(0.9, 1.0, 1.1, 1.2) = 1.05; 90% of the rise: 0.945
    assert targets.training_target(GRPO, window=4) == pytest.approx(0.945)
    assert targets.heldout_target(GRPO) == pytest.approx(0.72)
    flat = make_run([0.5] * 8, [0.3, 0.3])
    assert targets.training_target(flat, 4) is None and targets.heldout_target(flat) is None


def test_steps_and_time_to_the_target_against_grpos_own():
    # DPPO learns twice as fast per step, and its steps take 0.4 of GRPO's
    fast = make_run([0.0] * 4 + [0.2 * k for k in range(1, 13)], [0.0, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8, 0.8],
                    seconds_per_step=0.4, method="dppo")
    base_step, base_wall = targets.first_reach(targets.reward_points(GRPO, 4), targets.training_target(GRPO, 4))
    # GRPO's trailing mean of 4 first reaches 0.945 with batches 11..14 (0.95), trained on by step 15
    assert (base_step, base_wall) == (15, 15.0)
    figures = targets.seed_targets(fast, GRPO, window=4)
    step, _ = targets.first_reach(targets.reward_points(fast, 4), targets.training_target(GRPO, 4))
    assert figures["steps_to_90_ratio"] == pytest.approx(step / 15) and step < 15
    assert figures["time_to_90_ratio"] == pytest.approx(0.4 * step / 15)
    # held-out: GRPO reaches 0.72 at its evaluation of step 16, the fast run at step 8 (0.8)
    assert figures["heldout_steps_to_90_ratio"] == pytest.approx(0.5)
    assert figures["heldout_time_to_90_ratio"] == pytest.approx(0.2)
    assert figures["heldout_final_diff"] == pytest.approx(0.0)


def test_a_seed_that_never_reaches_the_target_is_none_and_left_out_of_the_mean():
    slow = make_run([0.0] * 16, [0.0] * 9, method="dppo", seed=1)
    fast = make_run([0.0] * 4 + [0.2 * k for k in range(1, 13)], [0.0, 0.2, 0.4, 0.6, 0.8, 0.8, 0.8, 0.8, 0.8],
                    method="dppo", seed=0)
    runs = [GRPO, dict(GRPO, seed=1), fast, slow]
    out = targets.target_figures(runs, "dppo", window=4)
    assert out["seeds"] == [0, 1]
    assert out["heldout_steps_to_90_ratio_per_seed"] == [0.5, None]
    assert out["heldout_steps_to_90_ratio_mean"] == 0.5 and out["heldout_steps_to_90_ratio_reached"] == "1/2"
    # the final held-out differences 0.0 and -0.8: mean -0.4, SE 0.4, t(1) = 12.706
    low, high = out["heldout_final_diff_ci"]
    half = 12.7062 * 0.4
    assert low == pytest.approx(-0.4 - half, abs=1e-4) and high == pytest.approx(-0.4 + half, abs=1e-4)
    assert out["heldout_non_inferior"] is False


def test_student_t_quantiles_err_wide_between_tabulated_degrees_of_freedom():
    assert targets.t95(5) == pytest.approx(2.5706, abs=1e-4) and targets.t95(11) == pytest.approx(2.2010, abs=1e-4)
    assert targets.t95(1000) == pytest.approx(1.9623, abs=1e-4)  # above the normal's 1.96 at every df


def test_time_per_step_by_phase_and_its_ratio():
    def steps(generation, logps, loss, rest, n=5):
        return [{"step": s + 1, "wall": 0.0, "generation": generation, "scoring": logps + rest / 2, "logps": logps,
                 "loss": loss, "other": rest / 2} for s in range(n)]

    grpo = {"steps": steps(2.0, 1.0, 6.0, 1.0)}
    dppo = {"steps": steps(2.0, 0.5, 2.0, 1.0)}
    means = targets.phase_means(grpo)
    assert means["step"] == (10.0, 0.0) and means["training"] == (8.0, 0.0) and means["rest"] == (1.0, 0.0)
    ratios = targets.phase_ratios(dppo, grpo)
    assert ratios["loss"] == (pytest.approx(1 / 3), 0.0) and ratios["step"] == (pytest.approx(0.55), 0.0)
    assert ratios["training"] == (pytest.approx(3.5 / 8), 0.0)
    assert targets.phase_ratios(grpo, grpo)["logps"] == (1.0, 0.0)


def test_the_projection_multiplies_learning_per_step_by_the_step_ratio_at_each_share():
    rows = targets.projection({"dppo": (0.8, 0.1), "never": (None, None)}, {"dppo": (0.3, 0.02)}, shares=(0.0, 0.7))
    assert [r["generation_share"] for r in rows] == [0.0, 0.7] and {r["method"] for r in rows} == {"dppo"}
    assert rows[0]["time_ratio"] == pytest.approx(0.8 * 0.3)
    assert rows[1]["time_ratio"] == pytest.approx(0.8 * (0.7 + 0.3 * 0.3))
    step = 0.7 + 0.3 * 0.3
    assert rows[1]["time_ratio_se"] == pytest.approx(((0.1 * step) ** 2 + (0.8 * 0.3 * 0.02) ** 2) ** 0.5)


def test_revisit_outcomes_count_what_each_look_of_a_prompts_last_group_gave_next():
    def generation(*groups):
        return {"groups": [list(g) for g in groups]}

    run = {"generations": [
        generation(("a", 0.0, None, True), ("b", 0.5, None, False)),
        generation(("a", 0.25, None, False), ("b", 1.0, None, True)),  # a: failed -> spread; b: spread -> solved
        generation(("a", 1.0, None, True), ("c", 1.0, None, True)),  # a: spread -> solved
        generation(("c", 1.0)),  # an older record without the flat field: read from its mean reward
    ]}
    table = targets.revisit_outcomes([run, {"generations": [{"step": 0}]}])
    assert table["every completion failed"] == {"revisits": 1, "spread_next": 1.0}
    assert table["spread"] == {"revisits": 2, "spread_next": 0.0}
    assert table["every completion solved"] == {"revisits": 1, "spread_next": 0.0}


def test_the_cuts_projection_shrinks_generation_by_its_ratio():
    """Under the cut, generation per step is ``g`` of GRPO's: the step ratio at share s is ``s g + (1 - s) t``."""
    [at] = targets.projection({"cut": (0.9, 0.0)}, {"cut": (0.2, 0.0)}, shares=(0.7,),
                              generation_ratios={"cut": (0.6, 0.0)})
    assert at["time_ratio"] == pytest.approx(0.9 * (0.7 * 0.6 + 0.3 * 0.2))
    [grpo_generation] = targets.projection({"cut": (0.9, 0.0)}, {"cut": (0.2, 0.0)}, shares=(0.7,))
    assert grpo_generation["time_ratio"] == pytest.approx(0.9 * (0.7 + 0.3 * 0.2))


def test_a_probe_predicts_flat_groups_weighted_over_every_candidate():
    """Per k: the weighted share of flat probes (the group's first k rewards equal), of those the share whose group
    is flat, and the share of spread groups a flat probe hides; records without rewards are left out."""
    groups = [["a", 0.0, 1.0, True, [0.0, 0.0, 0.0, 0.0]],   # flat, flat probes of every size
              ["b", 0.5, 3.0, False, [0.0, 0.0, 1.0, 1.0]],  # spread behind a flat probe of 2, seen by 4
              ["c", 0.5, 1.0, False, [0.0, 1.0, 1.0, 0.0]],  # spread, seen by a probe of 2
              ["d", 0.5, 1.0, False]]                         # an older record: no rewards
    out = {p["k"]: p for p in targets.probe_prediction([{"generations": [{"groups": groups}]}], sizes=(1, 2, 4))}
    assert out[2]["groups"] == 3 and out[2]["probe_flat_share"] == pytest.approx(4 / 5)
    assert out[2]["group_flat_given_probe_flat"] == pytest.approx(1 / 4)
    assert out[2]["spread_hidden_by_flat_probe"] == pytest.approx(3 / 4)
    assert out[1]["probe_flat_share"] == 1.0 and out[4]["spread_hidden_by_flat_probe"] == 0.0
    assert targets.probe_prediction([{"generations": [{"groups": [groups[3]]}]}]) is None
