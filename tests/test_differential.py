"""Drop-in, differentially: each GRPOTrainer setup of the table below is built twice from the same fields, once
with ``GRPOTrainer`` + ``GRPOConfig`` and once with ``DPPOTrainer`` + ``DPPOConfig`` with DPPO's own fields at their
defaults (completion pruning at 0.5 and packing on), and trained for two steps on a tiny offline model. Both runs
must have the same outcome: both train (finite losses, every trainable parameter changed), or both raise the same
exception type (at construction or in training)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable

import pytest
import torch
from support.configs import LOSS_TYPES, cpu_config
from support.marks import slow_unless
from support.models import lora_config
from support.rewards import random_reward
from support.sampler import SimulatedVLLM
from trl import GRPOConfig, GRPOTrainer

from dppo_trl import DPPOConfig, DPPOTrainer
from dppo_trl.tasks.toy import addition_pairs, build_tiny_model, build_tokenizer

# ---------------------------------------------------------------------------------------------- tiny offline models


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory):
    """The dense tiny model with a context long enough for the tool schema in the system prompt (about 800
    tokens), saved with the tokenizer of ``chat_tokenizer`` (the tool cases pass that one as ``processing_class``)."""
    from trl.chat_template_utils import qwen3_chat_template

    directory = str(tmp_path_factory.mktemp("tiny-chat"))
    tokenizer = build_tokenizer()
    tokenizer.chat_template = qwen3_chat_template
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=2)
    model.config.max_position_embeddings = 2048
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def chat_dataset():
    from datasets import Dataset

    pairs, _ = addition_pairs(seed=0)
    pairs = pairs[:32]
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs],
            "answer": [str(a + b) for a, b in pairs],
        }
    )


# ---------------------------------------------------------------------------------- tools, environments, rewards


def add_one(x: int) -> int:
    """Add one to an integer.

    Args:
        x: The integer.
    """
    return x + 1


class Counter:
    """An environment that owns its reward: the sum of what its tool was given."""

    def __init__(self):
        self.total = 0

    def reset(self, **kwargs):
        self.total = 0
        return None

    def add_one(self, x: int) -> int:
        """Add one to an integer.

        Args:
            x: The integer.
        """
        self.total += x + 1
        return x + 1

    def get_reward(self) -> float:
        return float(self.total % 5)


class PromptingCounter(Counter):
    """The same, owning the data as well: ``reset`` returns the prompt."""

    def reset(self, **kwargs):
        self.total = 0
        return "12+30="


def chat_reward(completions, **kwargs):
    """A reward with spread for conversational completions (message lists, tool calls and results included)."""
    return [float((sum(map(ord, json.dumps(c))) * 7919) % 5) for c in completions]


TOOL_CALL = '<tool_call>\n{{"name": "add_one", "arguments": {{"x": {x}}}}}\n</tool_call><|im_end|>'


class FakeToolCalls:
    """Fake generation for the tool setups: the random tiny model never writes a tool call, so the first turn of
    every even row is replaced by one (its argument differs by row); the turns after the tool result are the
    model's own samples. TRL's tool loop then runs for real: parsing, calling, the tool mask, the budget."""

    def _generate(self, prompts):
        self._fake_first_turn = True
        return super()._generate(prompts)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        if self._fake_first_turn:
            self._fake_first_turn = False
            for i in range(0, len(completion_ids), 2):
                text = TOOL_CALL.format(x=i)
                completion_ids[i] = self.processing_class(text, add_special_tokens=False)["input_ids"]
        return completion_ids, logprobs


def chat_tokenizer():
    """The toy tokenizer with TRL's Qwen3 chat template, passed as ``processing_class`` (fresh for each trainer: TRL
    sets its response template on it). Loaded from a directory with a Qwen2 ``config.json``, the same tokenizer
    comes back as a ``Qwen2Tokenizer`` that drops spaces and newlines, and the tool calls would not parse."""
    from trl.chat_template_utils import qwen3_chat_template

    tokenizer = build_tokenizer()
    tokenizer.chat_template = qwen3_chat_template
    return tokenizer


def logged(key, above=None):
    """A check that the setup was exercised: ``key`` is in the training logs (with a last value above ``above``)."""

    def check(logs):
        values = [h[key] for h in logs if key in h]
        if not values:
            return f"{key!r} never logged"
        if above is not None and not values[-1] > above:
            return f"{key}={values[-1]} (expected > {above})"
        return ""

    return check


# ----------------------------------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Case:
    """One GRPOTrainer setup. ``config``: GRPOConfig fields over the shared ones; ``model``: the fixture with the
    model directory; ``dataset``: 'plain' (the addition prompts), 'iterable' (the same, streamed), 'chat'
    (conversational), None (no train_dataset); ``reward``: the ``reward_funcs`` (None: not passed); ``kwargs``:
    builds the other trainer keywords (fresh for each trainer); ``mixin``: a class put before the trainer class;
    ``check``: given the log history, says what was not exercised ('' if all was); ``dppo_args``: the config class
    handed to DPPOTrainer (DPPO's own fields always at their defaults)."""

    config: dict = dataclasses.field(default_factory=dict)
    model: str = "tiny_model_dir"
    dataset: str | None = "plain"
    reward: Any = random_reward
    kwargs: Callable[[dict], dict] | None = None
    mixin: type | None = None
    check: Callable[[list], str] | None = None
    dppo_args: type = DPPOConfig


LOSS_TYPE_NEEDS = {"luspo": dict(importance_sampling_level="sequence")}  # the paper's setting (TRL warns otherwise)
TOOLS = dict(max_completion_length=160)  # a tool call (62 tokens), its result (about 50) and a reply

TOOL_CHAT = dict(config=TOOLS, model="chat_model_dir", dataset="chat", mixin=FakeToolCalls)
CALLS_TOOLS = logged("tools/call_frequency", above=0.0)

CASES = {
    **{f"loss_type_{lt}": Case(config=dict(loss_type=lt, **LOSS_TYPE_NEEDS.get(lt, {}))) for lt in LOSS_TYPES},
    "moe": Case(model="tiny_moe_dir", check=logged("aux_loss")),
    "lora": Case(kwargs=lambda data: dict(peft_config=lora_config())),
    "gspo_sequence_level": Case(config=dict(loss_type="grpo", importance_sampling_level="sequence")),
    "beta_positive": Case(config=dict(beta=0.05), check=logged("kl")),
    "entropy_coef": Case(config=dict(entropy_coef=0.01), check=logged("entropy_coef", above=0.0)),
    "adaptive_entropy": Case(  # a target above the tiny model's entropy (about 4.6 nats): the coefficient grows
        config=dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=10.0),
        check=logged("entropy_coef", above=0.01),
    ),
    "entropy_filter": Case(config=dict(top_entropy_quantile=0.5)),
    "tools": Case(
        **TOOL_CHAT,
        reward=chat_reward,
        kwargs=lambda data: dict(tools=[add_one], processing_class=chat_tokenizer()),
        check=CALLS_TOOLS,
    ),
    "environment_reward": Case(  # no reward_funcs: the environment's get_reward is the only reward
        **TOOL_CHAT,
        reward=None,
        kwargs=lambda data: dict(environment_factory=Counter, processing_class=chat_tokenizer()),
        check=CALLS_TOOLS,
    ),
    "environment_owns_data": Case(  # no reward_funcs and no train_dataset: reset() writes the prompt
        **{**TOOL_CHAT, "dataset": None},
        reward=None,
        kwargs=lambda data: dict(environment_factory=PromptingCounter, processing_class=chat_tokenizer()),
        check=CALLS_TOOLS,
    ),
    # Setups that GRPOTrainer refuses: DPPOTrainer must refuse them with the same exception type.
    "no_reward_source": Case(reward=None),
    "tools_without_a_tool_template": Case(  # the toy ChatML template renders no tool calls
        dataset="chat", reward=chat_reward, kwargs=lambda data: dict(tools=[add_one])
    ),
    "vllm_is_simulated": Case(
        mixin=SimulatedVLLM, check=logged("sampling/importance_sampling_ratio/mean")
    ),
    "eval_dataset": Case(
        config=dict(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=8),
        kwargs=lambda data: dict(eval_dataset=data["plain"].select(range(4))),
        check=lambda logs: "" if sum("eval_loss" in h for h in logs) == 2 else "not evaluated at each step",
    ),
    "iterable_dataset": Case(dataset="iterable"),
    "grpo_config_to_dppo": Case(config=dict(beta=0.05, loss_type="bnpo"), dppo_args=GRPOConfig),  # swap the class only
    "num_iterations_2": Case(config=dict(num_iterations=2)),
    "ga_below_spg": Case(config=dict(steps_per_generation=4, gradient_accumulation_steps=2)),
}

