"""Quantize a GGUF file with llama.cpp's own quantizer, for the llama.cpp rows of the decoding benchmarks.

    python benchmarks/gguf_quantize.py GGUF_DIR/smol-f32.gguf Q8_0 Q4_0 Q4_K_M

Writes ``GGUF_DIR/smol-q8_0.gguf`` etc. beside the input (its name with ``-f32`` replaced by the type) through
``llama_cpp.llama_model_quantize`` (``llama-cpp-python``, an optional benchmark dependency: ``pip install
llama-cpp-python`` builds llama.cpp from source), as llama.cpp's ``llama-quantize`` does. The F32 input comes
from llama.cpp's ``convert_hf_to_gguf.py MODEL_DIR --outtype f32`` (a real model with its tokenizer) or
``benchmarks/gguf_export.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", help="an F32 (or F16) GGUF file")
    p.add_argument("types", nargs="+", help="llama.cpp file types: Q8_0, Q4_0, Q4_K_M, ...")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    import llama_cpp  # optional benchmark dependency

    stem = os.path.basename(args.gguf).removesuffix(".gguf").removesuffix("-f32")
    for qtype in args.types:
        ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
        if ftype is None:
            p.error(
                f"{qtype!r} is no llama.cpp file type (LLAMA_FTYPE_MOSTLY_{qtype.upper()} does not exist)"
            )
        out = os.path.join(os.path.dirname(os.path.abspath(args.gguf)), f"{stem}-{qtype.lower()}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.nthread = ftype, args.threads
        t = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(args.gguf.encode(), out.encode(), ctypes.byref(params))
        if rc != 0:
            print(f"llama.cpp's quantizer failed on {qtype} (return code {rc})", file=sys.stderr)
            return 1
        print(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB) in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
