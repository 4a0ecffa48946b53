"""Tiny models that look like trained ones, for tests that a default-initialised model would let pass.

A model at its default initialisation has every norm weight at 1.0 and every bias at 0, one head layout
and small attention logits: a decode step that reads the wrong norm's weight, skips a bias or mixes up
query and key-value heads gives the same tokens on it. :func:`realistic_model` builds the tiny model of
each architecture with every parameter drawn the way a trained checkpoint's look:

* norm weights spread over [0.25, 2.5], different per layer, per norm and per channel; norm biases
  and projection biases far from 0 (normal, std 0.3);
* projection weights with std 0.3 (decisive argmaxes at hidden size 32..64), the embeddings with std 1;
* outlier channels: the query and key rows of attention head 0 scaled by 3 (logits about 9x larger);
* an odd vocabulary (default 101) and room for positions past 9 and 99 (default 160 positions);
* any head layout: ``heads`` != ``kv_heads`` (grouped-query attention), ``head_dim`` != hidden / heads.

:func:`early_eos` picks an end-of-sequence id the greedy path reaches early (not at its first token).
"""

from __future__ import annotations

import torch

ARCHS = ("gpt2", "llama", "mistral", "qwen2", "gpt_neox", "opt")
LLAMA_FAMILY = ("llama", "mistral", "qwen2")


def realistic_config(
    arch: str,
    *,
    vocab: int = 101,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    ffn: int | None = None,
    positions: int = 160,
    **overrides,
):
    """The config of a tiny ``arch`` model (see the module docstring); ``overrides`` go to the config."""
    import transformers as tf

    kv_heads = kv_heads or (heads // 2 if heads % 2 == 0 else heads)
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if arch in LLAMA_FAMILY:
        cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config}[arch]
        kw = dict(
            hidden_size=hidden,
            intermediate_size=ffn or (9 * hidden) // 4,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=positions,
            rms_norm_eps=1e-5,
        )
        if head_dim is not None:
            kw["head_dim"] = head_dim
        if arch == "mistral":
            kw["sliding_window"] = None
        cfg = cls(**kw, **common)
    elif arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=positions, **common)
    elif arch == "gpt_neox":
        cfg = tf.GPTNeoXConfig(
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=ffn or 4 * hidden,
            num_attention_heads=heads,
            max_position_embeddings=positions,
            **common,
        )
    elif arch == "opt":
        cfg = tf.OPTConfig(
            num_hidden_layers=layers,
            hidden_size=hidden,
            ffn_dim=ffn or 4 * hidden,
            num_attention_heads=heads,
            word_embed_proj_dim=hidden,
            max_position_embeddings=positions,
            **common,
        )
    else:
        raise ValueError(f"unknown architecture {arch!r}; one of {ARCHS}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _head_dim(cfg) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


@torch.no_grad()
def randomize_like_trained(model, seed: int = 0, outlier: float = 3.0):
    """Redraw every parameter of ``model`` in place the way a trained model's look (module docstring)."""
    g = torch.Generator().manual_seed(seed)

    def draw(p, kind):
        if kind == "norm":
            v = 0.25 + 2.25 * torch.rand(p.shape, generator=g)
        elif kind == "bias":
            v = 0.3 * torch.randn(p.shape, generator=g)
        elif kind == "embed":
            v = torch.randn(p.shape, generator=g)
        else:
            v = 0.3 * torch.randn(p.shape, generator=g)
        p.copy_(v.to(p.dtype))

    for name, p in model.named_parameters():
        is_norm = any(k in name for k in ("norm", "ln_", "layer_norm")) or name.startswith("ln_f")
        if is_norm and name.endswith("weight"):
            draw(p, "norm")
        elif name.endswith("bias"):
            draw(p, "bias")
        elif p.ndim == 2 and ("embed" in name or "wte" in name or "wpe" in name):
            draw(p, "embed")
        else:
            draw(p, "weight")
    cfg = model.config
    hd = _head_dim(cfg)
    hidden = cfg.hidden_size
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("q_proj", "k_proj"):
            mod.weight[:hd] *= outlier
        elif leaf == "c_attn":  # GPT-2 Conv1D: [in, 3 * hidden], q | k | v columns
            mod.weight[:, :hd] *= outlier
            mod.weight[:, hidden : hidden + hd] *= outlier
        elif leaf == "query_key_value":  # GPT-NeoX: per head [q | k | v] rows
            mod.weight[: 2 * hd] *= outlier
    return model


def realistic_model(arch: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw):
    """A tiny ``arch`` model in eval mode with trained-looking parameters (module docstring)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(realistic_config(arch, **config_kw))
    randomize_like_trained(model, seed)
    model.generation_config.eos_token_id = None  # tests name their end-of-sequence id (early_eos)
    return model.to(dtype).eval()


def prompt(n: int, vocab: int = 101, seed: int = 0) -> torch.Tensor:
    """``[1, n]`` token ids in [2, vocab) (0 and 1 are BOS and EOS)."""
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def generate_greedy(model, ids: torch.Tensor, n: int, eos=None) -> torch.Tensor:
    """transformers' own greedy ``generate`` (the reference); ``eos=None``: the model's generation config
    (none for :func:`realistic_model`: it never stops early)."""
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=0,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )


def early_eos(model, ids: torch.Tensor, after: int = 3) -> tuple[int, int]:
    """``(eos, k)``: an end-of-sequence id greedy decoding first reaches as its ``k``-th new token (0-based),
    the first ``k >= after`` whose token does not occur before it."""
    free = generate_greedy(model, ids, after + 16)[0, ids.shape[1] :].tolist()
    for k in range(after, len(free)):
        if free[k] not in free[:k]:
            return free[k], k
    raise AssertionError("greedy decoding repeats one token; pick another prompt")
