"""The package's layers (docs/layout.md): ``dppo_trl.core`` imports no TRL, transformers, accelerate or any other
part of the package; ``dppo_trl.components`` imports no TRL, transformers or accelerate and, of the package, only
``core`` and one another's plain data (``generation_batch``, ``view``); ``dppo_trl.host`` imports neither the
trainer nor the CLI; the import graph of the package's modules has no cycle."""

import ast
from pathlib import Path

import dppo_trl

ROOT = Path(dppo_trl.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def package_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py") if "recipes" not in p.parts}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def test_core_imports_nothing_of_trl_or_the_rest_of_the_package():
    for path in (ROOT / "core").glob("*.py"):
        for name in imports_of(path):
            top = name.split(".")[0]
            assert top not in ("trl", "transformers", "accelerate", "datasets", "peft"), (path.name, name)
            if name.startswith("dppo_trl."):
                assert name.startswith("dppo_trl.core"), (path.name, name)


def test_components_import_no_trl_and_no_other_component_but_its_plain_data():
    shared = ("dppo_trl.core", "dppo_trl.components.generation_batch", "dppo_trl.components.view")
    paths = sorted((ROOT / "components").glob("*.py"))
    assert len(paths) >= 4, "the components were not read"
    for path in paths:
        for name in imports_of(path):
            assert name.split(".")[0] not in ("trl", "transformers", "accelerate", "peft"), (path.name, name)
            if name.startswith("dppo_trl.") and name != "dppo_trl.components":
                assert name.startswith(shared), (path.name, name)


def test_the_host_imports_neither_the_trainer_nor_the_cli():
    paths = sorted((ROOT / "host").glob("*.py"))
    assert len(paths) >= 4, "the host was not read"
    for path in paths:
        for name in imports_of(path):
            assert not name.startswith(("dppo_trl.trainer", "dppo_trl.cli")), (path.name, name)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``graph`` (a list of nodes, the first repeated at the end), or None."""
    done, on_path = set(), []

    def visit(node):
        if node in on_path:
            return on_path[on_path.index(node):] + [node]
        if node in done:
            return None
        on_path.append(node)
        for child in sorted(graph.get(node, ())):
            cycle = visit(child)
            if cycle:
                return cycle
        on_path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_has_no_cycle():
    graph = package_graph()
    assert "dppo_trl.core.pruning" in graph["dppo_trl.config"], "the graph was not read"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
