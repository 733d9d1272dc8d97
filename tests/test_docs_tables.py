"""The benchmark figures of the docs are generated from benchmarks/results/*.json (benchmarks/render_docs.py):
the docs must equal what the JSON gives, a drifted number must fail the check, and the tables must be made as
the renderer's functions say. No benchmark runs here."""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import render_docs  # noqa: E402

DOCS = [ROOT / d for d in render_docs.DOCS]
RENDERED = DOCS + [ROOT / d for d in render_docs.MORE_DOCS]  # every doc with generated parts


@pytest.fixture(scope="module")
def results():
    return render_docs.load_results()


def test_the_docs_equal_what_their_json_gives(results):
    used = {m["spec"] for doc in RENDERED for m in render_docs.MARKER.finditer(doc.read_text())}
    assert set(render_docs.TABLES) <= used, "a table of render_docs is in no doc"
    stale = render_docs.stale(RENDERED, results)
    assert not stale, "docs differ from benchmarks/results/*.json (run `make docs`):\n" + "\n".join(stale.values())


def test_inline_markers_stay_inside_their_paragraph():
    """CommonMark opens an HTML block at a line that starts with ``<!--`` (the paragraph would break there and
    the rest of the line lose its markdown), and shows a comment inside a code span verbatim."""
    for doc in RENDERED:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for m in render_docs.MARKER.finditer(line):
                if m.start() == len(line) - len(line.lstrip()):
                    assert m["spec"] in render_docs.TABLES, f"{doc}:{number} starts with an inline marker"
                assert line[: m.start()].count("`") % 2 == 0, f"{doc}:{number}: a marker inside a code span"


def test_a_drifted_number_fails_the_check_and_write_restores_it(tmp_path, results):
    doc = tmp_path / "benchmarks.md"
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    cell = "| 8 | 0.5 | 1.348 |"  # the balance table's row for 8 ranks at keep 0.5, median before the move
    assert text.count(cell) == 1
    doc.write_text(text.replace(cell, "| 8 | 0.5 | 1.349 |"))
    assert render_docs.main(["--check", str(doc)]) == 1
    assert render_docs.main(["--write", str(doc)]) == 0
    assert doc.read_text() == text and render_docs.main(["--check", str(doc)]) == 0
    inline = "<!-- generated: bench_reasoning dppo time_per_epoch_ratio inv.2f -->"
    assert text.count(inline) == 1
    doc.write_text(re.sub(re.escape(inline) + r"[0-9.]+", inline + "2.00", text))  # a number in the prose
    assert render_docs.main(["--check", str(doc)]) == 1


def test_the_balance_table_from_a_small_dict():
    data = {"results": [dict(world=2, keep_rate=0.5, imbalance_before_median=1.12345, imbalance_before_p95=1.5,
                             imbalance_after_median=1.0, imbalance_after_p95=1.0994, within_10_percent_after=0.995,
                             rows_moved_fraction=0.02351)]}
    assert render_docs.balance_table(data) == (
        "| ranks | keep | before: median | before: p95 | after: median | after: p95 | batches within 10% after"
        " | rows moved |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| 2 | 0.5 | 1.123 | 1.500 | 1.000 | 1.099 | 100% | 2.4% |"
    )


def test_the_real_model_table_from_a_small_dict():
    row = dict(method="dppo", reached_target="2/2", kept_fraction=0.4567, time_to_target_ratio_mean=0.41,
               time_to_target_ratio_se=0.0344, total_ratio_mean=0.5, total_ratio_se=0.01, training_phase_ratio_mean=0.3,
               training_phase_ratio_se=0.02, ideal_training_ratio_mean=0.25, ideal_training_ratio_se=0.0,
               final_reward_mean=0.41, final_reward_se=0.03, final_reward_diff_mean=-0.02, final_reward_diff_se=0.01,
               heldout_start_mean=0.2, heldout_final_mean=0.35,
               heldout_final_se=0.05)
    never = dict(row, method="topk", reached_target="0/2", time_to_target_ratio_mean=None)
    once = dict(row, method="once", reached_target="1/2", time_to_target_ratio_se=0.0)
    table = render_docs.real_table({"results": [row, never, once]}).splitlines()
    assert "| time to GRPO's final reward (one after the other) |" in table[0]  # a record without "timing"
    in_turns = render_docs.real_table({"results": [row], "timing": "in turns"}).splitlines()
    assert "| time to GRPO's final reward (in turns) |" in in_turns[0] and in_turns[2] == table[2]
    assert table[2] == ("| DPPO (defaults: keep 0.5, stratified, packing) | 0.410 ± 0.034 | 2/2 | 0.500 ± 0.010 | "
                        "0.300 ± 0.020 | 0.250 ± 0.000 | 0.46 | 0.410 ± 0.030 | -0.020 ± 0.010 | "
                        "0.200 -> 0.350 ± 0.050 |")
    assert table[3].startswith("| topk | - | 0/2 |")
    assert table[4].startswith("| once | 0.410 (one seed) | 1/2 |")  # no SE from a single seed


