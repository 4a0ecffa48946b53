"""Greedy decoding loops for batch-1 generation: a lean loop over the model's forward, and a native step.

``model.generate`` runs, per token, logits processors, stopping criteria, cache bookkeeping and input
preparation around the forward; and transformers' forward itself runs about two thousand small torch
operations per token of a 30-layer model. On a CPU, for a small model, that is milliseconds per token:
more than the sparse products themselves read from memory. Two loops here cut it:

* the **native step** (:class:`NativeDecoder`), for Llama-family models (Llama, Mistral, Qwen2) whose
  projections run on the native kernels (any ``SparseLinear`` on ``bitmask``, ``nm24``, ``csr``,
  ``native_dense`` or ``auto``; a plain float32 ``nn.Linear`` runs on the native dense GEMV in place): each
  new token is one call into the compiled kernel library, which runs every layer (norms, rotary embedding,
  attention over the cache, MLP, LM head, argmax); a prompt of up to :data:`PROMPT_STEPS` tokens runs
  through the same call token by token, a longer one through the model's own forward;
* the **forward loop**, for every other model: the model's forward with a KV cache, logits for the last
  position only, and an argmax.

Both produce the tokens ``generate(do_sample=False)`` produces (the native step computes in float32 in
transformers' order of operations up to the order of sums, so its logits agree to rounding; the tests
compare tokens) and stop at
the end-of-sequence token as ``generate`` does.

::

    from hf_sparsity.decoding import greedy_decode
    out = greedy_decode(model, input_ids, max_new_tokens=128)   # [1, prompt + new] token ids
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from .utils import SparsityError

STEPS = ("auto", "native", "model")
"""``greedy_decode(step=...)``: ``native`` (the one-call native step; an error where it does not apply),
``model`` (the forward loop), ``auto`` (native where it applies, else the forward loop)."""

ARCHITECTURES = ("llama", "mistral", "qwen2")
"""``config.model_type`` values the native step runs: pre-norm decoder blocks with RMSNorm, rotary
embeddings (rotate-half), grouped-query attention and a SiLU-gated MLP."""

PROMPT_STEPS = 16
"""Prompts up to this many tokens run through the native step one token at a time (each token reads the
weights once, as a decoded one does; no per-call overhead of the model's forward); longer ones through the
model's forward, whose batched products read the weights once for all of the prompt's tokens."""

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _eos_ids(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(e) for e in (eos_token_id if isinstance(eos_token_id, (list, tuple)) else [eos_token_id])}


class _Layer(ctypes.Structure):  # hfs_layer_t in csrc/hfs_kernels.c
    _fields_ = [
        *[(f"p_{n}", ctypes.c_void_p) for n in _PROJ],
        *[(f"b_{n}", ctypes.c_void_p) for n in _PROJ],
        *[(n, ctypes.c_void_p) for n in ("norm1", "norm2", "kc", "vc")],
    ]


_SIZES = ("nlayers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "max_len", "vocab", "threads")
_POINTERS = ("layers", "head", "head_bias", "final_norm", "embed", "cos", "sin", "work", "logits")


class _Decoder(ctypes.Structure):  # hfs_decoder_t in csrc/hfs_kernels.c
    _fields_ = [
        *[(n, ctypes.c_int64) for n in _SIZES],
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        *[(n, ctypes.c_void_p) for n in _POINTERS],
    ]


def _f32(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _window_reason(cfg, length: int) -> str | None:
    """Why a generation reaching ``length`` tokens cannot run natively (the limits that depend on it)."""
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and length > window:
        return f"a sliding window of {window} tokens, and the generation reaches {length} (it attends to all)"
    rope = getattr(cfg, "rope_parameters", None) or {}
    original = rope.get("original_max_position_embeddings")
    if rope.get("rope_type") == "longrope" and original is not None and length > original:
        # transformers switches from the short to the long factors past it; our tables are built once
        return (
            f"longrope rotary scaling past original_max_position_embeddings ({original}), and the "
            f"generation reaches {length} (its factors change with the length)"
        )
    return None


def native_step_reason(model: nn.Module, length: int | None = None) -> str | None:
    """Why :class:`NativeDecoder` cannot run ``model`` (``None``: it can), for generations reaching
    ``length`` tokens (prompt included) when given."""
    from .backends import _native
    from .inference import SparseLinear

    if _native.load() is None:
        return f"the native kernel library is unavailable: {_native.error()}"
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model type {kind!r} (the native step runs {', '.join(ARCHITECTURES)})"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r} (the native step runs silu)"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope == "dynamic":
        return "dynamic rotary scaling (its tables change with the length)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if length is not None and _window_reason(cfg, length):
        return _window_reason(cfg, length)
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens"):
        return "not a decoder-only Llama-style module tree (model.model.layers / rotary_emb / embed_tokens)"
    head = model.get_output_embeddings()
    if model.training:
        return "the model is in training mode (call model.eval())"
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or type(layer.input_layernorm).__name__.endswith("LayerNorm"):
            return f"layer {i} is not a Llama-style block"
        for name in _PROJ:
            mod = getattr(attn if name in _PROJ[:4] else mlp, name, None)
            if isinstance(mod, SparseLinear):
                if mod.backend.decode_call() is None:
                    return f"layer {i} {name}: backend {mod.backend.name!r} has no native batch-1 call"
            elif type(mod) is not nn.Linear or not _f32(mod.weight.detach()):
                return (
                    f"layer {i} {name}: {type(mod).__name__} (native step: SparseLinear or float32 nn.Linear)"
                )
            if not _f32(mod.bias):
                return f"layer {i} {name}: a bias that is not float32 on the CPU"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not _f32(getattr(norm, "weight", None)):
                return f"layer {i}: a norm whose weight is not float32 on the CPU"
    if not (isinstance(head, SparseLinear) or (type(head) is nn.Linear and _f32(head.weight.detach()))):
        return f"LM head {type(head).__name__} (native step: SparseLinear or float32 nn.Linear)"
    if not _f32(base.embed_tokens.weight.detach()) or not _f32(base.norm.weight):
        return "embeddings or final norm not float32 on the CPU"
    return None


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise SparsityError(
            f"The native decoding step does not run this model: {reason}. greedy_decode(step='model') runs "
            "any model (the forward loop)."
        )


class NativeDecoder:
    """Greedy decoding of one prompt with one native call per token (module docstring).

    Built per generation (cheap: it points at the model's tensors, nothing is copied); plain float32
    ``nn.Linear`` layers run on the native dense GEMV over their own weight. Raises
    :class:`~hf_sparsity.utils.SparsityError` with the reason when the model is not supported
    (:func:`native_step_reason`).
    """

    def __init__(self, model: nn.Module, *, check: bool = True):
        if check:  # greedy_decode checked already
            _refuse(native_step_reason(model))
        self.model = model
        self._keep: list = []  # prepared structures and dense views the C side points into

    def _call(self, mod: nn.Module) -> tuple[int, int | None]:
        """(prepared call address, bias address) for a projection / the LM head."""
        from .backends import get_backend
        from .inference import SparseLinear

        if isinstance(mod, SparseLinear):
            prep, addr = mod.backend.decode_call()
            self._keep.append(prep)
        else:  # float32 nn.Linear: the dense GEMV over its own weight (no copy: full mask, contiguous)
            w = mod.weight.detach()
            full = torch.ones((), dtype=torch.uint8).expand(w.shape)
            backend = get_backend("native_dense").from_dense(w, full)
            prep, addr = backend.decode_call()
            self._keep += [backend, prep]
        bias = mod.bias.detach() if mod.bias is not None else None
        return addr, _ptr(bias)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        eos: set[int] = frozenset(),
        on_token: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Greedy decoding: ``[1, n]`` prompt ids -> ``[1, n + generated]``."""
        from transformers import DynamicCache

        from .backends import _native

        model, cfg = self.model, self.model.config
        base = model.model
        n = int(input_ids.shape[1])
        total = n + max_new_tokens
        hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        _refuse(_window_reason(cfg, total))  # the rest of native_step_reason holds since __init__
        self._keep = []
        short = n <= PROMPT_STEPS  # through the native step, token by token; else the model's forward
        if not short:  # batched products; its cache seeds ours
            cache = DynamicCache(config=cfg)
            out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
            first = int(out.logits[0, -1].argmax())
        pos_ids = torch.arange(total)[None]
        cos, sin = base.rotary_emb(torch.zeros(1, dtype=torch.float32), position_ids=pos_ids)
        cos, sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        layers = (_Layer * len(base.layers))()
        caches = []
        for i, layer in enumerate(base.layers):
            kc = torch.zeros(kv, total, hd)
            vc = torch.zeros(kv, total, hd)
            if not short:
                kc[:, :n] = cache.layers[i].keys[0]
                vc[:, :n] = cache.layers[i].values[0]
            caches += [kc, vc]
            entry = layers[i]
            for name in _PROJ:
                mod = getattr(layer.self_attn if name in _PROJ[:4] else layer.mlp, name)
                addr, bias = self._call(mod)
                setattr(entry, f"p_{name}", addr)
                setattr(entry, f"b_{name}", bias)
            entry.norm1 = layer.input_layernorm.weight.data_ptr()
            entry.norm2 = layer.post_attention_layernorm.weight.data_ptr()
            entry.kc, entry.vc = kc.data_ptr(), vc.data_ptr()
        head = model.get_output_embeddings()
        head_addr, head_bias = self._call(head)
        vocab = int(head.out_features)
        logits = torch.empty(vocab)
        attn0 = base.layers[0].self_attn
        dec = _Decoder(
            len(base.layers), int(cfg.hidden_size), heads, kv, hd, int(cfg.intermediate_size), total, vocab,
            torch.get_num_threads(),
            float(base.layers[0].input_layernorm.variance_epsilon), float(attn0.scaling),
            ctypes.addressof(layers), head_addr, head_bias, base.norm.weight.data_ptr(),
            base.embed_tokens.weight.detach().data_ptr(), cos.data_ptr(), sin.data_ptr(), None,
            logits.data_ptr(),
        )  # fmt: skip
        lib = _native.load()
        work = torch.empty(int(lib.hfs_decode_work_floats(ctypes.byref(dec))))
        dec.work = work.data_ptr()
        if short:  # the LM head for its last token only
            prompt = input_ids[0].to(torch.int64).contiguous()
            rows = base.embed_tokens.weight.shape[0]
            if not 0 <= int(prompt.min()) <= int(prompt.max()) < rows:
                raise SparsityError(f"Prompt token ids must lie in [0, {rows}): the model's embedding rows.")
            first = int(lib.hfs_decode_prompt(ctypes.byref(dec), prompt.data_ptr(), n, 0))
        new = [first]
        if on_token is not None:
            on_token(first)
        tok, pos = first, n
        while tok not in eos and len(new) < max_new_tokens:
            tok = int(lib.hfs_decode_step(ctypes.byref(dec), tok, pos))
            pos += 1
            new.append(tok)
            if on_token is not None:
                on_token(tok)
        del caches, layers
        return torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype)], dim=1)


