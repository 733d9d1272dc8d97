"""DPPO's state in a checkpoint: one file (``dppo_state.json``) with each stateful part's ``state_dict``, and the
two files of checkpoints written before it (recorded from that code in tests/golden/old_checkpoint/) resume the
same run to the same parameters."""

import json
import math
import shutil

import pytest
import torch
from support import golden

from dppo_trl.host.checkpoint import STATE_FILE, load_dppo_state

pytestmark = pytest.mark.slow

AUDIT_TIME_RECORDS = ("train_time_ratio", "step_time_ratio", "generation_share", "timed_token_fraction")
SPEED_CHECK_RECORDS = ("speed_check_at",)
OLD_FILES = {"prompt_pruning": "dppo_prompt_sampler.json", "audit": "dppo_audit.pt"}


def assert_same_state(old, new, where="state"):
    """Equal structure and values; floats to 1e-6 relative. The old files carry the audit statistics of the code
    that recorded them, which stored the deferred old-policy log-probs in float32 (since issue 41 they keep the
    model's float64: the cosines moved by 6e-9), on a machine whose kernels round in a different order."""
    assert type(old) is type(new), where
    if isinstance(new, dict):
        assert list(old) == list(new), where
        for key in new:
            assert_same_state(old[key], new[key], f"{where}.{key}")
    elif isinstance(new, list):
        assert len(old) == len(new), where
        for i, (a, b) in enumerate(zip(old, new)):
            assert_same_state(a, b, f"{where}[{i}]")
    elif isinstance(new, float):
        assert math.isclose(old, new, rel_tol=1e-6, abs_tol=1e-12), (where, old, new)
    else:
        assert old == new, where


def resumed_parameters(kind, model_dir, output_dir, checkpoint):
    trainer = golden.checkpointed_trainer(kind, model_dir, output_dir)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


def test_a_checkpoint_of_the_retired_prompt_sampler_resumes_with_an_empty_history(tiny_model_dir, tmp_path,
                                                                                   caplog):
    """The two-file checkpoints held the fill mode's sampler (a history per dataset row): resuming from one warns
    and goes on with the cut and an empty history."""
    golden.checkpointed_trainer("prompt_pruning", str(tiny_model_dir), tmp_path / "run").train()
    old = tmp_path / "old-checkpoint-4"
    shutil.copytree(tmp_path / "run" / "checkpoint-4", old)
    (old / STATE_FILE).unlink()
    shutil.copy(golden.OLD_CHECKPOINT / OLD_FILES["prompt_pruning"], old / OLD_FILES["prompt_pruning"])
    with caplog.at_level("WARNING"):
        _, trainer = resumed_parameters("prompt_pruning", str(tiny_model_dir), tmp_path / "from-old", old)
    assert trainer.state.global_step == 8 and "empty history" in caplog.text


@pytest.mark.parametrize("kind", ["audit"])
def test_an_old_checkpoints_two_files_resume_as_the_one_file_does(kind, tiny_model_dir, tmp_path, exact_logprobs):
    golden.checkpointed_trainer(kind, str(tiny_model_dir), tmp_path / "run").train()
    new = tmp_path / "run" / "checkpoint-4"
    dppo_files = sorted(p.name for p in new.iterdir() if p.name.startswith("dppo"))
    assert dppo_files == [STATE_FILE]
    assert set(json.loads((new / STATE_FILE).read_text())) == {kind, "run"}

    old = tmp_path / "old-checkpoint-4"
    shutil.copytree(new, old)
    (old / STATE_FILE).unlink()
    shutil.copy(golden.OLD_CHECKPOINT / OLD_FILES[kind], old / OLD_FILES[kind])
    old_state, new_state = json.loads(json.dumps(load_dppo_state(str(old)))), load_dppo_state(str(new))
    if kind == "audit":  # the time ratios came after the old format, and a run's timings are its machine's
        new_records = new_state["audit"]["records"]
        assert all(isinstance(new_records.pop(name), list) for name in AUDIT_TIME_RECORDS)
        assert all(isinstance(new_records.pop(name), int) for name in SPEED_CHECK_RECORDS)
        assert new_records.pop("measuring_seconds") > 0
        new_state.pop("run")
    assert_same_state(old_state, new_state)

    from_new, trainer_new = resumed_parameters(kind, str(tiny_model_dir), tmp_path / "from-new", new)
    from_old, trainer_old = resumed_parameters(kind, str(tiny_model_dir), tmp_path / "from-old", old)
    assert trainer_new.state.global_step == trainer_old.state.global_step == 8
    for name, p in from_new.items():
        assert torch.equal(p, from_old[name]), name
    if kind == "audit":
        assert trainer_old.audit_ledger.records["audits"] == trainer_new.audit_ledger.records["audits"] > 0


def test_no_state_no_file(tmp_path):
    from dppo_trl.host.checkpoint import save_dppo_state

    save_dppo_state(str(tmp_path), {"prompt_pruning": None, "audit": None})
    assert not (tmp_path / STATE_FILE).exists() and load_dppo_state(str(tmp_path)) == {}
