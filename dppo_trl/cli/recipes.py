"""The recipes shipped with the package: where they are, and their names (read by the parser and by the help)."""

from __future__ import annotations

from pathlib import Path


def recipes_dir() -> Path:
    """The recipes shipped with the package: ``dppo_trl/recipes`` in a wheel install, the repository's
    ``recipes/`` in an editable install (``pyproject.toml`` maps the one onto the other) or a bare checkout."""
    from importlib.resources import files

    try:
        return Path(str(files("dppo_trl.recipes")))
    except ModuleNotFoundError:  # a checkout on sys.path without any install
        return Path(__file__).resolve().parents[2] / "recipes"


def bundled_recipes() -> dict[str, Path]:
    """Recipe name (the file name without ``.yaml``) -> its path, for every shipped recipe."""
    return {path.stem: path for path in sorted(recipes_dir().glob("*.yaml"))}
