"""Behaviour unchanged: the golden runs (``support.golden``: every sampling design, prompt pruning, packing on and
off, GA < spg, beta 0 and > 0, the entropy filter and bonus, the audit; float64 end to end) reproduce the keep
masks and micro-batch plans exactly, and the weights, logged values and final parameters to float64 rounding
(every value of the runs is computed in float64, TRL's rewards included), as recorded (``support.golden``)."""

import math

import pytest
from support import golden

# Relative 1e-9: far above float64 rounding (1e-16, grown over a few steps), far below float32's (1e-7).
REL, ABS = 1e-9, 1e-12


def first_difference(actual, expected, path="") -> str | None:
    if isinstance(expected, dict) and isinstance(actual, dict):
        for key in sorted(set(expected) | set(actual)):
            if key not in actual or key not in expected:
                return f"{path}/{key}: only in {'the golden file' if key in expected else 'this run'}"
            found = first_difference(actual[key], expected[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(expected, list) and isinstance(actual, list):
        if len(actual) != len(expected):
            return f"{path}: {len(actual)} entries, the golden file has {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            found = first_difference(a, e, f"{path}[{i}]")
            if found:
                return found
        return None
    if isinstance(expected, float) or isinstance(actual, float):
        same = isinstance(actual, (int, float)) and math.isclose(actual, expected, rel_tol=REL, abs_tol=ABS)
    else:
        same = actual == expected
    return None if same else f"{path}: {actual!r} != golden {expected!r}"


@pytest.mark.parametrize("name", sorted(golden.RUNS))
def test_a_golden_run_reproduces_its_record(name, tiny_model_dir, tmp_path, exact_logprobs):
    expected = golden.load()[name]
    actual = golden.run(name, str(tiny_model_dir), tmp_path)
    assert first_difference(actual, expected) is None, first_difference(actual, expected)
