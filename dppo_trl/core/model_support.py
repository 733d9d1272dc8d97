"""What a packed row can hold exactly, by model. No TRL import.

A packed row puts several sequences back to back, with ``position_ids`` restarting at 0 for each. Attention keeps
them apart (a block-diagonal mask from the positions, or explicit boundaries for flash attention). Two kinds of
layer read more than that:

- ``sequence_mixing_layers``: layers that carry a state along the row other than through attention (convolutions,
  state-space and linear-attention layers of hybrid models: Bamba, Granite 4, Qwen3-Next, LFM2, Falcon-H1). On the
  CPU paths transformers gives them no sequence boundaries, so the second sequence of a row would read the first's
  state. Such a model gets one sequence per packed row.
- ``length_dependent_rope``: rotary embeddings whose frequencies follow the longest position of a forward call
  (``dynamic`` NTK scaling, ``longrope``, as ``transformers.modeling_rope_utils.dynamic_rope_update`` decides).
  TRL's padded call numbers positions up to its padded width, a packed call up to its longest sequence, so the
  frequencies can differ. Such a model is not packed.
"""

from __future__ import annotations

import torch

# ``config.layer_types`` values of attention layers (every other value is a layer that mixes along the row).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def sequence_mixing_layers(model: torch.nn.Module, config) -> list[str]:
    """The kinds of layer of ``model`` (its text ``config``) that carry a state along a row other than through
    attention: ``config.layer_types`` values that are not attention, and ``Conv1d`` where a module is one. Empty
    for a model of attention layers only.

    Args:
        model: the model (unwrapped; a PEFT model is walked through to its base).
        config: the model's text config.
    """
    kinds = {kind for kind in getattr(config, "layer_types", None) or [] if kind not in ATTENTION_LAYER_TYPES}
    if any(isinstance(module, torch.nn.Conv1d) for module in model.modules()):
        kinds.add("Conv1d")
    return sorted(kinds)


def _rope_types(config) -> list[str]:
    """Every ``rope_type`` of ``config``: one, or one per layer type (``rope_parameters`` keyed by layer type)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(parameters, dict):
        return []
    if "rope_type" in parameters or "type" in parameters:
        return [str(parameters.get("rope_type", parameters.get("type")))]
    return [str(p.get("rope_type", p.get("type"))) for p in parameters.values() if isinstance(p, dict)]


def length_dependent_rope(config) -> str | None:
    """The ``rope_type`` of ``config`` whose frequencies depend on the longest position of a call (containing
    ``"dynamic"``, or ``"longrope"``: the rule of transformers' ``dynamic_rope_update``), or None."""
    for rope_type in _rope_types(config):
        if "dynamic" in rope_type or rope_type == "longrope":
            return rope_type
    return None
