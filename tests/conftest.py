import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from dppo_trl.tasks.toy import addition_dataset, addition_pairs, exact_answer_reward, save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), hidden_size=32, num_layers=2)


@pytest.fixture(scope="session")
def train_dataset():
    train, _ = addition_pairs(seed=0)
    return addition_dataset(train[:64])


def coarse_reward(completions, **kwargs):
    """A reward that is often equal inside a small group (so some groups have zero advantage variance)."""
    return [float(len(c) > 3) for c in completions]


def random_reward(completions, **kwargs):
    """A reward with spread (so advantages are non-zero) that depends only on the completion text."""
    return [float((sum(map(ord, c)) * 7919) % 5) for c in completions]


def cpu_config(tmp_path, cls=None, **overrides):
    from dppo_trl import DPPOConfig

    cls = cls or DPPOConfig
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        bf16=False,
        use_cpu=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        learning_rate=1e-3,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        max_steps=2,
        seed=0,
        temperature=1.0,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


REWARDS = [random_reward, exact_answer_reward]


def leave_without_destructors() -> None:
    """End a torchrun worker without running destructors: freeing DDP's reducer frees its gloo process group,
    whose destructor joins gloo's worker thread while holding the GIL, and that thread may still need the GIL to
    free the last gather's tensors. Depending on when that happens, a finished rank hangs or aborts at exit (a
    torch race: pytorch/pytorch#56297, #179291)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class StopAt(TrainerCallback):
    """Saves a checkpoint at ``step`` and stops there: the first half of a kill-and-resume test."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


class Float64LogProbs:
    """Stand-in for TRL's fused log-prob kernel (which accumulates in float32): the same per-token log-probs and
    entropies of ``hidden @ weight.T``, in the inputs' dtype, through plain autograd."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcapping, logit_scale, outputs):
        logits = hidden @ weight.T + (0 if bias is None else bias)
        logits = logits * logit_scale
        if softcapping is not None:
            logits = softcapping * torch.tanh(logits / softcapping)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy, None, None, None


def rms_norm_in_input_dtype(self, hidden_states):
    """Qwen2's RMSNorm without its float32 round trip (which would also round the backward pass to float32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def exact_logprobs(monkeypatch):
    """Every forward and backward of the test in float64: TRL's fused log-prob kernel (``Float64LogProbs``) and
    the model's RMSNorm (``rms_norm_in_input_dtype``) are the two places that compute in float32."""
    import trl.trainer.utils
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", Float64LogProbs)
    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_in_input_dtype)