# Every case: two optimizer steps, each on a generation batch of 16 completions (4 prompts x 4).
SHARED = dict(max_steps=2, steps_per_generation=2, gradient_accumulation_steps=2)


# ------------------------------------------------------------------------------------------------------- outcomes


@dataclasses.dataclass
class Outcome:
    kind: str  # "trained", "raised", or "trained badly" (a non-finite loss or an unchanged parameter)
    error: type | None = None
    detail: str = ""

    @property
    def key(self):
        return (self.kind, self.error)

    def __str__(self):
        if self.kind == "raised":
            return f"raised {self.error.__name__} {self.detail}"
        return f"{self.kind} {self.detail}".strip()


def run_case(case: Case, trainer_cls, config_cls, workdir, model_dir, data) -> Outcome:
    cls = (
        type(f"{case.mixin.__name__}{trainer_cls.__name__}", (case.mixin, trainer_cls), {})
        if case.mixin
        else trainer_cls
    )
    try:
        args = cpu_config(workdir, cls=config_cls, **{**SHARED, **case.config})
        kwargs = case.kwargs(data) if case.kwargs else {}
        if case.reward is not None:  # omitted, not None, as a user with environment-owned rewards writes it
            kwargs["reward_funcs"] = case.reward
        trainer = cls(model_dir, args=args, train_dataset=data.get(case.dataset), **kwargs)
    except Exception as error:  # noqa: BLE001 - the outcome is what is compared
        return Outcome("raised", type(error), f"at construction: {str(error)[:300]}")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    try:
        trainer.train()
    except Exception as error:  # noqa: BLE001
        return Outcome("raised", type(error), f"in training: {str(error)[:300]}")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after = dict(trainer.model.named_parameters())
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n].detach())]
    problems = []
    if trainer.state.global_step != SHARED["max_steps"] or len(losses) != SHARED["max_steps"]:
        problems.append(f"{trainer.state.global_step} steps, {len(losses)} losses")
    if not all(math.isfinite(x) for x in losses):
        problems.append(f"losses {losses}")
    if not before:
        problems.append("no trainable parameter")
    if unchanged:
        problems.append(f"{len(unchanged)}/{len(before)} trainable parameters unchanged, e.g. {unchanged[:3]}")
    missing = case.check(trainer.state.log_history) if case.check else ""
    if missing:
        problems.append(f"not exercised: {missing}")
    if problems:
        return Outcome("trained badly", None, "; ".join(problems))
    kept = [h["dppo/kept_fraction"] for h in trainer.state.log_history if "dppo/kept_fraction" in h]
    kept = f", kept fractions {[round(x, 3) for x in kept]}" if kept else ""
    return Outcome("trained", None, f"losses {[round(x, 4) for x in losses]}, {len(before)} parameters changed{kept}")


