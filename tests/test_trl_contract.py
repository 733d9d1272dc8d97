"""The TRL contract: every attribute of ``GRPOTrainer`` that DPPO's trainer and hooks read or write exists on a
real ``GRPOTrainer`` with the expected type, every TRL hook DPPO overrides keeps the parameters DPPO's override
takes, and the TRL helpers DPPO imports exist. Re-run on every TRL upgrade; a new ``self.X`` in dppo_trl/trainer.py
or dppo_trl/host/ fails here until it is listed (TRL's, with its type) or defined by DPPO."""

import ast
import inspect
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from transformers import TrainerState
from trl import GRPOConfig, GRPOTrainer

import dppo_trl
from dppo_trl import DPPOTrainer

NUMBER = (int, float)
OPTIONAL_NUMBER = (int, float, type(None))

# TRL 1.16's GRPOTrainer (and HF Trainer) attributes DPPO reads or writes, with their types after a training step.
TRL_ATTRIBUTES = {
    "args": GRPOConfig,
    "accelerator": Accelerator,
    "model": torch.nn.Module,
    "ref_model": (torch.nn.Module, type(None)),
    "state": TrainerState,
    "train_dataset": object,
    "beta": NUMBER,
    "loss_type": str,
    "num_generations": int,
    "num_iterations": int,
    "max_completion_length": int,
    "reward_weights": torch.Tensor,
    "multi_objective_aggregation": str,
    "epsilon_low": NUMBER,
    "epsilon_high": NUMBER,
    "importance_sampling_level": str,
    "top_entropy_quantile": NUMBER,
    "use_adaptive_entropy": bool,
    "entropy_coef": NUMBER,
    "_entropy_bonus_enabled": bool,
    "_entropy_window_stats": (torch.Tensor, type(None)),
    "_last_world_entropy": NUMBER,
    "aux_loss_enabled": bool,
    "router_aux_loss_coef": NUMBER,
    "vllm_importance_sampling_mode": str,
    "vllm_importance_sampling_clip_min": OPTIONAL_NUMBER,
    "vllm_importance_sampling_clip_max": OPTIONAL_NUMBER,
    "shuffle_dataset": bool,
    "_metrics": dict,
    "_step": int,
    "_buffered_inputs": (list, type(None)),
    "_tokenizer": object,
    "current_gradient_accumulation_steps": int,
    "is_deepspeed_enabled": bool,
    "is_fsdp_enabled": bool,
    "callback_handler": object,
    "lr_scheduler": torch.optim.lr_scheduler.LRScheduler,
    "_pending_extra_logs": dict,
    "_pending_metrics": dict,
    "_logs": dict,
    "eos_token_ids": list,
}
# TRL methods DPPO calls (not overrides).
TRL_METHODS = ("compute_loss", "compute_loss_context_manager", "get_gamma_weights", "_get_output_dir", "add_callback",
               "_generate", "is_world_process_zero")
# TRL hooks DPPO overrides, and the parameters of DPPO's override (TRL's must be the same, in order).
OVERRIDDEN_HOOKS = (
    "_generate_and_score_completions",
    "_prepare_inputs",
    "_compute_loss",
    "_get_per_token_logps_and_entropies",
    "_calculate_rewards",
    "get_high_entropy_mask",
    "_generate_single_turn",
    "_save_checkpoint",
    "_load_optimizer_and_scheduler",
    "train",
    "log",
    "save_model",
    "create_model_card",
)
# Attributes DPPO itself sets on the trainer outside its class bodies (the rest are defined there).
DPPO_INSTANCE_ATTRIBUTES = {"__dict__", "_run_clock", "_run_started", "_summary",
                            "view", "reward_form", "keep_decision", "prefix_sharing",
                            "weighted_metrics", "placement", "prompt_cutter",
                            "weighted_loss", "audit_ledger"}


def dppo_classes() -> list[ast.ClassDef]:
    """The class bodies of DPPOTrainer and its mixins, parsed from the package's source."""
    names = {cls.__name__ for cls in DPPOTrainer.__mro__ if cls.__module__.startswith("dppo_trl")}
    root = Path(dppo_trl.__file__).parent
    found = []
    for path in [root / "trainer.py", *sorted((root / "host").glob("*.py"))]:
        found += [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef) and n.name in names]
    assert {c.name for c in found} == names
    return found


