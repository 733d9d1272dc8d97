"""Build a trainer on a tiny model, train it, and read what it ended with."""

from transformers import TrainerCallback

from dppo_trl import DPPOConfig

from .configs import cpu_config
from .recording import OptimizerGradients
from .rewards import random_reward


def build(cls, tmp_path, model_dir, dataset, reward=random_reward, config_cls=DPPOConfig, callbacks=None,
          peft_config=None, args=None, **overrides):
    """``cls`` (a trainer class) on ``model_dir`` and ``dataset``, configured by ``args`` if given (another
    preset of ``support.configs``), else by ``cpu_config(tmp_path, config_cls, **overrides)``; not trained yet."""
    if args is None:
        args = cpu_config(tmp_path, cls=config_cls, **overrides)
    elif overrides:
        raise TypeError(f"overrides {sorted(overrides)} next to a built config")
    return cls(model_dir, reward, args=args, train_dataset=dataset, callbacks=callbacks, peft_config=peft_config)


def train(cls, tmp_path, model_dir, dataset, **kwargs):
    """``build(cls, ...)``, trained; returns the trainer."""
    trainer = build(cls, tmp_path, model_dir, dataset, **kwargs)
    trainer.train()
    return trainer


def train_with_gradients(cls, tmp_path, model_dir, dataset, missing_as_zeros=True, **kwargs):
    """``train`` without gradient clipping (``max_grad_norm=0``: the optimizer receives the accumulated gradient
    itself); returns the trainer and the flat float64 gradient of its trainable parameters at each optimizer step
    (``OptimizerGradients.flat``)."""
    gradients = OptimizerGradients()
    trainer = build(cls, tmp_path, model_dir, dataset, callbacks=[gradients], max_grad_norm=0.0, **kwargs)
    gradients.model = trainer.model
    trainer.train()
    return trainer, gradients.flat(missing_as_zeros)


def params_of(trainer):
    """The trainer's model parameters, by name (detached copies)."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def losses_of(trainer):
    """The training loss of every logged step."""
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class StopAt(TrainerCallback):
    """Saves a checkpoint at ``step`` and stops there: the first half of a kill-and-resume test."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
