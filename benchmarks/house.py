"""How dppo-trl meets TRL ("the house"), measured from outside, to compare before and after a refactor of
``dppo_trl/`` (issue 51). Files are named by module (``dppo_trl.components.placement``); only dppo_trl's and trl's count.

Traced over one DPPO step on the tests' offline tiny Qwen2 on the CPU (``sys.setprofile``: ``call`` events; a
``return`` only closes a window). A window's tracked calls in order, named by file, consecutive ones in the same file
collapsed (calls into torch or transformers between them skipped): each item left is one *file entry*.

- ``batch_file_entries`` (total and by package entered), ``batch_files``: from the first ``_prepare_inputs`` call
  (it generates the batch) until the first ``_compute_loss`` returns.
- ``loss_hops``, ``loss_sequence``: one loss micro-batch, from the first ``compute_loss`` call (TRL's, called by
  transformers' ``training_step``) until it returns; the hops are the file changes, transformers -> TRL included.
- ``house_view``: the same over the trainer's own layer: dppo_trl but ``dppo_trl.core.*`` and ``dppo_trl.config``
  (the math, the config's properties), and ``trl.trainer.grpo_trainer`` (not TRL's utilities, kernels, profiling
  wrapper): the view issue 51's loss sequence was taken in.

Static (``ast``):

- ``self_pairs``: the classes the trainer is made of (the dppo_trl classes deriving from ``GRPOTrainer``/``Trainer``,
  then, repeatedly, those they inherit from or hold: ``self.a = C(...)``, ``a: C``, a property ``-> C``). In their
  methods, each ``self.X`` and each call ``self.a.X(...)`` (not through a house attribute such as ``self.model``)
  where X, resolved by name over dppo_trl's classes (over what ``a`` holds where known), is a method the caller's
  module does not define. Reported: caller -> owner pairs (with the names), sites, methods, methods reaching across;
  ``component_pairs``: those from one component (``dppo_trl.components``) to another (the view and the batch's
  plain data aside): none, by design.
- ``trl_private_reads``: lines of dppo_trl reading ``<expr>._name``, ``_name`` (no dunder) in ``dir(GRPOTrainer)``
  or assigned as ``self._name`` in ``GRPOTrainer``'s or ``Trainer``'s source; by file, name and receiver;
  ``trl_only_lines``: reading a name dppo_trl does not define as a method (no override); writes apart.

    .venv/bin/python benchmarks/house.py --label after
    git clone -q . /tmp/house-before        # a clean checkout of HEAD (or of any commit) to measure "before"
    .venv/bin/python benchmarks/house.py --repo /tmp/house-before --label before
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
HOUSE = {"GRPOTrainer", "Trainer"}


def module_name(path: Path, roots: dict[str, Path]) -> str | None:
    """``path``'s dotted module name if it is a file of one of ``roots`` (package name -> folder), else None."""
    for package, root in roots.items():
        if path.is_relative_to(root):
            return ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
    return None


def in_house_view(module: str) -> bool:
    return module == "trl.trainer.grpo_trainer" or (module.startswith("dppo_trl.")
                                                    and not module.startswith(("dppo_trl.core", "dppo_trl.config")))


class Windows:
    """The profile function: the tracked calls, (module, function), of the batch window and of the loss window."""

    def __init__(self, roots: dict[str, Path]):
        self.roots, self.modules, self.batch, self.loss = roots, {}, [], []
        self.batch_frame = self.first_loss = self.loss_frame = None
        self.batch_open = self.loss_open = False

    def __call__(self, frame, event, arg):
        if event == "return":
            self.batch_open &= frame is not self.first_loss
            self.loss_open &= frame is not self.loss_frame
            return
        if event != "call":
            return
        filename, name = frame.f_code.co_filename, frame.f_code.co_name
        if filename not in self.modules:
            self.modules[filename] = module_name(Path(filename).resolve(), self.roots)
        if self.modules[filename] is None:
            return
        if self.batch_frame is None and name == "_prepare_inputs":
            self.batch_frame, self.batch_open = frame, True
        if self.batch_frame is not None and self.loss_frame is None and name == "compute_loss":
            self.loss_frame, self.loss_open = frame, True
        if self.batch_open and self.first_loss is None and name == "_compute_loss":
            self.first_loss = frame
        for window, is_open in ((self.batch, self.batch_open), (self.loss, self.loss_open)):
            if is_open:
                window.append((self.modules[filename], name))


