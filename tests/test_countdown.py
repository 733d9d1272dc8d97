"""The reasoning-shaped task of `make bench-reasoning`: its chains, its length distribution, its split."""

import statistics

from dppo_trl.tasks.countdown import (
    countdown,
    countdown_reward,
    countdown_splits,
    max_completion_tokens,
    warm_start_starts,
)


def test_the_chain_counts_down_by_seven_to_the_remainder():
    assert countdown(58) == "58,51,44,37,30,23,16,9,2#2"
    assert countdown(5) == "5#5" and countdown(7) == "7,0#0"
    assert countdown(300).endswith(f"#{300 % 7}") and countdown(300).count(",") == 300 // 7
    assert countdown_reward([" 5#5", "5#4", "12,5#5"], answer=["5#5", "5#5", "12,5#5"]) == [1.0, 0.0, 1.0]


def test_completion_lengths_are_long_tailed_and_the_split_is_disjoint():
    train, heldout = countdown_splits(train_size=512, seed=0)
    lengths = [len(countdown(s)) + 1 for s in train]  # characters = tokens, plus eos
    assert max(lengths) >= 10 * min(lengths) and statistics.median(lengths) < max(lengths) / 4
    assert max(lengths) <= max_completion_tokens()
    assert not set(train) & set(heldout) and len(heldout) >= 80
    assert countdown_splits(train_size=512, seed=0) == (train, heldout)  # seeded
    # the warm start's draws follow the same 1/start law, over every start
    draws = warm_start_starts(size=4096)
    assert statistics.median(draws) < 80 and set(heldout) & set(draws)
