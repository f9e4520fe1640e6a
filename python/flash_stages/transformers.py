"""flash_stages as an attention implementation of Hugging Face transformers.

    import flash_stages.transformers
    flash_stages.transformers.register()                 # once, before the model is built
    model = LlamaForCausalLM(config)                     # config._attn_implementation = "flash_stages"

register() adds attention_forward to transformers' AttentionInterface under the name
"flash_stages", and, where transformers has one (AttentionMaskInterface), the mask function of
its FlashAttention integration, which passes no mask at all for batches without padding: the
kernels apply the causal mask themselves. Padding masks, dropout and sliding windows are not
supported and raise an error rather than being ignored.
"""

import torch

from . import _grouped_or_repeated, attention

NAME = "flash_stages"


def _is_causal_mask(mask, q_len, kv_len):
    """Whether a 4-D mask (boolean, True = attend, or additive, 0 = attend) is the plain causal mask
    of one sequence, the same for every batch entry and head: what transformers builds for a batch
    without padding where it has no mask interface to ask us."""
    if mask.dim() != 4 or mask.shape[-2:] != (q_len, kv_len) or q_len != kv_len:
        return False  # with a KV cache transformers builds other masks; the mask interface avoids them
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    return bool((allowed == causal).all())


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      **kwargs):
    """transformers' attention function: query [B, H, S, D], key and value [B, H_kv, S_kv, D] (grouped
    heads allowed); returns (output [B, S, H, D], None), as its SDPA function does."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError("flash_stages: sliding-window attention is not supported")
    if dropout:
        raise ValueError(f"flash_stages: attention dropout must be 0, got {dropout}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and query.shape[2] > 1
    if attention_mask is not None:
        if not (causal and _is_causal_mask(attention_mask, query.shape[2], key.shape[2])):
            raise ValueError("flash_stages: only the causal mask of unpadded sequences is supported; got an "
                             "attention mask with padding or of another shape")
    key, value, stage = _grouped_or_repeated(query, key, value, None)
    # Causal aligned bottom-right where a KV cache makes the keys outnumber the queries, as
    # transformers' FlashAttention integration does.
    out = attention(query, key, value, causal=causal, scale=scaling, stage=stage)
    return out.transpose(1, 2).contiguous(), None


def register(name=NAME):
    """Make `name` a valid attn_implementation of transformers models."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers import AttentionMaskInterface
        from transformers.masking_utils import flash_attention_mask
    except ImportError:  # older transformers: the model builds a 4-D mask, checked in attention_forward
        return
    AttentionMaskInterface.register(name, flash_attention_mask)
