"""The native step: one call into the compiled kernel library per decoded token (batch 1).

:class:`NativeDecoder` points the kernel library's decoder structure at a supported model's tensors
(Llama / Mistral / Qwen2 / Qwen3 and GPT-2 module trees; projections on the native kernels) and runs every
layer of a token in one call; :func:`native_step_reason` says why a model cannot run on it. The decoding
loops over it (:func:`~hf_sparsity.inference.decoding.greedy_decode`, ``model.generate``'s
``custom_generate=native_generate``) are in :mod:`hf_sparsity.inference.decoding`, which re-exports these
names.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import nn

from ..backends import _native, get_backend
from ..hooks import tensor_version
from ..utils import SparsityError, torch_threads
from .conversion import Int8Embedding, SparseLinear

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
"""``config.model_type`` values the native step runs: Llama / Mistral / Qwen2 / Qwen3 (pre-norm blocks with
RMSNorm, rotary embeddings (rotate-half), grouped-query attention, a SiLU-gated MLP; Qwen3: RMSNorm of each
head's query and key) and GPT-2 (learned positions,
LayerNorm with a bias, one fused q / k / v product, GELU MLP, biases; ``Conv1D`` weights)."""

GPT2_ACTIVATIONS = {"gelu_new": 0, "gelu_pytorch_tanh": 0, "gelu": 1}
"""GPT-2 ``activation_function`` values the native step runs (0: GELU's tanh approximation, 1: erf)."""

PROMPT_STEPS = 16
"""Prompts up to this many tokens run through the native step one token at a time (each token reads the
weights once, as a decoded one does; no per-call overhead of the model's forward); longer ones through the
model's forward, whose batched products read the weights once for all of the prompt's tokens."""

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Layer(ctypes.Structure):  # hfs_layer_t in csrc/api.h (tests/test_struct_mirrors.py)
    _fields_ = [
        *[(f"p_{n}", ctypes.c_void_p) for n in _PROJ],
        *[(f"b_{n}", ctypes.c_void_p) for n in _PROJ],
        *[(n, ctypes.c_void_p) for n in ("norm1", "norm2", "kc", "vc", "nbias1", "nbias2", "qnorm", "knorm")],
    ]


_SIZES = ("nlayers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "max_len", "vocab", "threads")
_POINTERS = ("layers", "head", "head_bias", "final_norm", "embed", "cos", "sin", "work", "logits")


class _Decoder(ctypes.Structure):  # hfs_decoder_t in csrc/api.h (tests/test_struct_mirrors.py)
    _fields_ = [
        *[(n, ctypes.c_int64) for n in _SIZES],
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        *[(n, ctypes.c_void_p) for n in _POINTERS],
        ("arch", ctypes.c_int64),
        ("act", ctypes.c_int64),
        ("pos_embed", ctypes.c_void_p),
        ("final_norm_bias", ctypes.c_void_p),
        ("embed_codes", ctypes.c_void_p),
        ("embed_scales", ctypes.c_void_p),
        ("screen", ctypes.c_void_p),
        ("screen_err", ctypes.c_void_p),
        ("cand", ctypes.c_void_p),
        ("screen_cap", ctypes.c_int64),
        ("screened", ctypes.c_int64),
        ("screen_work", ctypes.c_void_p),
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


class _Parts:
    """The pieces of a supported model the native step points at (:func:`_parts`)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _parts(model: nn.Module) -> _Parts | str:
    """The model's blocks as the native step sees them, or why it cannot (a module tree it does not know).
    Each block: ``proj`` (hfs_layer_t's slot -> module; GPT-2's fused c_attn in ``q_proj``, c_fc in
    ``up_proj``) and ``norms`` (two (weight, bias) pairs; bias ``None``: RMSNorm)."""
    cfg = model.config
    if cfg.model_type == "gpt2":
        base = getattr(model, "transformer", None)
        blocks = getattr(base, "h", None)
        if blocks is None or not all(hasattr(base, n) for n in ("wte", "wpe", "ln_f")):
            return "not a GPT-2 module tree (model.transformer.h / wte / wpe / ln_f)"
        out = []
        for i, blk in enumerate(blocks):
            attn, mlp = getattr(blk, "attn", None), getattr(blk, "mlp", None)
            if attn is None or mlp is None or hasattr(attn, "q_attn") or getattr(blk, "crossattention", None):
                return f"block {i} is not a GPT-2 decoder block (cross-attention?)"
            proj = {
                "q_proj": attn.c_attn,
                "o_proj": attn.c_proj,
                "up_proj": mlp.c_fc,
                "down_proj": mlp.c_proj,
            }
            norms = [(blk.ln_1.weight, blk.ln_1.bias), (blk.ln_2.weight, blk.ln_2.bias)]
            out.append({"proj": proj, "norms": norms})
        heads = int(cfg.n_head)
        hd = int(cfg.n_embd) // heads
        return _Parts(
            arch=1, blocks=out, embed=_table(base.wte), pos_embed=base.wpe.weight, rotary=None,
            final=(base.ln_f.weight, base.ln_f.bias), eps=float(blocks[0].ln_1.eps),
            scale=float(blocks[0].attn.scaling), hidden=int(cfg.n_embd), heads=heads, kv=heads, hd=hd,
            ffn=int(blocks[0].mlp.c_fc.weight.shape[1] if type(blocks[0].mlp.c_fc).__name__ == "Conv1D"
                    else blocks[0].mlp.c_fc.out_features),
            act=GPT2_ACTIVATIONS.get(cfg.activation_function, -1),
        )  # fmt: skip
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(base, "rotary_emb") or not hasattr(base, "embed_tokens"):
        return "not a decoder-only Llama-style module tree (model.model.layers / rotary_emb / embed_tokens)"
    out = []
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or type(layer.input_layernorm).__name__.endswith("LayerNorm"):
            return f"layer {i} is not a Llama-style block"
        proj = {n: getattr(attn if n in _PROJ[:4] else mlp, n, None) for n in _PROJ}
        norms = [(layer.input_layernorm.weight, None), (layer.post_attention_layernorm.weight, None)]
        qk = [getattr(getattr(attn, n, None), "weight", None) for n in ("q_norm", "k_norm")]
        if (qk[0] is None) != (cfg.model_type != "qwen3") or (qk[0] is None) != (qk[1] is None):
            return f"layer {i}: q / k norms where the native step does not expect them"
        out.append({"proj": proj, "norms": norms, "qk_norms": qk})
    heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    return _Parts(
        arch=0, blocks=out, embed=_table(base.embed_tokens), pos_embed=None, rotary=base.rotary_emb,
        final=(base.norm.weight, None), eps=float(layers[0].input_layernorm.variance_epsilon),
        scale=float(layers[0].self_attn.scaling), hidden=int(cfg.hidden_size), heads=heads, kv=kv,
        hd=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads), ffn=int(cfg.intermediate_size),
        act=0,
    )  # fmt: skip


def _table(embedding: nn.Module) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The token embedding's table: its weight, or (an :class:`Int8Embedding`) the int8 head's ``(codes,
    scales)``, which the step dequantizes per row as the module does."""
    return embedding.int8_rows() if isinstance(embedding, Int8Embedding) else embedding.weight


def _is_conv1d(mod) -> bool:
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")


def _config_reason(cfg, length: int | None) -> str | None:
    """Why the native step cannot run a model of this config (architecture and options only)."""
    kind = getattr(cfg, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model type {kind!r} (the native step runs {', '.join(ARCHITECTURES)})"
    if kind == "gpt2":
        act = getattr(cfg, "activation_function", None)
        if act not in GPT2_ACTIVATIONS:
            return f"activation {act!r} (the native step runs {', '.join(GPT2_ACTIVATIONS)} for GPT-2)"
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            return "scale_attn_by_inverse_layer_idx (attention scaled per layer)"
        if getattr(cfg, "add_cross_attention", False):
            return "cross-attention"
        if length is not None and length > int(cfg.n_positions):
            return f"the generation reaches {length} tokens, beyond its {cfg.n_positions} positions"
        return None
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r} (the native step runs silu)"
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope == "dynamic":
        return "dynamic rotary scaling (its tables change with the length)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if length is not None and _window_reason(cfg, length):
        return _window_reason(cfg, length)
    return None


def native_step_reason(model: nn.Module, length: int | None = None) -> str | None:
    """Why :class:`NativeDecoder` cannot run ``model`` (``None``: it can), for generations reaching
    ``length`` tokens (prompt included) when given."""

    if _native.load() is None:
        return f"the native kernel library is unavailable: {_native.error()}"
    cfg = getattr(model, "config", None)
    reason = _config_reason(cfg, length)
    if reason is not None:
        return reason
    parts = _parts(model)
    if isinstance(parts, str):
        return parts
    if model.training:
        return "the model is in training mode (call model.eval())"
    head = model.get_output_embeddings()
    for i, blk in enumerate(parts.blocks):
        for name, mod in blk["proj"].items():
            if isinstance(mod, SparseLinear):
                if mod.backend.decode_call() is None:
                    return f"layer {i} {name}: backend {mod.backend.name!r} has no native batch-1 call"
            elif not (type(mod) is nn.Linear or _is_conv1d(mod)) or not _f32(mod.weight.detach()):
                return (
                    f"layer {i} {name}: {type(mod).__name__} (native step: SparseLinear, or nn.Linear / "
                    "Conv1D in float32)"
                )
            if not _f32(mod.bias):
                return f"layer {i} {name}: a bias that is not float32 on the CPU"
        for w, b in [*blk["norms"], *[(w, None) for w in blk.get("qk_norms", ())]]:
            if not _f32(w) or not _f32(b):
                return f"layer {i}: a norm whose weight is not float32 on the CPU"
    if not (isinstance(head, SparseLinear) or (type(head) is nn.Linear and _f32(head.weight.detach()))):
        return f"LM head {type(head).__name__} (native step: SparseLinear or float32 nn.Linear)"
    table = parts.embed if torch.is_tensor(parts.embed) else None  # int8 codes: the head's, checked above
    if not all(_f32(t if t is None else t.detach()) for t in (table, parts.pos_embed, *parts.final)):
        return "embeddings or final norm not float32 on the CPU"
    return None


_DENSE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _dense_gemv(mod: nn.Module, klass) -> object:
    """The native dense GEMV over a float32 ``nn.Linear``'s own weight (no copy), or over a transposed copy
    of a ``Conv1D``'s (``[in, out]`` -> ``[out, in]``); prepared once per module and kept while the module
    lives and its weight is unchanged (the same tensor, the same version)."""
    weight = mod.weight
    key = (weight.data_ptr(), tensor_version(weight), tuple(weight.shape))
    hit = _DENSE.get(mod)
    if hit is None or hit[0] != key:
        w = weight.detach().t().contiguous() if _is_conv1d(mod) else weight.detach()
        full = torch.ones((), dtype=torch.uint8).expand(w.shape)
        hit = (key, klass.from_dense(w, full), w)
        _DENSE[mod] = hit
    return hit[1]


SCREEN_ROWS = 1024
"""The most LM head rows a greedy step computes exactly after the screen (:func:`_screen`); past it the step
runs the whole head (a token whose top logits are that close together)."""

_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SCREEN_CHUNK = 4096  # head rows per float64 block of the screen's bound
_ROW_OPS = {_native.OPS[n] for n in ("bitmask", "nm24", "gemv", "bitmask_gather")}  # a row at a time


def _screen(head: nn.Module, prep) -> tuple | None:
    """The greedy step's screen of a float LM head (``None`` where it does not apply): ``(copy, err)``, the
    head's int8 copy (``native_dense``, int8 codes with row scales, float32 activations) and per row the
    bound ``err[r]`` with ``|L_r - A_r| <= err[r] * ||x||_2`` between the head's logit ``L_r`` and the
    copy's ``A_r``: the quantization error ``||w_r - w^_r||_2`` plus both float32 products' rounding (at
    most ``(n + 4) u`` times ``||w_r||_2 ||x||_2`` and ``||w^_r||_2 ||x||_2``, ``n`` the columns,
    ``u = 2^-24``; the sums in float64, rounded up). Made once per head weight (kept while the module lives
    and its weight is unchanged). Applies to a head without a bias whose batch-1 kernel is a float one
    computing each row alone (bitmask, 2:4, dense, gathered), with finite weights."""
    if getattr(head, "bias", None) is not None or prep.op not in _ROW_OPS or prep.vbf16 not in (0, 1):
        return None  # (vbf16: 0 float32 values, 1 bf16; 2 and 3 are int8 codes)
    sparse = isinstance(head, SparseLinear)
    version = 0 if sparse else tensor_version(head.weight)
    key = (prep.values, prep.meta, prep.op, prep.rows, prep.in_features, version)
    hit = _SCREENS.get(head)
    if hit is None or hit[0] != key:
        hit = (key, _make_screen(head.backend.to_dense() if sparse else head.weight.detach()))
        _SCREENS[head] = hit
    return hit[1]


def _make_screen(weight: torch.Tensor) -> tuple | None:
    """:func:`_screen`'s ``(copy, err)`` for a head weight (``None``: a weight that is not finite)."""
    w = weight.detach().float()
    if not bool(torch.isfinite(w).all()):
        return None
    full = torch.ones((), dtype=torch.uint8).expand(w.shape)
    copy = get_backend("native_dense").from_dense(w, full, values="int8", activations="float32")
    codes, scales = copy.int8_rows()
    u = 2.0**-24 * (w.shape[1] + 4)
    gamma = u / (1 - u)
    err = torch.empty(w.shape[0], dtype=torch.float64)
    for r in range(0, w.shape[0], _SCREEN_CHUNK):  # float64 a block of rows at a time (a large head)
        w64 = w[r : r + _SCREEN_CHUNK].double()
        q64 = codes[r : r + _SCREEN_CHUNK].double() * scales[r : r + _SCREEN_CHUNK].double()[:, None]
        err[r : r + _SCREEN_CHUNK] = (w64 - q64).norm(dim=1) + gamma * (w64.norm(dim=1) + q64.norm(dim=1))
    err = (err * (1 + 1e-6)).float()  # rounded up past float32's rounding of the float64 sums
    err = torch.nextafter(err, torch.full_like(err, float("inf")))
    return copy, err


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise SparsityError(
            f"The native decoding step does not run this model: {reason}. greedy_decode(step='model') runs "
            "any model (the forward loop)."
        )


class NativeDecoder:
    """One native call per decoded token (module docstring): :meth:`start` runs the prompt, :meth:`step`
    each new token; the decoding loops (:mod:`~hf_sparsity.inference.loop`) call them.

    Built per generation (cheap: it points at the model's tensors, nothing is copied); plain float32
    ``nn.Linear`` layers run on the native dense GEMV over their own weight; a plain GPT-2 ``Conv1D`` (stored
    ``[in, out]``) on a transposed copy, made once per weight and kept while the weight lives and is unchanged
    (``sparsify_for_inference`` converts them, and then nothing is copied). Raises
    :class:`~hf_sparsity.utils.SparsityError` with the reason when the model is not supported
    (:func:`native_step_reason`).
    """

    def __init__(self, model: nn.Module, *, check: bool = True, screen_head: bool = True):
        if check:  # greedy_decode checked already
            _refuse(native_step_reason(model))
        self.model = model
        self.screen_head = screen_head
        self.screened: int | None = None
        self.threads = torch.get_num_threads()  # the kernels' threads, whatever torch's are when a step runs
        self._keep: list = []  # prepared structures and dense views the C side points into

    def _call(self, mod: nn.Module) -> tuple[object, int, int | None]:
        """(prepared call, its address, bias address) for a projection / the LM head."""

        if isinstance(mod, SparseLinear):
            prep, addr = mod.backend.decode_call()
            self._keep.append(prep)
        else:  # float32 nn.Linear: the dense GEMV over its own weight (no copy: full mask, contiguous)
            backend = _dense_gemv(mod, get_backend("native_dense"))
            prep, addr = backend.decode_call()
            self._keep += [backend, prep]
        bias = mod.bias.detach() if mod.bias is not None else None
        return prep, addr, _ptr(bias)

    def _build(self, total: int, n: int = 0, old: list | None = None) -> None:
        """The C structures for generations up to ``total`` tokens; ``old`` caches' first ``n`` positions are
        copied into the new ones (a longer generation than the cache first allocated)."""
        with torch_threads(self.threads):  # the prepared calls take torch's thread count as theirs
            self._build_at(total, n, old)

    def _build_at(self, total: int, n: int, old: list | None) -> None:

        parts = _parts(self.model)
        heads, kv, hd = parts.heads, parts.kv, parts.hd
        if parts.rotary is not None:
            pos_ids = torch.arange(total)[None]
            cos, sin = parts.rotary(torch.zeros(1, dtype=torch.float32), position_ids=pos_ids)
            self._rope = (cos[0].float().contiguous(), sin[0].float().contiguous())
        else:
            self._rope = (None, None)
        layers = (_Layer * len(parts.blocks))()
        caches = []
        for i, blk in enumerate(parts.blocks):
            kc = torch.zeros(kv, total, hd)
            vc = torch.zeros(kv, total, hd)
            if old is not None:
                kc[:, :n] = old[2 * i][:, :n]
                vc[:, :n] = old[2 * i + 1][:, :n]
            caches += [kc, vc]
            entry = layers[i]
            for name, mod in blk["proj"].items():
                _, addr, bias = self._call(mod)
                setattr(entry, f"p_{name}", addr)
                setattr(entry, f"b_{name}", bias)
            (w1, b1), (w2, b2) = blk["norms"]
            entry.norm1, entry.norm2 = _ptr(w1.detach()), _ptr(w2.detach())
            entry.nbias1 = _ptr(b1 if b1 is None else b1.detach())
            entry.nbias2 = _ptr(b2 if b2 is None else b2.detach())
            entry.kc, entry.vc = kc.data_ptr(), vc.data_ptr()
            qn, kn = blk.get("qk_norms", (None, None))
            entry.qnorm = _ptr(qn if qn is None else qn.detach())
            entry.knorm = _ptr(kn if kn is None else kn.detach())
        head = self.model.get_output_embeddings()
        head_prep, head_addr, head_bias = self._call(head)
        vocab = int(head.out_features)
        self.logits = torch.empty(vocab)
        fw, fb = parts.final
        table = parts.embed if torch.is_tensor(parts.embed) else None
        codes, scales = (None, None) if table is not None else parts.embed
        dec = _Decoder(
            len(parts.blocks), parts.hidden, heads, kv, hd, parts.ffn, total, vocab, self.threads,
            parts.eps, parts.scale, ctypes.addressof(layers), head_addr, head_bias, _ptr(fw.detach()),
            _ptr(table if table is None else table.detach()), _ptr(self._rope[0]), _ptr(self._rope[1]), None,
            self.logits.data_ptr(), parts.arch, parts.act,
            _ptr(parts.pos_embed if parts.pos_embed is None else parts.pos_embed.detach()),
            _ptr(fb if fb is None else fb.detach()), _ptr(codes), _ptr(scales),
        )  # fmt: skip
        screen = _screen(head, head_prep) if self.screen_head else None
        if screen is not None:  # the greedy step's screen of the head (step(greedy=True))
            copy, err = screen
            prep, addr = copy.decode_call()
            self._cand = torch.empty(SCREEN_ROWS, dtype=torch.int64)
            self._screen_work = torch.empty(2 * vocab, dtype=torch.float64)  # a top-k step's bounds
            self._keep += [copy, prep, err]
            dec.screen, dec.screen_err, dec.cand = addr, err.data_ptr(), self._cand.data_ptr()
            dec.screen_work = self._screen_work.data_ptr()
            dec.screen_cap = SCREEN_ROWS
        self._lib = _native.load()
        self._work = torch.empty(int(self._lib.hfs_decode_work_floats(ctypes.byref(dec))))
        dec.work = self._work.data_ptr()
        self._dec, self._layers, self._caches, self.total = dec, layers, caches, total
        self._embed_rows = int((parts.embed if table is not None else codes).shape[0])

    @torch.inference_mode()
    def start(self, input_ids: torch.Tensor, total: int, limit: int | None = None) -> torch.Tensor:
        """Run the prompt (``[1, n]`` ids) with room for ``total`` tokens; returns the last position's logits
        (float32 ``[vocab]``, a buffer the next :meth:`step` overwrites). :meth:`step` grows the cache past
        ``total`` when asked for a later position, up to ``limit`` tokens when given."""
        from transformers import DynamicCache

        cfg = self.model.config
        n = int(input_ids.shape[1])
        total = max(total, n + 1)
        _refuse(_config_reason(cfg, total))  # the rest of native_step_reason holds since __init__
        self._keep = []
        self._build(total)
        self.pos, self.limit = n, limit
        if n > PROMPT_STEPS:  # the model's forward: batched products; its cache seeds ours
            cache = DynamicCache(config=cfg)
            out = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
            for i in range(len(self._caches) // 2):
                self._caches[2 * i][:, :n] = cache.layers[i].keys[0]
                self._caches[2 * i + 1][:, :n] = cache.layers[i].values[0]
            self.logits.copy_(out.logits[0, -1])
            return self.logits
        prompt = input_ids[0].to(torch.int64).contiguous()  # one token at a time; the LM head for the last
        rows = self._embed_rows
        if not 0 <= int(prompt.min()) <= int(prompt.max()) < rows:
            raise SparsityError(f"Prompt token ids must lie in [0, {rows}): the model's embedding rows.")
        self._lib.hfs_decode_prompt(ctypes.byref(self._dec), prompt.data_ptr(), n, 0)
        return self.logits

    def step(self, token: int, greedy: bool = False, top_k: tuple | None = None) -> int:
        """Decode ``token`` at the next position; the next token's greedy id (:attr:`logits` holds the
        logits, float32 ``[vocab]``). ``greedy=True``: only that id is wanted, so a float LM head runs
        screened (:func:`_screen`, where ``screen_head``): its int8 copy bounds every row's logit, and only
        the rows that can hold the largest are computed exactly, on the head's own kernel (the same id as
        the whole head's ``argmax``, first largest first); :attr:`logits` then holds the exact logits of
        those rows only, and :attr:`screened` says how many there were (-1: the whole head ran).
        ``top_k=(k, penalty, seen address, seen count)``: sampling whose first filter is top-k ``k`` (after
        the repetition penalty ``penalty`` on the int64 ids seen, when > 0): a float head runs screened for
        the rows that can be among top-k's survivors, their exact logits in :attr:`logits` and ``-inf`` in
        every other row (which top-k removes anyway); returns -1 then."""
        if self.pos >= self.total:
            grown = (
                2 * self.total
                if self.limit is None or self.limit <= self.total
                else min(2 * self.total, self.limit)
            )
            _refuse(_config_reason(self.model.config, grown))
            self._keep = []
            self._build(grown, self.pos, self._caches)
        if top_k is not None:
            k, penalty, seen, count = top_k
            self._lib.hfs_decode_step_top_k(ctypes.byref(self._dec), token, self.pos, k, penalty, seen, count)
            best = -1
        else:
            run = self._lib.hfs_decode_step_greedy if greedy else self._lib.hfs_decode_step
            best = int(run(ctypes.byref(self._dec), token, self.pos))
        screened = (greedy or top_k is not None) and self._dec.screen
        self.screened = int(self._dec.screened) if screened else None
        self.pos += 1
        return best

    def close(self) -> None:
        """Drop the cache and the C structures (the model's tensors are untouched)."""
        self._keep, self._caches, self._layers, self._dec = [], [], None, None
