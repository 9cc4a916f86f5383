"""Perplexity of SmolLM2 on the shipped sample (inference/quantization/data/perplexity.txt), unquantized
and quantized, in one run (FP8 needs a GPU with FP8 tensor cores: the H200).

    python benchmarks/perplexity.py --dtype bfloat16 --methods none fp8

Writes JSON with the command to benchmarks/results/perplexity_<device>.json (or --output-json).
"""
from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM  # noqa: E402
from inference.quantization.perplexity import perplexity, perplexity_tokens  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--methods", nargs="+", default=["none", "fp8"], help="'none' is the unquantized model")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "perplexity": {}}
    for method in args.methods:
        llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024,
                  quantization=None if method == "none" else method)
        tokens = perplexity_tokens(llm.get_tokenizer())
        result["perplexity"][method] = perplexity(llm, tokens)
        result["tokens"] = len(tokens)
        print(f"{method}: perplexity {result['perplexity'][method]:.4f} over {len(tokens)} tokens")
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = result["perplexity"].get("none")
    if base:
        result["relative_to_unquantized"] = {m: p / base - 1 for m, p in result["perplexity"].items() if m != "none"}
        print("relative to unquantized:", {m: f"{100 * r:+.2f}%" for m, r in result["relative_to_unquantized"].items()})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(args.output_json) if args.output_json else Path(__file__).parent / "results" / f"perplexity_{device}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
