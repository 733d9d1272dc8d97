"""Float64 stand-ins for the places where a forward or backward pass computes in float32 whatever the model's dtype:
TRL's fused log-prob kernel, the RMSNorms of Qwen2 and Qwen3-MoE, Qwen2's eager attention softmax and Qwen3-MoE's
router softmax. With them replaced (``use_float64_kernels``), a float64 model trains in float64 end to end, so
exact oracles compare to float64 rounding."""

import torch


class Float64LogProbs:
    """Stand-in for TRL's fused log-prob kernel (which accumulates in float32): the same per-token log-probs and
    entropies of ``hidden @ weight.T``, in the inputs' dtype, through plain autograd."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcapping, logit_scale, outputs):
        logits = hidden @ weight.T + (0 if bias is None else bias)
        logits = logits * logit_scale
        if softcapping is not None:
            logits = softcapping * torch.tanh(logits / softcapping)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy, None, None, None


def rms_norm_in_input_dtype(self, hidden_states):
    """Qwen2's RMSNorm without its float32 round trip (which would also round the backward pass to float32)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def eager_attention_in_input_dtype(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Qwen2's eager attention with its softmax in the inputs' dtype (transformers' takes it in float32)."""
    from transformers.models.qwen2.modeling_qwen2 import repeat_kv

    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.dropout(weights.softmax(-1), p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def moe_router_in_input_dtype(self, hidden_states):
    """Qwen3-MoE's top-k router with its softmax in the inputs' dtype (transformers' takes it in float32)."""
    router_logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top_value, indices = torch.topk(router_logits.softmax(-1), self.top_k, dim=-1)
    if self.norm_topk_prob:
        top_value = top_value / top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value, indices


def use_float64_kernels(set_attribute=setattr) -> None:
    """Replace TRL's fused log-prob kernel by ``Float64LogProbs``, the RMSNorm forwards of Qwen2 and Qwen3-MoE by
    ``rms_norm_in_input_dtype``, Qwen2's eager attention by ``eager_attention_in_input_dtype`` and Qwen3-MoE's
    router by ``moe_router_in_input_dtype``, through ``set_attribute`` (``setattr`` for good, as in a worker
    process, or pytest's ``monkeypatch.setattr``, undone after the test)."""
    import trl.trainer.utils
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    set_attribute(trl.trainer.utils, "_ChunkedLogProbFunction", Float64LogProbs)
    set_attribute(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_in_input_dtype)
    set_attribute(modeling_qwen2, "eager_attention_forward", eager_attention_in_input_dtype)
    set_attribute(modeling_qwen3_moe.Qwen3MoeRMSNorm, "forward", rms_norm_in_input_dtype)
    set_attribute(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", moe_router_in_input_dtype)