def train_one_step(windows: Windows) -> None:
    """One DPPO step on the tests' tiny model and addition prompts (``tests/support``), traced by ``windows``
    (the one-off speed check off: its GRPO passes are not the batch's path)."""
    import torch
    from support import models, rewards

    from dppo_trl import DPPOConfig, DPPOTrainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPPOConfig(
            output_dir=os.path.join(tmp, "out"), completion_keep_rate=0.5, packing=True, num_generations=4,
            per_device_train_batch_size=8, max_completion_length=8, max_steps=1, report_to="none", use_cpu=True,
            bf16=False, save_strategy="no", disable_tqdm=True, speed_check=False,
        )
        model_dir = models.save_tiny_dense(Path(tmp) / "model")
        trainer = DPPOTrainer(model_dir, rewards.random_reward, args=args, train_dataset=models.addition_prompts(16))
        sys.setprofile(windows)
        try:
            trainer.train()
        finally:
            sys.setprofile(None)
    if windows.first_loss is None or windows.loss_frame is None:
        raise RuntimeError("no _prepare_inputs -> compute_loss -> _compute_loss seen in the traced step")


def window_figures(windows: Windows, keep=lambda module: True) -> dict:
    """The figures of both windows over the modules ``keep`` accepts."""
    batch, loss = ([c for i, c in enumerate(calls) if i == 0 or calls[i - 1][0] != c[0]]  # one item per entry
                   for calls in ([c for c in w if keep(c[0])] for w in (windows.batch, windows.loss)))
    by_package = Counter(module.split(".")[0] for module, _ in batch)
    return {"batch_file_entries": {"total": len(batch), "dppo_trl": by_package["dppo_trl"], "trl": by_package["trl"]},
            "batch_files": sorted({module for module, _ in batch}), "loss_hops": len(loss),
            "loss_sequence": [module for module, _ in loss], "batch_sequence": [module for module, _ in batch],
            "loss_sequence_functions": [f"{module}:{name}" for module, name in loss]}


def house_names() -> tuple[set[str], set[str]]:
    """The house trainer's names: ``dir(GRPOTrainer)``, and the attributes ``self.x`` assigned in the source of
    ``GRPOTrainer`` and ``Trainer``."""
    import transformers.trainer
    import trl.trainer.grpo_trainer as grpo

    sources = (grpo.__file__, transformers.trainer.__file__)
    return set(dir(grpo.GRPOTrainer)), set().union(*(self_stores(ast.parse(Path(s).read_text())) for s in sources))


def classes_of(trees: dict[str, ast.Module]) -> dict[str, tuple[str, ast.ClassDef]]:
    """``module.Class`` -> (module, class node) for every class of ``trees`` (nested ones included)."""
    return {f"{m}.{c.name}": (m, c) for m, tree in trees.items() for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}


def methods_of(node: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]


def names_in(nodes) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in nodes if isinstance(n, (ast.Name, ast.Attribute))}


def self_stores(tree) -> set[str]:
    return {a.attr for a in ast.walk(tree) if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store)
            and getattr(a.value, "id", None) == "self"}


