"""docs/config.md is generated from ``DPPOConfig`` (its docstring, ``ALLOWED_VALUES``, ``UNUSED_SETTING_RULES``:
``python -m dppo_trl.config_reference --write``): the page must equal what the code gives, a docstring that drifts
from the fields must fail, each field's help stays short, and the number check of the validation is one function."""

import dataclasses
import math

import pytest

from dppo_trl import DPPOConfig
from dppo_trl import config as config_module
from dppo_trl import config_reference
from dppo_trl.config import ALLOWED_VALUES, UNUSED_SETTING_RULES, is_real_number


def test_docs_config_md_is_what_the_code_generates():
    assert config_reference.DOC.read_text() == config_reference.config_reference_markdown(), (
        "docs/config.md differs from DPPOConfig's reference: run `python -m dppo_trl.config_reference --write`"
    )


def test_check_fails_on_a_drifted_page_and_write_restores_it(tmp_path, capsys):
    page = tmp_path / "config.md"
    text = config_reference.config_reference_markdown()
    page.write_text(text.replace("| `keep_floor` | `0.05` |", "| `keep_floor` | `0.1` |"))
    assert config_reference.main(["--check", str(page)]) == 1
    assert config_reference.main(["--write", str(page)]) == 0
    assert page.read_text() == text and config_reference.main(["--check", str(page)]) == 0


def test_every_dppo_field_is_documented_once_in_its_group_with_its_default():
    intro, docs = config_reference.field_docs()
    assert [d.name for d in docs] == list(config_reference.dppo_fields())
    groups = {d.group for d in docs}
    assert {"completion pruning", "the gradient audit", "prompt pruning", "packing"} == groups
    page = config_reference.config_reference_markdown()
    for d in docs:
        assert page.count(f"| `{d.name}` |") == 1, d.name
    assert "GRPOConfig" in intro


def test_the_reference_reads_the_same_after_hfargumentparser_resolved_the_annotations():
    # HfArgumentParser (the CLI's TrlParser) replaces each field's string annotation by the type itself, in place.
    from transformers import HfArgumentParser

    HfArgumentParser(DPPOConfig)
    assert not isinstance(config_reference.dppo_fields()["completion_keep_rate"].type, str)
    assert config_reference.config_reference_markdown() == config_reference.DOC.read_text()


@pytest.mark.parametrize(
    "old,new",
    [
        ("defaults to `0.05`):", "defaults to `0.1`):"),  # a default the field does not have
        ("        keep_floor (`float`,", "        keep_floor (`int`,"),  # a type the field does not have
        ("        max_packed_tokens (`int`, *optional*):\n", "        max_packed_token (`int`, *optional*):\n"),
    ],
)
def test_a_docstring_that_drifts_from_the_fields_is_refused(old, new):
    doc = DPPOConfig.__doc__
    assert doc.count(old) == 1
    with pytest.raises(ValueError):
        config_reference.field_docs(doc.replace(old, new))


def test_the_docstring_parser_reads_groups_entries_and_descriptions():
    doc = """Intro.

    Parameters:
        > Parameters that control a thing

        alpha (`int`, *optional*, defaults to `1`):
            First line,
            second line.
        beta (`str`, *optional*):
            Beta.
    """
    intro, entries = config_reference.parse_parameters(doc)
    assert intro == "Intro."
    assert [(e.group, e.name, e.header, e.text) for e in entries] == [
        ("a thing", "alpha", "`int`, *optional*, defaults to `1`", "First line, second line."),
        ("a thing", "beta", "`str`, *optional*", "Beta."),
    ]
    with pytest.raises(ValueError, match="before any"):
        config_reference.parse_parameters("X.\n\nParameters:\n    alpha (`int`, *optional*):\n        A.\n")


def test_the_page_links_the_pages_it_points_to():
    page = config_reference.config_reference_markdown()
    for name in ("estimator.md", "packing.md", "prompt_pruning.md", "usage.md", "benchmarks.md"):
        assert f"[`{name}`]({name})" in page, name
        assert (config_reference.DOC.parent / name).is_file(), name
    assert "`docs/" not in page


def test_the_help_is_short_and_the_reference_says_more():
    # The help= of a field is what `dppo-trl --help` shows (which points to the docstring once); the docstring's
    # description, rendered into docs/config.md, is the full explanation: it says at least as much.
    _, docs = config_reference.field_docs()
    described = {d.name: d.text for d in docs}
    for name, f in config_reference.dppo_fields().items():
        help_text = f.metadata["help"]
        assert 0 < len(help_text.split()) <= 40, (name, len(help_text.split()))
        assert "docs/config.md" not in help_text, name
        assert len(described[name].split()) > len(help_text.split()), name


def test_every_validated_field_is_a_dppo_field_or_loss_type_and_every_warned_field_a_config_field():
    fields = set(config_reference.dppo_fields())
    assert set(ALLOWED_VALUES) == fields | {"loss_type"}
    config_fields = {f.name for f in dataclasses.fields(DPPOConfig)}
    for rule in UNUSED_SETTING_RULES:
        assert rule.field in config_fields and rule.when.__doc__, rule


def test_is_real_number_takes_nan_unless_finite_is_asked():
    for value in (0, 1.5, -3, float("nan"), math.inf):
        assert is_real_number(value)
    for value in (True, False, "1", None, [1]):
        assert not is_real_number(value)
    assert is_real_number(2.0, finite=True) and is_real_number(7, finite=True)
    for value in (float("nan"), math.inf, -math.inf, True):
        assert not is_real_number(value, finite=True)
    assert not hasattr(config_module, "_is_number")
