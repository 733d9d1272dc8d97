"""Pure helpers on TRL's per-row batch dicts (tensors over the rows of a generation batch). No TRL import."""

from __future__ import annotations

import torch


def select_rows(batch: dict, index: torch.Tensor) -> dict:
    """Rows ``index`` of every per-row entry of a TRL batch dict; scalars (0-dim tensors) and None pass through."""
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            out[key] = value[index.to(value.device)]
        elif isinstance(value, list):
            out[key] = [value[i] for i in index.tolist()]
        else:
            out[key] = value
    return out


def loss_mask(batch: dict) -> torch.Tensor:
    """TRL's loss mask: the completion mask, times the tool mask where there is one."""
    mask = batch["completion_mask"]
    return mask if "tool_mask" not in batch else mask * batch["tool_mask"]


def filler_row(batch: dict) -> dict:
    """A one-row batch that contributes exactly zero and costs one token: no loss token, one prompt token,
    A = 0, weight 0, log-probs 0 and IS ratio 1 (so every TRL term is finite before it is masked)."""
    row = select_rows(batch, torch.zeros(1, dtype=torch.long))
    for key, value in row.items():
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            continue
        if key == "prompt_mask":
            value = torch.zeros_like(value)
            value[:, -1] = 1  # prompts are left-padded: the last column is a real token
        elif key == "importance_sampling_ratio":
            value = torch.ones_like(value)
        elif key not in ("prompt_ids", "completion_ids"):
            value = torch.zeros_like(value)
        row[key] = value
    return row


def with_fillers(microbatch: dict, filler: dict, size: int) -> dict:
    """``microbatch`` grown to ``size`` rows with copies of ``filler``."""
    missing = size - len(microbatch["prompt_ids"])
    if missing <= 0:
        return microbatch
    tensor = lambda v: isinstance(v, torch.Tensor) and v.ndim  # noqa: E731
    return {k: torch.cat([v, filler[k].expand(missing, *v.shape[1:])]) if tensor(v) else v
            for k, v in microbatch.items()}


# The entries a forward pass of a row needs (and TRL's loss mask): what the rows that were not kept carry into a
# micro-batch under the entropy filter (``unkept_rows_of_microbatch``).
TOKEN_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "tool_mask")


def unkept_rows_of_microbatch(rows: dict, keep: torch.Tensor, microbatch: torch.Tensor, index: int) -> dict:
    """The token entries (``TOKEN_KEYS``) of the rows of micro-batch ``index`` that were not kept.

    Args:
        rows: a TRL batch dict of ``B`` rows.
        keep: (B,) bool, the kept rows.
        microbatch: (B,) long, each row's micro-batch (``trl_microbatch_of_rows``; -1 for none).
        index: the micro-batch.
    """
    members = (~keep.cpu() & (microbatch.cpu() == index)).nonzero().flatten()
    return select_rows({key: rows[key] for key in TOKEN_KEYS if key in rows}, members)


def pad_to_width(batch: dict, key: str, prompt_width: int, completion_width: int, pad_id: int,
                 per_sequence_ratio: bool) -> torch.Tensor:
    """``batch[key]`` padded to common widths, so the rows of several ranks can travel in one gather:
    ``prompt_*`` on the left (prompts are left-padded), tensors as wide as the completions on the right, with
    the value that means "nothing" for the key (the pad token for ids, 1 for the IS ratio, 0 otherwise). DPPO's own
    entries (``dppo_*``) and other shapes stay as they are, and so does the IS ratio when it is per sequence
    (``per_sequence_ratio``: (B, 1))."""
    value = batch[key]
    if key.startswith("dppo_"):  # DPPO's per-row entries (a row's iteration weights are (B, num_iterations))
        return value
    fill = pad_id if key in ("prompt_ids", "completion_ids") else 1 if key == "importance_sampling_ratio" else 0
    if key.startswith("prompt_") and value.dim() > 1:
        return torch.nn.functional.pad(value, (prompt_width - value.size(1), 0), value=fill)
    sequence_ratio = key == "importance_sampling_ratio" and per_sequence_ratio
    if value.dim() > 1 and value.size(1) == batch["completion_ids"].size(1) and not sequence_ratio:
        return torch.nn.functional.pad(value, (0, completion_width - value.size(1)), value=fill)
    return value


def trl_microbatch_of_rows(permutation: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """Which of TRL's micro-batches each row lands in: TRL's shuffle puts row ``permutation[i]`` at position ``i``
    (``shuffle_sequence_dict``), and its split cuts the positions into ``num_microbatches`` consecutive chunks of
    ``B // num_microbatches`` (``split_tensor_dict``, which drops the remainder: -1 there).

    Args:
        permutation: (B,) long, the shuffle's permutation of the rows.
        num_microbatches: TRL's ``steps_per_generation``.

    Returns:
        (B,) long: each row's micro-batch index, in the rows' own (unshuffled) order.
    """
    rows = permutation.numel()
    size = rows // num_microbatches
    chunk = torch.arange(rows) // max(size, 1)
    chunk[size * num_microbatches :] = -1
    out = torch.empty(rows, dtype=torch.long)
    out[permutation.cpu()] = chunk
    return out


def microbatch_token_counts(microbatch: torch.Tensor, loss_tokens: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """Each row's micro-batch's loss-token count (0 for a row in none, ``microbatch == -1``).

    Args:
        microbatch: (B,) long, each row's micro-batch index (``trl_microbatch_of_rows``).
        loss_tokens: (B,) each row's loss tokens.
        num_microbatches: how many micro-batches there are.

    Returns:
        (B,) float64.
    """
    slot = torch.where(microbatch >= 0, microbatch, num_microbatches).cpu()
    totals = torch.zeros(num_microbatches + 1, dtype=torch.float64)
    totals.index_add_(0, slot, loss_tokens.detach().cpu().to(torch.float64))
    totals[num_microbatches] = 0.0
    return totals[slot]
