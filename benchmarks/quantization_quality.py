"""AWQ and GPTQ against round-to-nearest at the same group size and format, on the packaged SmolLM2: perplexity
on the shipped sample through the engine, and each linear's output error on the calibration activations it
was quantized from (what GPTQ and AWQ minimise), per projection type and per layer; and each whole layer's
error relative to its residual update on the calibration text and on the held-out perplexity sample (a gap
between the two is a method fitting the 858-token calibration text). One run, CPU.

    python benchmarks/quantization_quality.py --output-json benchmarks/results/quantization-quality_cpu_<date>.json

Methods (``--methods``), all through ``manage.py quantize``'s code at its defaults (groups of 64 on SmolLM2,
16 x 256 calibration tokens):
  awq        AWQ (asymmetric, integer zero points)    awq-rtn    min-max rounding in AWQ's format
  gptq       GPTQ (symmetric)                         gptq-rtn   min-max rounding in GPTQ's symmetric format
  gptq-act-order  GPTQ with ``--desc-act``       gptq-static-groups  with ``--desc-act --static-groups``
AWQ's search takes about half an hour on 2 CPU cores; ``--quantize-device cuda`` where a GPU is at hand.
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

from provenance import current_commit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM  # noqa: E402
from inference.model_loader import load_tokenizer, resolve_model  # noqa: E402
from inference.quantization.layer_error import LayerErrors  # noqa: E402
from inference.quantization.perplexity import perplexity, perplexity_tokens  # noqa: E402
from inference.quantization.quantize import quantize_model  # noqa: E402

METHODS = {  # name: (format, desc_act, static_groups, round_to_nearest)
    "awq-rtn": ("awq", False, False, True), "awq": ("awq", False, False, False),
    "gptq-rtn": ("gptq", False, False, True), "gptq": ("gptq", False, False, False),
    "gptq-act-order": ("gptq", True, False, False), "gptq-static-groups": ("gptq", True, True, False)}
BASELINE = {"awq": "awq-rtn", "gptq": "gptq-rtn", "gptq-act-order": "gptq-rtn", "gptq-static-groups": "gptq-rtn"}


def _perplexity(model: str) -> tuple[float, int]:
    llm = LLM(model=model, max_model_len=1024)
    tokens = perplexity_tokens(llm.get_tokenizer())
    value = perplexity(llm, tokens)
    del llm
    gc.collect()
    return value, len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--quantize-device", default="cpu")
    parser.add_argument("--output-json", required=True)
    args = parser.parse_args()
    commit = current_commit()
    result = {"command": "python " + shlex.join(sys.argv), "commit": commit, "model": args.model,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": "cpu",
              "perplexity": {}, "quantize_seconds": {}, "layer_error_by_type": {}, "layer_error_by_layer": {},
              "layer_residual_error": {}}
    result["perplexity"]["none"], result["tokens"] = _perplexity(args.model)
    # held-out text for the whole-layer errors: the perplexity sample, in 8 rows of 252 tokens
    held_out_ids = torch.tensor(perplexity_tokens(load_tokenizer(resolve_model(args.model).tokenizer_dir))[:2016])
    held_out_ids = held_out_ids.view(8, 252)
    print(f"none: perplexity {result['perplexity']['none']:.3f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="tessera-quality-") as scratch:
        for method in args.methods:
            fmt, desc_act, static_groups, rtn = METHODS[method]
            errors = LayerErrors(held_out_ids=held_out_ids)
            start = time.perf_counter()
            folder = quantize_model(args.model, Path(scratch) / method, fmt, desc_act=desc_act,
                                    static_groups=static_groups,
                                    device=args.quantize_device, round_to_nearest=rtn, layer_errors=errors)
            result["quantize_seconds"][method] = round(time.perf_counter() - start, 1)
            result["layer_error_by_type"][method] = errors.by_type()
            result["layer_error_by_layer"][method] = errors.by_layer()
            for split in ("calibration", "held_out"):
                per_layer = errors.residual_by_layer(split)
                result["layer_residual_error"].setdefault(split, {})[method] = {
                    "mean": sum(per_layer) / len(per_layer), "by_layer": per_layer}
            result["perplexity"][method], _ = _perplexity(str(folder))
            print(f"{method}: perplexity {result['perplexity'][method]:.3f}, quantized in "
                  f"{result['quantize_seconds'][method]} s, mean layer error calibration / held-out "
                  f"{result['layer_residual_error']['calibration'][method]['mean']:.4f} / "
                  f"{result['layer_residual_error']['held_out'][method]['mean']:.4f}; linear error by type "
                  + ", ".join(f"{k} {v:.4f}" for k, v in result["layer_error_by_type"][method].items()), flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    result["against_round_to_nearest"] = {
        method: {"perplexity": result["perplexity"][method] / result["perplexity"][base],
                 "layer_error_by_type": {k: v / result["layer_error_by_type"][base][k]
                                         for k, v in result["layer_error_by_type"][method].items()}}
        for method, base in BASELINE.items() if method in result["perplexity"] and base in result["perplexity"]}
    for method, ratios in result["against_round_to_nearest"].items():
        print(f"{method} / {BASELINE[method]}: perplexity {ratios['perplexity']:.3f}x, layer error "
              + ", ".join(f"{k} {v:.2f}x" for k, v in ratios["layer_error_by_type"].items()))
    Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
