"""Write a Llama-shaped model as GGUF (F32 and Q8_0) for the llama.cpp rows of ``benchmarks/decode.py``.

    python benchmarks/gguf_export.py llama1b OUT_DIR     # decode.py's random 1B shape (the same weights)
    python benchmarks/gguf_export.py MODEL_DIR OUT_DIR   # an HF Llama folder (fp32)

Writes ``OUT_DIR/<name>-f32.gguf`` and ``OUT_DIR/<name>-q8_0.gguf`` with the ``gguf`` package's writer:
the llama tensor names, q / k rows permuted as llama.cpp's converter does (llama.cpp's rotary embedding
pairs adjacent dimensions, transformers' pairs the two halves), Q8_0 by ``gguf.quants`` (every 2-D
tensor; norms stay F32). The vocabulary is a placeholder of the model's size: the benchmark feeds and
reads token ids, so greedy decoding over the same weights yields the same ids in both engines. For a
real model with its tokenizer, llama.cpp's own ``convert_hf_to_gguf.py`` does the same job.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str, qtype: str) -> None:
    import gguf
    from gguf.quants import quantize

    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base((cfg.rope_parameters or {}).get("rope_theta", 10000.0))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "q8_0" else gguf.LlamaFileType.ALL_F32)
    n = cfg.vocab_size
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{i:02X}>" for i in range(256)]]
    tokens += [f"t{i}" for i in range(len(tokens), n)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (n - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:n])
    w.add_token_scores([0.0] * n)
    w.add_token_types(types[:n])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    tensors = {
        "token_embd.weight": model.model.embed_tokens.weight,
        "output_norm.weight": model.model.norm.weight,
    }
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.model.layers):
        for hf, gg in names.items():
            t = layer.get_submodule(hf).weight
            if hf.endswith("q_proj"):
                t = torch.from_numpy(_permute(t.detach().numpy(), heads))
            elif hf.endswith("k_proj"):
                t = torch.from_numpy(_permute(t.detach().numpy(), kv))
            tensors[f"blk.{i}.{gg}.weight"] = t
    for name, t in tensors.items():
        a = t.detach().float().contiguous().numpy()
        if qtype == "q8_0" and a.ndim == 2:
            w.add_tensor(
                name, quantize(a, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="'llama1b' (decode.py's random shape) or an HF Llama folder")
    p.add_argument("out_dir")
    p.add_argument("--types", default="f32,q8_0")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from decode import build_random  # the same seed and shape as the benchmark's row

    if os.path.isdir(args.model):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        name = os.path.basename(os.path.normpath(args.model))
    else:
        model, name = build_random(args.model), args.model
    os.makedirs(args.out_dir, exist_ok=True)
    for qtype in args.types.split(","):
        path = os.path.join(args.out_dir, f"{name}-{qtype}.gguf")
        write_gguf(model, path, qtype)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