def held_types(node: ast.ClassDef) -> dict[str, set[str]]:
    """Class names of what the class holds, by attribute: ``self.a = C(...)``, ``a: C | None`` in its body and
    ``@property def a(self) -> C``."""
    held = {}
    for a in ast.walk(node):
        if isinstance(a, ast.Assign) and isinstance(a.value, ast.Call):
            for t in a.targets:
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                    held.setdefault(t.attr, set()).update(names_in([a.value.func]))
    for a in node.body:
        if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name):
            held.setdefault(a.target.id, set()).update(names_in(ast.walk(a.annotation)))
        if isinstance(a, ast.FunctionDef) and a.returns is not None and "property" in names_in(a.decorator_list):
            held.setdefault(a.name, set()).update(names_in(ast.walk(a.returns)))
    return held


def trainer_scope(classes: dict, keys) -> set[str]:
    """The trainers (a house trainer or a trainer among the bases), then what they inherit from or hold."""
    scope, grown = set(), True
    while grown:
        trainers = {key for key, (_, node) in classes.items()
                    if names_in(node.bases) & HOUSE or keys(names_in(node.bases)) & scope}
        grown, scope = bool(trainers - scope), scope | trainers
    todo = list(scope)
    while todo:
        node = classes[todo.pop()][1]
        for key in keys(names_in(node.bases).union(*held_types(node).values())) - scope:
            scope.add(key)
            todo.append(key)
    return scope


def reaches_through_self(method, house_attributes: set[str]) -> list[tuple[str, str | None]]:
    """(X, holder) of each ``self.X`` (holder None) and each call ``self.a.X(...)`` (holder ``a``, ``""`` when
    deeper), none through one of ``house_attributes``."""
    called = {id(c.func) for c in ast.walk(method) if isinstance(c, ast.Call)}
    found = []
    for node in ast.walk(method):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            chain = [node.value]
            while isinstance(chain[-1], ast.Attribute):
                chain.append(chain[-1].value)
            through = {link.attr for link in chain[:-1]}
            if getattr(chain[-1], "id", None) == "self" and not through & house_attributes and (
                    len(chain) == 1 or id(node) in called):
                found.append((node.attr, None if len(chain) == 1 else chain[-2].attr if len(chain) == 2 else ""))
    return found


def own_names(key: str, classes: dict, trees: dict[str, ast.Module]) -> set[str]:
    """What a class finds without another module: the methods of its module's classes, the ``self.x`` assigned
    there and its own class-level names (dataclass fields)."""
    module, node = classes[key]
    fields = [t for a in node.body if isinstance(a, ast.Assign) for t in a.targets]
    fields += [a.target for a in node.body if isinstance(a, ast.AnnAssign)]
    methods = {f.name for m, c in classes.values() if m == module for f in methods_of(c)}
    return methods | self_stores(trees[module]) | names_in(fields)


def self_pairs(trees: dict[str, ast.Module], house_attributes: set[str]) -> dict:
    classes, by_name, owners = classes_of(trees), {}, {}
    for key, (_, node) in classes.items():
        by_name.setdefault(node.name, set()).add(key)
        for method in methods_of(node):
            owners.setdefault(method.name, set()).add(key)

    def keys(names) -> set[str]:  # class names -> dppo_trl classes
        return set().union(*(by_name.get(n, set()) for n in names))

    scope, held = trainer_scope(classes, keys), {}
    for key in scope:  # what self.a holds, over the whole trainer (a mixin's self is the trainer)
        for attr, names in held_types(classes[key][1]).items():
            held.setdefault(attr, set()).update(keys(names))
    pairs, sites, across, methods = {}, Counter(), set(), 0
    for key in sorted(scope):
        own = own_names(key, classes, trees)
        for method in methods_of(classes[key][1]):
            methods += 1
            for name, holder in reaches_through_self(method, house_attributes):
                found = owners.get(name, set()) & (held.get(holder or "") or set(classes))  # held: what a holds
                if name in own or not found:
                    continue
                for owner in found:
                    pairs.setdefault(f"{key} -> {owner}", set()).add(name)
                sites["self.X" if holder is None else "self.a.X()"] += 1
                across.add(f"{key}.{method.name}")
    components = "dppo_trl.components."
    plain = (f"{components}view.", f"{components}generation_batch.")  # the view protocol and plain data
    between = sorted(p for p in pairs if p.startswith(components)
                     and p.split(" -> ")[1].startswith(components) and not p.split(" -> ")[1].startswith(plain))
    return {"pair_count": len(pairs), "pairs": {pair: sorted(names) for pair, names in sorted(pairs.items())},
            "component_pairs": between,
            "sites": dict(sites), "classes": sorted(scope), "methods": methods,
            "methods_reaching_across": len(across)}


