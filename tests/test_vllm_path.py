"""The vLLM importance-sampling path without vLLM: TRL's own generation, reported with sampler log-probs that
differ from the trainer's (as vLLM's do), so TRL runs its IS correction. DPPO defers the old-policy pass and
must rebuild exactly TRL's IS ratio and `sampling/*` metrics on the kept rows."""

import pytest
import torch
from support.configs import float64_settings, simulated_vllm_config
from support.recording import count_logprob_rows, recording
from support.rewards import constant_reward
from support.sampler import SAMPLING_KEYS, SimulatedVLLM
from support.training import build, losses_of, params_of, train
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer

# What each training generation batch says of its importance sampling.
IS_KEYS = ("importance_sampling_ratio", "old_per_token_logps", "dppo_keep")
SimGRPO = recording(GRPOTrainer, SimulatedVLLM, batch_keys=IS_KEYS)
SimDPPO = recording(DPPOTrainer, SimulatedVLLM, batch_keys=IS_KEYS)


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_truncate", "sequence_mask", "token_mask"])
def test_every_row_kept_reproduces_trls_importance_sampling(tmp_path, tiny_model_dir, train_dataset, exact_logprobs,
                                                            mode):
    """In float64: the parameters after AdamW steps, compared in float32, moved by up to 0.12 of the tolerance."""
    results = {}
    for name, cls, cfg, extra in [
        ("grpo", SimGRPO, GRPOConfig, {}),
        ("dppo", SimDPPO, DPPOConfig, {"completion_keep_rate": 0.5, "keep_floor": 1.0, "packing": False}),
    ]:
        args = simulated_vllm_config(tmp_path / name, mode, cls=cfg, max_steps=3, **extra, **float64_settings())
        results[name] = train(cls, tmp_path, tiny_model_dir, train_dataset, args=args)
    grpo, dppo = results["grpo"], results["dppo"]
    for g, d in zip(grpo.records, dppo.records):
        torch.testing.assert_close(d["importance_sampling_ratio"], g["importance_sampling_ratio"], rtol=1e-5, atol=1e-6)
    assert losses_of(dppo) == pytest.approx(losses_of(grpo), rel=1e-4, abs=1e-6)
    for key in SAMPLING_KEYS:
        got = [h[key] for h in dppo.state.log_history if key in h]
        want = [h[key] for h in grpo.state.log_history if key in h]
        assert got and got == pytest.approx(want, rel=1e-5, abs=1e-6), key
    for name, p in params_of(grpo).items():
        torch.testing.assert_close(params_of(dppo)[name], p, rtol=1e-4, atol=1e-6)


def test_pruned_old_policy_pass_skips_pruned_rows_and_keeps_trls_ratio(tmp_path, tiny_model_dir, train_dataset):
    results = {}
    for name, cls, cfg, extra in [
        ("grpo", SimGRPO, GRPOConfig, {}),
        ("dppo", SimDPPO, DPPOConfig, {"completion_keep_rate": 0.5, "speed_check": False}),  # rows counted
    ]:
        args = simulated_vllm_config(tmp_path / name, "token_truncate", cls=cfg, max_steps=2, **extra)
        trainer = build(cls, tmp_path, tiny_model_dir, train_dataset, args=args)
        counter = count_logprob_rows(trainer)
        trainer.train()
        results[name] = (trainer, counter["rows"])
    grpo, dppo = results["grpo"][0], results["dppo"][0]
    # The first generation batch is the same in both runs: on the kept rows, the same old log-probs and ratio.
    keep = dppo.records[0]["dppo_keep"]
    assert 0 < int(keep.sum()) < keep.numel()
    for key in ("old_per_token_logps", "importance_sampling_ratio"):
        torch.testing.assert_close(dppo.records[0][key][keep], grpo.records[0][key][keep], rtol=1e-5, atol=1e-6)
    kept = sum(int(r["dppo_keep"].sum()) for r in dppo.records)
    assert results["grpo"][1] == 16 * 3 * len(grpo.records)  # old + ref + loss, every row
    assert results["dppo"][1] == kept * 3  # old + ref + loss, kept rows only


def test_a_batch_that_keeps_nothing_logs_no_sampling_metrics(tmp_path, tiny_model_dir, train_dataset):
    """Equal rewards in every group: DPPO keeps no completion and has no IS ratio to estimate, so its log leaves
    the `sampling/*` keys out (a 0 would read as every ratio masked); GRPO logs them as always."""
    logs = {}
    for name, cls, cfg in [("grpo", SimGRPO, GRPOConfig), ("dppo", SimDPPO, DPPOConfig)]:
        # beta > 0 would keep them (KL)
        args = simulated_vllm_config(tmp_path / name, "token_truncate", cls=cfg, max_steps=1, beta=0.0)
        trainer = train(cls, tmp_path, tiny_model_dir, train_dataset, reward=constant_reward, args=args)
        logs[name] = next(h for h in trainer.state.log_history if "loss" in h)
    assert logs["dppo"]["dppo/kept_fraction"] == 0
    assert not any(key in logs["dppo"] for key in SAMPLING_KEYS)
    assert all(key in logs["grpo"] for key in SAMPLING_KEYS)


def test_kept_rows_without_a_scored_token_log_no_logp_difference(tmp_path, tiny_model_dir, train_dataset):
    """Every completion truncated and masked (`mask_truncated_completions`), every row kept: a sequence-level IS
    ratio still has a mean over the rows, the log-prob difference has no token to average. Its entry is left out
    (a None there would crash TRL's log), the ratio's is logged."""
    args = simulated_vllm_config(tmp_path, "sequence_truncate", max_steps=1, completion_keep_rate=1.0,
                                 max_completion_length=2, mask_truncated_completions=True)
    trainer = train(SimDPPO, tmp_path, tiny_model_dir, train_dataset, args=args)
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["completions/clipped_ratio"] == 1.0
    assert "sampling/importance_sampling_ratio/mean" in log
    assert "sampling/sampling_logp_difference/mean" not in log