SLOW_CASES = {"tools", "environment_reward", "environment_owns_data"}  # about 5 s each: `make test` only


@pytest.mark.parametrize("case_id", [slow_unless(case_id not in SLOW_CASES, case_id) for case_id in CASES])
def test_dppo_at_its_defaults_has_grpos_outcome(case_id, request, tmp_path, train_dataset, chat_dataset):
    case = CASES[case_id]
    model_dir = request.getfixturevalue(case.model)
    data = {"plain": train_dataset, "chat": chat_dataset}
    outcomes = {}
    for name, trainer_cls, config_cls in (("grpo", GRPOTrainer, GRPOConfig), ("dppo", DPPOTrainer, case.dppo_args)):
        if case.dataset == "iterable":  # a fresh stream for each trainer
            data["iterable"] = train_dataset.to_iterable_dataset()
        outcomes[name] = run_case(case, trainer_cls, config_cls, tmp_path / name, model_dir, data)
    grpo, dppo = outcomes["grpo"], outcomes["dppo"]
    print(f"\n[{case_id}] GRPO: {grpo}\n[{case_id}] DPPO: {dppo}")
    assert grpo.kind != "trained badly", f"the case itself does not train with GRPOTrainer: {grpo}"
    assert dppo.key == grpo.key, f"GRPOTrainer {grpo}\nDPPOTrainer {dppo}"


def test_the_table_has_every_loss_type_of_trl():
    import re

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    supported = help_text.split("Supported values are ")[1].split(". ")[0]
    assert set(re.findall(r"'(\w+)'", supported)) == set(LOSS_TYPES)
