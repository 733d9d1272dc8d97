"""docs/config.md, generated: the DPPO fields from ``DPPOConfig``'s class docstring (each field's meaning, said once),
their defaults, what each accepts (``config.ALLOWED_VALUES``) and when a valid setting goes unused
(``config.UNUSED_SETTING_RULES``), inside the page's fixed prose (``_TEMPLATE``). Edit those, then:

    python -m dppo_trl.config_reference --write    # rewrite docs/config.md
    python -m dppo_trl.config_reference --check    # exit 1 when docs/config.md differs (tests/test_config_reference.py)
    python -m dppo_trl.config_reference            # print the page
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path

from trl import GRPOConfig

from .config import UNUSED_SETTING_RULES, DPPOConfig, allowed_values
from .core.estimator import SUPPORTED_LOSS_TYPES

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"

_GROUP = re.compile(r"    > Parameters that control (?P<group>.+)")
_ENTRY = re.compile(r"    (?P<name>\w+) \((?P<header>.+)\):")

_TEMPLATE = """\
# Configuration reference

{intro}

{tables}

## Refused at construction
Besides a value that its field does not allow (the tables above) and the combinations refused under `audit_every`
and `prompt_keep_rate`, in every configuration: a `loss_type` other than
{loss_types}
(`GRPOConfig` accepts a typo, which fails at the first loss).

## Valid settings that the configuration does not use
One warning, not an error, lists every rule below that applies: the setting warns when the condition holds.

| setting | warns when |
|---|---|
{unused}

## Pruning off, and what DPPO's training equals
With `completion_keep_rate=1.0` (and a design other than `"zero_variance"`), `prompt_keep_rate=1.0` and
`packing=False` the trainer is TRL's: every hook is `GRPOTrainer`'s own. What DPPO's path equals otherwise, with
every row kept and packing on, per `loss_type` and option: [`estimator.md`](estimator.md), section 6; the
positions of packed sequences on models with learned absolute positions: [`packing.md`](packing.md), "The plan",
item 3. The entropy bonus, the entropy filter and MoE models under DPPO: [`estimator.md`](estimator.md), "The
entropy bonus, the entropy filter and the MoE router loss".
"""


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """One entry of ``DPPOConfig``'s "Parameters:": its group (``"completion pruning"``), the field's name, what
    its parentheses say (`` `float`, *optional*, defaults to `0.5` ``) and its description, one paragraph."""

    group: str
    name: str
    header: str
    text: str


def parse_parameters(doc: str) -> tuple[str, list[FieldDoc]]:
    """The text before ``Parameters:`` of a TRL-style config docstring, and its entries in order."""
    lines = inspect.cleandoc(doc).splitlines()
    if "Parameters:" not in lines:
        raise ValueError("the docstring has no 'Parameters:' section")
    start = lines.index("Parameters:")
    intro = "\n".join(lines[:start]).strip()
    entries: list[dict] = []
    group = None
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if not line.strip():
            continue
        if m := _GROUP.fullmatch(line):
            group = m["group"]
        elif m := _ENTRY.fullmatch(line):
            if group is None:
                raise ValueError(f"docstring line {number}: {m['name']} comes before any '> Parameters that control'")
            entries.append(dict(group=group, name=m["name"], header=m["header"], text=[]))
        elif line.startswith(" " * 8) and entries:
            entries[-1]["text"].append(line.strip())
        else:
            raise ValueError(f"docstring line {number} is neither a group, an entry nor a description: {line!r}")
    return intro, [FieldDoc(**{**e, "text": " ".join(e["text"])}) for e in entries]


def _literal(value) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def annotation_text(annotation) -> str:
    """A field's annotation as source text. ``field.type`` is the string the module wrote (``from __future__ import
    annotations``) until ``HfArgumentParser`` resolves it in place to the type itself (``float``, ``float | None``)."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def expected_header(f: dataclasses.Field) -> str:
    """What a field's docstring parentheses must say, from its annotation and default (TRL's convention: no
    default named when it is None)."""
    kind = annotation_text(f.type).replace(" | None", "")
    return f"`{kind}`, *optional*" + ("" if f.default is None else f", defaults to `{_literal(f.default)}`")


