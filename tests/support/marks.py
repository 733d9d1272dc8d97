"""Marks shared by the test files. ``make test-fast`` leaves out the tests marked ``slow``, ``subprocess`` or
``real_model`` (pyproject.toml registers them). Besides the tests that take over about 10 s each, a parametrized
family whose cases together take long runs in the fast lane through representatives only (``slow_unless``)."""

import pytest

# The loss types whose cases of a long family stay in the fast lane: TRL's default (dapo), the per-sequence mean
# (grpo) and the per-micro-batch token count (bnpo); the other loss types are in `make test`.
FAST_LOSS_TYPES = ("grpo", "bnpo", "dapo")


def slow_unless(fast, *values):
    """``pytest.param(*values)``, marked ``slow`` unless ``fast`` (its test id is the one of the plain values)."""
    return pytest.param(*values, marks=() if fast else pytest.mark.slow)