@torch.inference_mode()
def greedy_decode(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
    on_token: Callable[[int], None] | None = None,
    step: str = "auto",
) -> torch.Tensor:
    """Greedy decoding of one prompt (``input_ids`` ``[1, n]``) for up to ``max_new_tokens`` tokens.

    Returns ``[1, n + generated]``; stops after an end-of-sequence token (``eos_token_id``, default the
    model's generation config; ``[]`` never stops early). ``on_token`` is called with each new token id
    as it is produced (e.g. to stream text). ``step``: see :data:`STEPS` (``auto``: the native step where
    :func:`native_step_reason` is ``None``).
    """
    from transformers import DynamicCache

    if step not in STEPS:
        raise SparsityError(f"step={step!r}: use one of {', '.join(STEPS)}.")
    if input_ids.ndim != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        raise SparsityError(
            f"greedy_decode takes one prompt, [1, n] token ids with n >= 1; got {list(input_ids.shape)}."
        )
    if max_new_tokens < 1:
        raise SparsityError("max_new_tokens must be at least 1.")
    eos = _eos_ids(model, eos_token_id)
    ids = input_ids.to(next(model.parameters()).device)
    length = int(ids.shape[1]) + max_new_tokens
    if step != "model":
        reason = native_step_reason(model, length)  # one walk over the layers per generation
        if step == "native":
            _refuse(reason)
        if reason is None:
            return NativeDecoder(model, check=False).generate(ids, max_new_tokens, eos, on_token)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    new: list[torch.Tensor] = []
    for i in range(max_new_tokens):
        nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
        new.append(nxt)
        tok = int(nxt)
        if on_token is not None:
            on_token(tok)
        if tok in eos or i == max_new_tokens - 1:
            break
        out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
    return torch.cat([ids, *new], dim=1)
