"""Behaviour unchanged, bit for bit: the golden runs (``support.golden``: every sampling design, prompt pruning,
packing on and off, GA < spg, beta 0 and > 0, the entropy filter and bonus, the audit) reproduce the keep masks,
weights, micro-batch plans, logged values and final parameters recorded from the code before issue 29."""

import pytest
from support import golden



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
    return None if actual == expected else f"{path}: {actual!r} != golden {expected!r}"


@pytest.mark.parametrize("name", sorted(golden.RUNS))
def test_a_golden_run_reproduces_its_record_bit_for_bit(name, tiny_model_dir, tmp_path):
    expected = golden.load()[name]
    actual = golden.run(name, str(tiny_model_dir), tmp_path)
    assert first_difference(actual, expected) is None, first_difference(actual, expected)
