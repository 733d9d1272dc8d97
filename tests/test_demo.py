"""`make demo` end to end, shortened: it builds, warm-starts, trains with DPPOTrainer and summarises."""

import pytest

from dppo_trl import demo


@pytest.mark.parametrize("extra", [[], ["--prompt-keep-rate", "0.5"]])
def test_demo_runs_and_summarises(tmp_path, capsys, extra):
    trainer = demo.main(["--steps", "4", "--sft-steps", "2", "--output-dir", str(tmp_path), *extra])
    out = capsys.readouterr().out
    assert trainer.state.global_step == 4
    assert "DPPO demo summary" in out and "kept fraction" in out
    kept = [h["dppo/kept_fraction"] for h in trainer.state.log_history if "dppo/kept_fraction" in h]
    assert kept and all(0.0 <= k <= 1.0 for k in kept)
    assert trainer.args.prompt_keep_rate == (0.5 if extra else 1.0)
