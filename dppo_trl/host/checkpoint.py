"""DPPO's state in a checkpoint: one file, ``dppo_state.json``, one entry per stateful part (``prompt_pruning``:
the prompt history; ``audit``: the audit's records), each the part's ``state_dict``. Checkpoints written before it held
two files (``dppo_prompt_sampler.json``, ``dppo_audit.pt``); they are read on resume too."""

from __future__ import annotations

import json
import os

import torch

STATE_FILE = "dppo_state.json"
_OLD_FILES = {"prompt_pruning": "dppo_prompt_sampler.json", "audit": "dppo_audit.pt"}


def save_dppo_state(folder: str, states: dict[str, dict | None]) -> None:
    """Write the parts that have state (``None``: nothing to save) into ``folder``'s one DPPO file."""
    present = {name: state for name, state in states.items() if state is not None}
    if present:
        with open(os.path.join(folder, STATE_FILE), "w") as f:
            json.dump(present, f)


def load_dppo_state(folder: str | None) -> dict[str, dict]:
    """The parts' states saved in ``folder`` (an empty dict when there are none), from the one file or from the
    two files of older checkpoints."""
    if not folder:
        return {}
    path = os.path.join(folder, STATE_FILE)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    states = {}
    old_prompt, old_audit = (os.path.join(folder, _OLD_FILES[name]) for name in ("prompt_pruning", "audit"))
    if os.path.exists(old_prompt):
        with open(old_prompt) as f:
            states["prompt_pruning"] = json.load(f)
    if os.path.exists(old_audit):
        states["audit"] = torch.load(old_audit, weights_only=True)
    return states
