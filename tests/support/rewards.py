"""Reward functions the tests share (each depends only on the completion text, so a run is deterministic).

Also named by dotted path in the CLI tests' YAML (``tests.support.rewards.random_reward``): nothing heavy is
imported here."""


def random_reward(completions, **kwargs):
    """A reward with spread (so advantages are non-zero) that depends only on the completion text."""
    return [float((sum(map(ord, c)) * 7919) % 5) for c in completions]


def coarse_reward(completions, **kwargs):
    """A reward that is often equal inside a small group (so some groups have zero advantage variance)."""
    return [float(len(c) > 3) for c in completions]


def constant_reward(completions, **kwargs):
    """The same reward for every completion: every group has zero spread, so DPPO keeps nothing."""
    return [1.0] * len(completions)
