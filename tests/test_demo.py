"""`make demo` end to end, shortened: it builds, warm-starts, trains with DPPOTrainer and summarises."""

from dppo_trl import demo


def test_demo_runs_and_summarises(tmp_path, capsys):
    trainer = demo.main(["--steps", "4", "--sft-steps", "2", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert trainer.state.global_step == 4
    assert "DPPO demo summary" in out and "kept fraction" in out
    kept = [h["dppo/kept_fraction"] for h in trainer.state.log_history if "dppo/kept_fraction" in h]
    assert kept and all(0.0 <= k <= 1.0 for k in kept)