def attributes_used(classes) -> set[str]:
    """``self.X`` in the trainer's classes, and ``self._trainer.X`` in the host's view of it (``host/view.py``)."""
    used = {
        node.attr
        for cls in classes
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    }
    view = ast.parse((Path(dppo_trl.__file__).parent / "host" / "view.py").read_text())
    return used | {
        node.attr
        for node in ast.walk(view)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "_trainer"
    }


def attributes_defined(classes) -> set[str]:
    defined = set()
    for cls in classes:
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.add(item.name)
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                defined.add(item.target.id)
            elif isinstance(item, ast.Assign):
                defined |= {t.id for t in item.targets if isinstance(t, ast.Name)}
    return defined


@pytest.fixture(scope="module")
def grpo_trainer(tiny_model_dir, train_dataset, tmp_path_factory):
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("contract")), use_cpu=True, bf16=False, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, report_to=[], max_steps=1,
    )
    trainer = GRPOTrainer(str(tiny_model_dir), lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=train_dataset)
    trainer.train()  # some attributes (current_gradient_accumulation_steps, lr_scheduler) exist from training on
    return trainer


def test_every_attribute_dppo_uses_is_listed_as_trls_or_defined_by_dppo():
    classes = dppo_classes()
    unlisted = attributes_used(classes) - attributes_defined(classes) - DPPO_INSTANCE_ATTRIBUTES
    unlisted -= set(TRL_ATTRIBUTES) | set(TRL_METHODS)
    assert not unlisted, f"self.X used by DPPO but neither TRL's (listed here) nor DPPO's: {sorted(unlisted)}"


def test_dppo_defines_none_of_trls_attributes_by_accident():
    clash = attributes_defined(dppo_classes()) & (set(TRL_ATTRIBUTES) | set(TRL_METHODS))
    assert not clash, f"DPPO's classes define TRL's names: {sorted(clash)}"


@pytest.mark.parametrize("name", sorted(TRL_ATTRIBUTES))
def test_each_trl_attribute_exists_on_grpo_trainer_with_its_type(grpo_trainer, name):
    assert name in dir(grpo_trainer) or hasattr(grpo_trainer, name), f"GRPOTrainer has no {name!r}"
    value = getattr(grpo_trainer, name)
    assert isinstance(value, TRL_ATTRIBUTES[name]), f"{name}: {type(value).__name__}"


def test_the_trl_methods_dppo_calls_exist(grpo_trainer):
    for name in TRL_METHODS:
        assert callable(getattr(grpo_trainer, name, None)), name


@pytest.mark.parametrize("name", OVERRIDDEN_HOOKS)
def test_each_overridden_hook_keeps_trls_parameters(name):
    trl_hook = getattr(GRPOTrainer, name)
    dppo_hook = getattr(DPPOTrainer, name)
    assert dppo_hook is not trl_hook, f"DPPOTrainer no longer overrides {name}"

    def named(fn):
        return [p.name for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL,
                                                                                              p.VAR_KEYWORD)]

    dppo, trl = named(dppo_hook), named(trl_hook)
    assert trl[: len(dppo)] == dppo, f"{name}: TRL takes {trl}, DPPO's override {dppo}"


def test_the_trl_helpers_dppo_imports_exist():
    from trl.extras.profiling import profiling_decorator
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict, use_adapter

    for helper in (profiling_decorator, disable_gradient_checkpointing, shuffle_sequence_dict, split_tensor_dict,
                   use_adapter):
        assert callable(helper)
    assert "batch_size" in inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters


def test_dppos_own_passes_report_to_trls_profiler(tiny_model_dir, train_dataset, tmp_path, monkeypatch):
    """TRL's profiler around the keep decision, the rank balance, the deferred log-prob passes, the packed
    forward and the micro-batch plan: TRL's profiler sees each (it logs them to wandb, mlflow or trackio)."""
    import contextlib

    import trl.extras.profiling

    from dppo_trl import DPPOConfig

    seen = []

    @contextlib.contextmanager
    def recording_context(trainer, name):
        seen.append(name)
        yield

    monkeypatch.setattr(trl.extras.profiling, "profiling_context", recording_context)
    args = DPPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=4, report_to=[], max_steps=2, steps_per_generation=2, completion_keep_rate=0.5,
        packing=True, num_iterations=2,
    )
    trainer = DPPOTrainer(str(tiny_model_dir), lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=train_dataset)
    trainer.train()
    passes = {"keep_decision", "rank_balance", "_run_deferred_logps", "_packed_logps_and_entropies",
              "microbatch_plan"}
    assert passes <= set(seen), sorted(passes - set(seen))