def _target_row(method, **changes):
    row = {"method": method, "seeds": [0, 1, 2], "heldout_final_diff_mean": 0.01, "heldout_final_diff_ci": [-0.04, 0.06],
           "heldout_non_inferior": True}
    for key in ("steps_to_90_ratio", "time_to_90_ratio", "heldout_steps_to_90_ratio", "heldout_time_to_90_ratio"):
        row.update({f"{key}_mean": 0.8, f"{key}_se": 0.05, f"{key}_reached": "3/3"})
    return {**row, **changes}


def test_the_learning_and_projection_tables_from_a_small_dict():
    grpo = _target_row("grpo")
    once = _target_row("dppo+prompt", heldout_steps_to_90_ratio_reached="1/3", heldout_final_diff_ci=[-0.09, 0.02],
                       heldout_non_inferior=False, steps_to_90_ratio_mean=None, steps_to_90_ratio_reached="0/3")
    vllm = _target_row("dppo", seeds=[0, 1], steps_to_90_ratio_mean=1.1)
    results = {"bench_real_learning": {"results": [grpo, _target_row("dppo"), once]},
               "bench_real_vllm_learning": {"results": [grpo, vllm]}}
    table = render_docs.learning_table(results).splitlines()
    assert len(table) == 5 and table[0].startswith("| run |")  # GRPO's own rows (all 1) are left out
    # The time columns say how the runs were timed: one after the other for records without "timing".
    assert "| time to target: training reward (one after the other) |" in table[0]
    assert "| steps to target: training reward |" in table[0]
    turns = {name: dict(data, timing="in turns") for name, data in results.items()}
    assert "| time: held-out score (in turns) |" in render_docs.learning_table(turns).splitlines()[0]
    mixed = dict(results, bench_real_vllm_learning=turns["bench_real_vllm_learning"])
    assert "| time to target: training reward |" in render_docs.learning_table(mixed).splitlines()[0]
    assert table[2] == ("| transformers | DPPO (keep 0.5) | 3 | 0.80 ± 0.05 (3/3) | 0.80 ± 0.05 (3/3) | "
                        "0.80 ± 0.05 (3/3) | 0.80 ± 0.05 (3/3) | +0.010 [-0.040, +0.060] | yes |")
    fill = "DPPO + prompt pruning, retired fill mode (0.5, ema score)"
    assert table[3].startswith(f"| transformers | {fill} | 3 | - (0/3) | 0.80 (1/3) |")
    assert table[3].endswith("| no |") and table[4].startswith("| vLLM, colocated | DPPO (keep 0.5) | 2 | 1.10 ± 0.05")
    assert len(render_docs.learning_table({"bench_real_learning": results["bench_real_learning"]}).splitlines()) == 4
    reasoning = render_docs.reasoning_targets_table({"results": [dict(grpo, seeds=3), dict(once, seeds=3)]})
    assert reasoning.splitlines()[2].startswith(f"| {fill} | 3 | - (0/3) | 0.80 (1/3) |")
    projection = [{"method": "dppo", "generation_share": s, "time_ratio": t, "time_ratio_se": 0.01}
                  for s, t in ((0.1, 0.25), (0.7, 0.5))]
    faster = [dict(p, time_ratio=p["time_ratio"] / 2) for p in projection]
    both = {"bench_real_learning": {"projection": projection}, "bench_real_vllm_learning": {"projection": faster}}
    assert render_docs.projection_table(both).splitlines()[0].endswith(
        "| DPPO (keep 0.5), transformers (time per step one after the other) "
        "| DPPO (keep 0.5), vLLM, colocated (time per step one after the other) |")
    both["bench_real_learning"]["projection_sources"] = {"phases_timing": "in turns"}
    assert "| DPPO (keep 0.5), transformers (time per step in turns) |" in render_docs.projection_table(both)
    assert render_docs.projection_table(both).splitlines()[2:] == [
        "| 10% | 0.25 ± 0.01 (4.00x) | 0.12 ± 0.01 (8.00x) |",
        "| 70% | 0.50 ± 0.01 (2.00x) | 0.25 ± 0.01 (4.00x) |",
    ]
    sources = {"typical_gpu_generation_share": 0.7}
    data = {"bench_real_learning": {"results": [grpo, _target_row("dppo")], "projection": projection,
                                    "projection_sources": sources},
            "bench_real_vllm_learning": {"results": [grpo, vllm], "projection": faster, "projection_sources": sources}}
    data["bench_real_learning"]["results"].append(_target_row("dppo+cut"))  # another method: not in the headline
    headline = render_docs.headline_table(data).splitlines()
    assert len(headline) == 4 and headline[2].startswith("| transformers | DPPO (keep 0.5) |")
    assert headline[2].endswith("| 2.00x (time 0.50 ± 0.01) | one after the other |")
    assert headline[3].startswith("| vLLM, colocated | DPPO (keep 0.5) | 2 |")
    assert headline[3].endswith("| 4.00x (time 0.25 ± 0.01) | one after the other |")
    data["bench_real_learning"]["projection_sources"] = dict(sources, phases_timing="in turns")
    assert render_docs.headline_table(data).splitlines()[2].endswith("| 2.00x (time 0.50 ± 0.01) | in turns |")


