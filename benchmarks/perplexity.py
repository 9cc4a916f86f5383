"""Perplexity of SmolLM2 on the shipped sample (inference/quantization/data/perplexity.txt), unquantized
and quantized, in one run (FP8 needs a GPU with FP8 tensor cores: the H200).

    python benchmarks/perplexity.py --dtype bfloat16 --methods none fp8
    python benchmarks/perplexity.py --methods none awq gptq --output-json benchmarks/results/perplexity_quantized_cpu.json
    python benchmarks/perplexity.py --methods none awq --checkpoint awq=/path/to/awq-checkpoint

``none`` is the unquantized model and ``fp8`` quantizes it at load. ``awq`` and ``gptq`` evaluate a
checkpoint: the one given by ``--checkpoint METHOD=DIR``, or else one made here from ``--model`` by
the code behind ``manage.py quantize`` (default settings; written to a temporary directory).

Writes JSON with the command to benchmarks/results/perplexity_<device>.json (or --output-json).
"""
from __future__ import annotations

import argparse
import gc
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM  # noqa: E402
from inference.quantization.perplexity import perplexity, perplexity_tokens  # noqa: E402
from inference.quantization.quantize import quantize_model  # noqa: E402

CHECKPOINT_METHODS = ("awq", "gptq")


def _checkpoints(pairs: list[str]) -> dict[str, str]:
    checkpoints = {}
    for pair in pairs:
        method, sep, folder = pair.partition("=")
        if not sep or method not in CHECKPOINT_METHODS:
            raise SystemExit(f"--checkpoint takes METHOD=DIR with METHOD one of {CHECKPOINT_METHODS}, got {pair!r}")
        checkpoints[method] = folder
    return checkpoints


def _engine(args, method: str, checkpoints: dict[str, str], scratch: Path, result: dict) -> LLM:
    """The LLM for ``method``; makes the AWQ/GPTQ checkpoint first when none was given."""
    if method not in CHECKPOINT_METHODS:
        return LLM(model=args.model, dtype=args.dtype, max_model_len=1024,
                   quantization=None if method == "none" else method)
    if method not in checkpoints:
        start = time.perf_counter()
        checkpoints[method] = str(quantize_model(args.model, scratch / method, method, device=args.quantize_device))
        result["quantize_seconds"][method] = round(time.perf_counter() - start, 1)
    result["checkpoints"][method] = checkpoints[method]
    return LLM(model=checkpoints[method], dtype=args.dtype, max_model_len=1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--methods", nargs="+", default=["none", "fp8"],
                        choices=["none", "fp8", *CHECKPOINT_METHODS], help="'none' is the unquantized model")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="METHOD=DIR",
                        help="an existing AWQ/GPTQ checkpoint to evaluate instead of quantizing --model here")
    parser.add_argument("--quantize-device", default="cpu", help="where quantize_model runs the float model")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    checkpoints = _checkpoints(args.checkpoint)
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "model": args.model,
              "perplexity": {}, "checkpoints": {}, "quantize_seconds": {}}
    with tempfile.TemporaryDirectory(prefix="tessera-perplexity-") as scratch:
        for method in args.methods:
            llm = _engine(args, method, checkpoints, Path(scratch), result)
            tokens = perplexity_tokens(llm.get_tokenizer())
            result["perplexity"][method] = perplexity(llm, tokens)
            result["tokens"] = len(tokens)
            print(f"{method}: perplexity {result['perplexity'][method]:.4f} over {len(tokens)} tokens", flush=True)
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