def dppo_fields() -> dict[str, dataclasses.Field]:
    grpo = {f.name for f in dataclasses.fields(GRPOConfig)}
    return {f.name: f for f in dataclasses.fields(DPPOConfig) if f.name not in grpo}


def field_docs(doc: str | None = None) -> tuple[str, list[FieldDoc]]:
    """``DPPOConfig``'s docstring (or ``doc``) parsed, after checking that it documents every DPPO field once, in
    the fields' order, each header agreeing with the field's type and default."""
    intro, docs = parse_parameters(DPPOConfig.__doc__ if doc is None else doc)
    fields = dppo_fields()
    names = [d.name for d in docs]
    if names != list(fields):
        raise ValueError(f"the docstring documents {names}, the DPPO fields are {list(fields)} (in this order)")
    for d in docs:
        if d.header != expected_header(fields[d.name]):
            expected = expected_header(fields[d.name])
            raise ValueError(f"{d.name}: the docstring says ({d.header}), the field is ({expected})")
        if not d.text:
            raise ValueError(f"{d.name}: no description in the docstring")
    return intro, docs


def _markdown(text: str) -> str:
    """A docstring fragment as docs/config.md's text: `docs/X.md` becomes a link to X.md (a sibling page)."""
    return re.sub(r"`docs/([\w.]+\.md)`", r"[`\1`](\1)", text)


def _cell(text: str) -> str:
    return _markdown(text).replace("|", "\\|")


def _tables(docs: list[FieldDoc]) -> str:
    fields = dppo_fields()
    parts = []
    for group in dict.fromkeys(d.group for d in docs):
        rows = [
            f"| `{d.name}` | `{_literal(fields[d.name].default)}` | {_cell(allowed_values(d.name))} | {_cell(d.text)} |"
            for d in docs
            if d.group == group
        ]
        parts.append(f"## {group[0].upper()}{group[1:]}\n| field | default | allowed | meaning |\n|---|---|---|---|\n"
                     + "\n".join(rows))
    return "\n\n".join(parts)


def _unused_rows() -> str:
    fields = {f.name: f for f in dataclasses.fields(DPPOConfig)}  # TRL's fields too (top_entropy_quantile)
    rows = []
    for rule in UNUSED_SETTING_RULES:
        if rule.when.__doc__ is None:
            raise ValueError(f"{rule.when.__name__}, a condition of UNUSED_SETTING_RULES, has no docstring")
        default = fields[rule.field].default
        setting = f"`{rule.field}`" + (" at any value" if rule.any_value else f" other than `{_literal(default)}`")
        rows.append(f"| {setting} | {_cell(' '.join(rule.when.__doc__.split()))} |")
    return "\n".join(rows)


def config_reference_markdown() -> str:
    """docs/config.md's text."""
    intro, docs = field_docs()
    return _TEMPLATE.format(
        intro=_markdown(intro),
        tables=_tables(docs),
        loss_types=", ".join(f"`{name}`" for name in SUPPORTED_LOSS_TYPES),
        unused=_unused_rows(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dppo_trl.config_reference", description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the page")
    action.add_argument("--check", action="store_true", help="exit 1 when the page differs from the generated text")
    parser.add_argument("path", nargs="?", type=Path, default=DOC, help=f"the page (default: {DOC})")
    args = parser.parse_args(argv)
    text = config_reference_markdown()
    if args.write:
        args.path.write_text(text)
    elif args.check:
        if not args.path.is_file() or args.path.read_text() != text:
            print(f"{args.path} differs from DPPOConfig's reference: run `python -m dppo_trl.config_reference --write`")
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
