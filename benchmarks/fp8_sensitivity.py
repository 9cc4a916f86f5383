"""Which linear layers make FP8 cost perplexity: SmolLM2 on the shipped sample with W8A8 FP8 applied to
one kind of decoder linear at a time (qkv, o, gate_up, down), to all but one, and to all, on CPU.

A diagnostic, not a product path: the engine refuses ``quantization="fp8"`` without FP8 tensor cores,
so this script lifts that check and runs ``Fp8LinearMethod``'s CPU reference (operands quantized
exactly as on the GPU: e4m3 codes with per-output-channel weight scales and per-token activation
scales, then dequantized and multiplied in float32; ``inference/quantization/fp8.py``). Layers left
out keep their 16-bit weights. ``--weights-only`` leaves the activations unquantized (W8A16).

    python benchmarks/fp8_sensitivity.py --output-json benchmarks/results/fp8_sensitivity_cpu.json

Writes JSON with the command and each variant's perplexity and ratio to the unquantized model.
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

import inference.engine.arg_utils as arg_utils  # noqa: E402
from inference import LLM  # noqa: E402
from inference.model_loader import load_hf_config, resolve_model  # noqa: E402
from inference.quantization import fp8  # noqa: E402
from inference.quantization.perplexity import perplexity, perplexity_tokens  # noqa: E402

KINDS = ("qkv", "o", "gate_up", "down")
_PROCESS, _APPLY = fp8.Fp8LinearMethod.process_weights_after_loading, fp8.Fp8LinearMethod.apply


def layer_kind(hf_config, in_features: int, out_features: int) -> str:
    """Which decoder linear a (single-rank) layer of this shape is."""
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    qkv = (hf_config.num_attention_heads + 2 * hf_config.num_key_value_heads) * head_dim
    kinds = {(hidden, qkv): "qkv", (hidden, hidden): "o", (hidden, 2 * inter): "gate_up", (inter, hidden): "down"}
    return kinds[(in_features, out_features)]


def install(kinds: set[str], hf_config, weights_only: bool) -> None:
    """Patch ``Fp8LinearMethod`` so that only layers of ``kinds`` are quantized (for this process)."""
    def process_some(self, layer) -> None:
        layer.fp8_skipped = layer_kind(hf_config, layer.in_features, layer.out_features) not in kinds
        if not layer.fp8_skipped:
            _PROCESS(self, layer)

    def apply_some(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.fp8_skipped or weights_only:
            w = layer.weight.float() if layer.fp8_skipped else layer.weight.float() * layer.weight_scale[:, None]
            out = torch.matmul(x.float(), w.t()).to(x.dtype)
            return out if layer.fused_bias is None else out + layer.fused_bias.to(out.dtype)
        return _APPLY(self, layer, x)

    fp8.Fp8LinearMethod.process_weights_after_loading = process_some
    fp8.Fp8LinearMethod.apply = apply_some


def measure(model: str, quantization: str | None) -> float:
    llm = LLM(model=model, dtype="float32", max_model_len=1024, quantization=quantization)
    try:
        return perplexity(llm, perplexity_tokens(llm.get_tokenizer()))
    finally:
        llm.close()
        del llm
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weights-only", action="store_true", help="W8A16: activations stay unquantized")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    arg_utils.check_fp8_supported = lambda device: None  # the CPU reference path (see the module docstring)
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": args.model, "weights_only": args.weights_only, "perplexity": {}}
    base = result["perplexity"]["none"] = measure(args.model, None)
    print(f"none: {base:.4f}", flush=True)
    hf_config = load_hf_config(resolve_model(args.model).model_dir)
    variants = [[k] for k in KINDS] + [[k for k in KINDS if k != skip] for skip in ("gate_up",)] + [list(KINDS)]
    for kinds in variants:
        name = "+".join(kinds)
        install(set(kinds), hf_config, args.weights_only)
        value = result["perplexity"][name] = measure(args.model, "fp8")
        print(f"fp8 on {name}: {value:.4f} ({100 * (value / base - 1):+.2f}%)", flush=True)
    result["relative_to_unquantized"] = {k: v / base - 1 for k, v in result["perplexity"].items() if k != "none"}
    out = Path(args.output_json) if args.output_json else Path(__file__).parent / "results" / "fp8_sensitivity_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
