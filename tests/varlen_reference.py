"""A CPU stand-in for transformers' flash-attention path, with the same view of its inputs.

transformers 5.x's ``_flash_attention_forward`` finds sequence boundaries, in this order: from a 2-D padding
mask (each row's real tokens are one sequence), from explicit ``cu_seq_lens_q/k`` + ``max_length_q/k`` (over the
flattened batch), or from ``position_ids`` restarting at 0 when the batch has ONE row; otherwise it runs plain
causal attention over each whole row. This function does exactly that, in float32 matmuls, so packed inputs
that would mix sequences under flash mix them here too. Registered under a name without "flash" (transformers
would try to import a flash kernel at load time) and declared a variable-length kernel to dppo_trl.
"""

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from dppo_trl.core.packing import register_varlen_attention

NAME = "varlen_reference"


def _segments(batch, length, attention_mask, position_ids, cu_seq_lens, device):
    """Segment id of every token of the flattened batch (-1: padding), as flash would delimit sequences."""
    index = torch.arange(batch * length, device=device)
    if attention_mask is not None:  # unpad: each row's real tokens form one sequence
        rows = (index // length).view(batch, length)
        return torch.where(attention_mask.bool(), rows, -1).flatten()
    if cu_seq_lens is not None:
        return torch.bucketize(index, cu_seq_lens[1:].to(index.dtype), right=True)
    if position_ids is not None and batch == 1 and length > 1:
        flat = position_ids.flatten()
        if bool((flat != torch.arange(length, device=device) + flat.min()).any()):  # packed: restarts
            return torch.cumsum((flat == flat.min()).long(), 0) - 1
    return index // length  # plain causal over each whole row


def varlen_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    batch, heads, length, dim = query.shape
    groups = heads // key.size(1)
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = dim**-0.5 if scaling is None else scaling
    if key.size(2) != length:  # decoding with a cache (generation): causal per row over the real keys
        offset = key.size(2) - length
        allowed = torch.arange(key.size(2))[None, :] <= torch.arange(length)[:, None] + offset
        allowed = allowed[None, None] & (True if attention_mask is None else attention_mask.bool()[:, None, None, :])
        scores = (query @ key.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
        return (probs @ value).transpose(1, 2).contiguous(), None
    seg = _segments(batch, length, attention_mask, kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"),
                    query.device)
    order = torch.arange(batch * length, device=query.device)
    allowed = (seg[:, None] == seg[None, :]) & (order[None, :] <= order[:, None]) & (seg[None, :] >= 0)
    q = query.transpose(0, 1).reshape(heads, batch * length, dim)
    k = key.transpose(0, 1).reshape(heads, batch * length, dim)
    v = value.transpose(0, 1).reshape(heads, batch * length, dim)
    scores = (q @ k.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # a padding query attends to nothing
    out = (probs @ v).view(heads, batch, length, dim).permute(1, 2, 0, 3)  # (B, T, H, D), as flash returns
    return out.contiguous(), None


def register() -> str:
    AttentionInterface.register(NAME, varlen_reference_attention)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    register_varlen_attention(NAME)
    return NAME
