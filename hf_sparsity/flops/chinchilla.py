"""Chinchilla App. F forward FLOPs from a handful of hyperparameters (:func:`chinchilla_forward_flops`)."""

from __future__ import annotations

from .report import TRAINING_MULTIPLIER


def chinchilla_forward_flops(
    *,
    seq_len: int,
    vocab_size: int,
    d_model: int,
    num_layers: int,
    ffw_size: int,
    num_heads: int,
    key_size: int | None = None,
    sparsity: float = 0.0,
    include_embeddings: bool = False,
) -> dict[str, float]:
    """Chinchilla Appendix F, term by term, forward FLOPs per sequence (a GPT-style block, 2-matrix MLP).

    ``sparsity`` scales the projection and feed-forward terms (QKV, attention output,
    both MLP matrices), as in Cerebras' sparse GPT FLOP counts; attention logits, softmax and final logits
    stay dense. This closed form is the reference the module-based count is tested against.
    """
    key_size = key_size or d_model // num_heads
    dens = 1.0 - sparsity
    hk = key_size * num_heads
    terms = {
        "embeddings": 2.0 * seq_len * vocab_size * d_model,
        "qkv": 2.0 * 3 * seq_len * d_model * hk * dens,
        "logits_qk": 2.0 * seq_len * seq_len * hk,
        "softmax": 3.0 * num_heads * seq_len * seq_len,
        "reduction": 2.0 * seq_len * seq_len * hk,
        "attn_out": 2.0 * seq_len * hk * d_model * dens,
        "ffw": 2.0 * seq_len * (d_model * ffw_size + d_model * ffw_size) * dens,
        "final_logits": 2.0 * seq_len * d_model * vocab_size,
    }
    per_layer = sum(terms[k] for k in ("qkv", "logits_qk", "softmax", "reduction", "attn_out", "ffw"))
    total = (
        num_layers * per_layer + terms["final_logits"] + (terms["embeddings"] if include_embeddings else 0.0)
    )
    terms["per_layer"] = per_layer
    terms["forward"] = total
    terms["training"] = TRAINING_MULTIPLIER * total
    return terms