def trl_private_reads(trees: dict[str, ast.Module], house: set[str]) -> dict:
    private = {n for n in house if n.startswith("_") and not n.startswith("__")}
    overridden = {f.name for _, node in classes_of(trees).values() for f in methods_of(node)}
    reads, writes, names, receivers = {}, set(), Counter(), Counter()
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private:
                line = (module, node.lineno)
                if not isinstance(node.ctx, ast.Load):
                    writes.add(line)
                    continue
                reads.setdefault(line, set()).add(node.attr)
                names[node.attr] += 1
                value = node.value
                is_super = isinstance(value, ast.Call) and getattr(value.func, "id", None) == "super"
                receivers["self" if getattr(value, "id", None) == "self" else "super()" if is_super else "other"] += 1
    return {"lines": len(reads), "files": dict(sorted(Counter(m for m, _ in reads).items())),
            "trl_only_lines": sum(1 for read in reads.values() if read - overridden), "write_lines": len(writes),
            "by_receiver": dict(receivers), "names": dict(names.most_common()),
            "sites": [f"{m}:{n} {' '.join(sorted(reads[m, n]))}" for m, n in sorted(reads)]}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


def measure(repo: Path) -> dict:
    import torch
    import transformers
    import trl

    import dppo_trl

    roots = {"dppo_trl": Path(dppo_trl.__file__).resolve().parent, "trl": Path(trl.__file__).resolve().parent}
    if not roots["dppo_trl"].is_relative_to(repo.resolve()):
        raise RuntimeError(f"dppo_trl imported from {roots['dppo_trl']}, not from {repo}")
    trees = {module_name(p, roots): ast.parse(p.read_text(), str(p)) for p in sorted(roots["dppo_trl"].rglob("*.py"))}
    windows = Windows(roots)
    train_one_step(windows)
    house_dir, house_attributes = house_names()
    return {
        "commit": git(repo, "rev-parse", "HEAD"), "dirty": bool(git(repo, "status", "--porcelain", "dppo_trl")),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "repo": str(repo),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        **window_figures(windows), "house_view": window_figures(windows, in_house_view),
        "self_pairs": self_pairs(trees, house_attributes),
        "trl_private_reads": trl_private_reads(trees, house_dir | house_attributes),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the record's key in the JSON, e.g. before or after")
    parser.add_argument("--repo", type=Path, default=HERE.parent, help="the tree whose dppo_trl is measured")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "house.json", help="merged into if present")
    args = parser.parse_args(argv)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("OMP_NUM_THREADS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(name, value)
    sys.path[:0] = [str(args.repo.resolve()), str(args.repo.resolve() / "tests")]  # its dppo_trl, its tests/support
    record = measure(args.repo)
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    results[args.label] = record
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    house, pairs = record["house_view"], record["self_pairs"]
    print(f"{args.label} {record['commit'][:8]}: batch_file_entries {record['batch_file_entries']} (house view "
          f"{house['batch_file_entries']['total']}), loss_hops {record['loss_hops']} ({house['loss_hops']}), "
          f"self_pairs {pairs['pair_count']} over {pairs['methods']} methods, trl_private_reads "
          f"{record['trl_private_reads']['lines']} lines -> {args.json}")


if __name__ == "__main__":
    main()