def test_inline_values_read_fields_ratios_and_ranges():
    results = {"bench_reasoning": {"results": [
        {"method": "grpo", "total_s": 180.0, "ratio": 1.0, "phase": {"generation": 0.45}, "tokens": 202845.0},
        {"method": "dppo", "total_s": 90.0, "ratio": 0.5049, "phase": {"generation": 0.89}, "tokens": 64511.5},
    ]}}
    text = ("<!-- generated: bench_reasoning dppo ratio inv.2f -->?<!-- end generated -->x, "
            "<!-- generated: bench_reasoning dppo ratio m1+.0% -->?<!-- end generated -->, "
            "<!-- generated: bench_reasoning grpo tokens k -->?<!-- end generated -->, "
            "<!-- generated: bench_reasoning dppo:grpo total_s .2f -->?<!-- end generated -->, "
            "<!-- generated: bench_reasoning * phase.generation .2f -->?<!-- end generated -->, "
            "<!-- generated: bench_reasoning - results.1.total_s/results.0.total_s .1f -->?<!-- end generated -->")
    values = re.findall(r"-->([^<]*)<!-- end", render_docs.render(text, results))
    assert values == ["1.98", "-50%", "203k", "0.50", "0.45-0.89", "0.5"]
    with pytest.raises(ValueError, match="no_such_method"):
        render_docs.render("<!-- generated: bench_reasoning no_such_method ratio .2f --><!-- end generated -->",
                           results)


def test_every_table_of_benchmarks_md_is_generated_but_the_two_unrecorded_ones():
    """A table typed by hand would not be checked: only the list of programs (its times are generated spans)
    and the `max_packed_tokens` sweep (no JSON was kept) may stand outside a generated block."""
    lines = render_docs.MARKER.sub("", (ROOT / "docs" / "benchmarks.md").read_text()).splitlines()
    headers = [line.split("|")[1].strip() for i, line in enumerate(lines)
               if line.startswith("|") and not (i and lines[i - 1].startswith("|"))]
    assert headers == ["program", "`max_packed_tokens`"]


def test_the_labels_state_dppoconfigs_defaults():
    from dppo_trl import DPPOConfig

    fields = DPPOConfig.__dataclass_fields__
    assert fields["prune_sampling"].default == render_docs.DEFAULT_DESIGN
    assert fields["completion_keep_rate"].default == render_docs.DEFAULT_KEEP_RATE
    assert fields["prompt_keep_rate"].default == render_docs.DEFAULT_PROMPT_KEEP_RATE


def test_the_docs_quote_the_demo_models_parameter_count():
    from dppo_trl.tasks.toy import build_tiny_model, build_tokenizer

    model = build_tiny_model(build_tokenizer(), hidden_size=128, num_layers=2)  # dppo_trl/demo.py's warm start
    count = f"{sum(p.numel() for p in model.parameters()):,}"
    for doc in DOCS:
        assert count in doc.read_text() and "0.5M" not in doc.read_text(), doc


def test_the_audit_verdict_says_whether_the_check_holds_and_by_how_many_standard_errors():
    check = {"audit_step_time_ratio": 0.366, "paired_step_time_ratio": 0.45, "paired_step_time_ratio_se": 0.12,
             "tolerance": 0.15, "within_tolerance": False}
    verdict = render_docs.audit_verdict({"bench_real_phases_dapo": {"audit_check": check}})
    assert verdict == ("outside the 15% the check asks for; the difference, -0.084, is 0.7 standard errors of the "
                       "paired ratio")
    older = dict(check, within_tolerance=True)
    del older["paired_step_time_ratio_se"]  # records from before the SE was kept
    assert render_docs.audit_verdict({"bench_real_phases_dapo": {"audit_check": older}}) == (
        "within the 15% the check asks for")


def test_the_reuse_verdict_says_which_row_won_and_whether_the_targets_hold():
    rows = [{"name": "dppo@mu2", "num_iterations": 2}, {"name": "grpo", "num_iterations": 1}]
    verdict = {"generation_share": 0.7, "dppo_best": "dppo@mu2", "dppo_best_time_ratio": 0.61,
               "dppo_best_time_ratio_se": 0.05, "grpo_best": "grpo", "dppo_best_over_grpo_best": 0.61,
               "target_vs_grpo": 0.42, "target_vs_grpo_best": 0.75, "met": False}
    text = render_docs.reuse_verdict({"bench_reuse": {"results": rows, "verdict": verdict}})
    assert text == ("at 70% generation the fastest DPPO row with a non-inferior held-out score is DPPO at "
                    "`num_iterations` 2: 0.61 ± 0.05 of GRPO's time at `num_iterations` 1 (the target: 0.42 or less), "
                    "0.61 of GRPO's fastest row, GRPO at `num_iterations` 1 (the target: 0.75 or less); the targets "
                    "are not met, and the fastest DPPO row is the one with reuse")
    assert render_docs.reuse_verdict({"bench_reuse": {"results": rows, "verdict": None}}).startswith("no verdict")
