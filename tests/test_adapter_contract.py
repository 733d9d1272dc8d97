"""Each adapter's copies of its TRL trainer's formulas, held against TRL's own tensors on a batch TRL scored: a TRL
upgrade that changes one fails the test named for it."""

import pytest
from support.configs import cpu_config
from trl import GRPOConfig, GRPOTrainer

from dppo_trl.adapters.grpo import GRPORewards


def completion_reward(prompts, completions, **kwargs):
    """Spread within the group of about half the prompts, none in the others."""
    return [float(sum(map(ord, c)) % 7) if code(p) % 2 else 1.0 for p, c in zip(prompts, completions)]


def prompt_reward(prompts, **kwargs):
    """The same for every completion of a prompt, and None for about one prompt in three (unscorable)."""
    return [None if code(p) % 3 == 0 else float(code(p) % 5) for p in prompts]


def code(text: str) -> int:
    return sum(map(ord, text))


class ScoredGRPO(GRPOTrainer):
    """GRPOTrainer keeping each generation batch's rewards per function and advantages, as TRL computed them."""

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.__dict__.setdefault("rewards_per_func", []).append(rewards.clone())
        return rewards

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.__dict__.setdefault("advantages", []).append(out["advantages"].clone())
        return out


@pytest.mark.parametrize("aggregation, weights, kinds", [
    ("sum_then_normalize", [1.0, 0.5], {True, False}),
    ("normalize_then_sum", [1.0, 0.5], {True, False}),
    ("normalize_then_sum", [0.0, 1.0], {True}),  # the function with spread weighs nothing: every A is 0
])
def test_grpo_rewards_aggregate_and_zero_advantage_rows_are_trls(tmp_path, tiny_model_dir, train_dataset, aggregation,
                                                                 weights, kinds):
    args = cpu_config(tmp_path, GRPOConfig, max_steps=2, per_device_train_batch_size=16,
                      multi_objective_aggregation=aggregation, reward_weights=weights)
    trainer = ScoredGRPO(tiny_model_dir, [completion_reward, prompt_reward], args=args, train_dataset=train_dataset)
    trainer.train()
    rewards = GRPORewards(trainer.reward_weights, trainer.num_generations, trainer.multi_objective_aggregation)
    logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(trainer.advantages) == len(logged) == 2
    seen = set()
    for per_func, advantages, reward in zip(trainer.rewards_per_func, trainer.advantages, logged):
        # TRL's logged "reward": the mean over the batch of its weighted sums, NaN rows skipped
        assert rewards.aggregate(per_func).nanmean().item() == pytest.approx(reward, rel=1e-6)
        zero = rewards.zero_advantage_rows(per_func)
        seen |= set(zero.tolist())
        # exactly 0 in exact arithmetic (float32 leaves at most 1e-4 there); clear of 0 elsewhere
        assert (advantages[zero].abs() <= 1e-4).all() and (advantages[~zero].abs() > 1e-3).all()
    assert seen == kinds
