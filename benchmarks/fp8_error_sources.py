"""Where SmolLM2's FP8 (W8A8, e4m3) perplexity loss comes from, and what error-feedback weight rounding
and SmoothQuant smoothing do to it, on CPU, without reloading the model between variants.

A diagnostic (issue 8), not a product path. The unquantized float32 engine model is loaded once; each
variant rewrites the decoder linears' weights in place and wraps their forward so that the input is
fake-quantized with ``fp8.quantize_fp8_rowwise`` (the function whose numerics the GPU path's Triton
kernel and ``torch._scaled_mm`` scales reproduce: per-token activation scales, per-output-channel
weight scales, amax mapped to 448, round to nearest even).

Variants (``--variants``; all by default):

* ``rtn``: round-to-nearest FP8 weights and activations (what ``Fp8LinearMethod`` does);
  ``rtn_w`` / ``rtn_a``: weights only / activations only, per layer kind with ``--per-kind``.
* ``gptq_w`` / ``gptq``: FP8 weights rounded column by column with GPTQ's error feedback
  (Frantar et al. 2022, arXiv:2210.17323; per-row scale fixed at amax/448, 1% damping), Hessians
  ``X^T X`` from the shipped calibration text (``quantization/data/calibration.txt``, 858 tokens),
  activations unquantized / quantized.
* ``smooth``: SmoothQuant (Xiao et al. 2023, arXiv:2211.10438), alpha 0.5, per-input-channel scales
  ``amax_x^a / amax_w^(1-a)`` applied as ``Q(x / s) @ Q(w * s)^T`` (numerically what folding ``s``
  into the preceding RMSNorm / up_proj / v_proj rows does), with round-to-nearest.

GPTQ here is a Python loop over columns: about 8 minutes on 2 CPU cores for SmolLM2-135M.

    python benchmarks/fp8_error_sources.py --output-json benchmarks/results/fp8_error_sources_cpu.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inference import LLM  # noqa: E402
from inference.quantization.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8_rowwise  # noqa: E402
from inference.quantization.perplexity import perplexity, perplexity_tokens  # noqa: E402
from inference.quantization.quantize import CALIBRATION_TEXT  # noqa: E402

KINDS = {"qkv": "self_attn.qkv_proj", "o": "self_attn.o_proj", "gate_up": "mlp.gate_up_proj", "down": "mlp.down_proj"}
VARIANTS = ("rtn", "rtn_w", "rtn_a", "gptq_w", "gptq", "smooth")


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x [..., C]`` rounded to FP8 per row and dequantized (float32 math, ``x.dtype`` out)."""
    codes, scales = quantize_fp8_rowwise(x.reshape(-1, x.shape[-1]))
    return (codes.float() * scales).reshape(x.shape).to(x.dtype)


@torch.no_grad()
def gptq_fp8(weight: torch.Tensor, H: torch.Tensor, damp: float = 0.01, block: int = 128) -> torch.Tensor:
    """``weight [N, K]`` rounded to FP8 (row scale amax/448) with GPTQ error feedback over ``H [K, K]``;
    returns the dequantized ``[N, K]`` float32 weight."""
    W = weight.float().clone()
    K = W.shape[1]
    s = (W.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    H = H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1, Hi, E = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2], torch.zeros(W.shape[0], i2 - i1)
        for i in range(i2 - i1):
            w = W1[:, i]
            q = ((w[:, None] / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * s)[:, 0]
            Q[:, i1 + i] = q
            err = (w - q) / Hi[i, i]
            W1[:, i:] -= err[:, None] @ Hi[i, i:][None, :]
            E[:, i] = err
        W[:, i2:] -= E @ Hinv[i1:i2, i2:]
    return Q


class Harness:
    """The float32 engine model with its decoder linears' weights and inputs rewritable per variant."""

    def __init__(self, model_name: str) -> None:
        self.llm = LLM(model=model_name, dtype="float32", max_model_len=1024)
        model = self.llm.llm_engine.runner.model
        self.mods = {(k, i): model.get_submodule(f"model.layers.{i}.{p}")
                     for k, p in KINDS.items() for i in range(len(model.model.layers))}
        self.orig_w = {key: m.weight.data.clone() for key, m in self.mods.items()}
        self.orig_f = {key: m.forward for key, m in self.mods.items()}
        tokenizer = self.llm.get_tokenizer()
        self.tokens = perplexity_tokens(tokenizer)
        self.calibration = tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
        self.H: dict = {}
        self.amax: dict = {}

    def calibrate(self) -> None:
        """Hessians ``X^T X`` and per-channel input maxima of every linear on the calibration text."""
        for key, m in self.mods.items():
            def forward(x, key=key, f=self.orig_f[key]):
                x2 = x.reshape(-1, x.shape[-1]).float()
                self.H[key] = self.H.get(key, 0) + x2.t() @ x2
                self.amax[key] = torch.maximum(self.amax.get(key, torch.zeros(x2.shape[1])), x2.abs().amax(0))
                return f(x)
            m.forward = forward
        perplexity(self.llm, self.calibration)
        self.restore()

    def restore(self) -> None:
        for key, m in self.mods.items():
            m.weight.data.copy_(self.orig_w[key])
            m.forward = self.orig_f[key]

    def apply(self, kinds, weights: str | None, acts: bool, alpha: float | None = None) -> None:
        """Quantize the linears of ``kinds``: weights ``"rtn"``/``"gptq"``/None, activations or not."""
        self.restore()
        for key, m in self.mods.items():
            if key[0] not in kinds:
                continue
            w, smooth = self.orig_w[key], None
            if alpha is not None:
                smooth = (self.amax[key].clamp(min=1e-5) ** alpha
                          / w.abs().amax(0).clamp(min=1e-5) ** (1 - alpha))
                w = w * smooth[None, :]
            if weights == "rtn":
                w = fake_fp8(w)
            elif weights == "gptq":
                H = self.H[key] if smooth is None else self.H[key] / smooth[:, None] / smooth[None, :]
                w = gptq_fp8(w, H)
            m.weight.data.copy_(w if smooth is None else w / smooth[None, :])
            if acts:
                f = self.orig_f[key]
                m.forward = ((lambda x, f=f: f(fake_fp8(x))) if smooth is None
                             else (lambda x, f=f, s=smooth: f(fake_fp8(x / s) * s)))

    def perplexity(self) -> float:
        return perplexity(self.llm, self.tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--per-kind", action="store_true", help="rtn/rtn_w/rtn_a also on each layer kind alone")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    harness = Harness(args.model)
    result = {"command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": args.model, "tokens": len(harness.tokens), "calibration_tokens": len(harness.calibration),
              "perplexity": {}}
    base = result["perplexity"]["none"] = harness.perplexity()
    print(f"none: {base:.4f}", flush=True)
    if any(v.startswith(("gptq", "smooth")) for v in args.variants):
        harness.calibrate()
    spec = {"rtn": ("rtn", True, None), "rtn_w": ("rtn", False, None), "rtn_a": (None, True, None),
            "gptq_w": ("gptq", False, None), "gptq": ("gptq", True, None), "smooth": ("rtn", True, 0.5)}
    runs = [(v, list(KINDS)) for v in args.variants]
    if args.per_kind:
        runs += [(f"{v}:{k}", [k]) for v in ("rtn", "rtn_w", "rtn_a") if v in args.variants for k in KINDS]
    for name, kinds in runs:
        weights, acts, alpha = spec[name.split(":")[0]]
        start = time.perf_counter()
        harness.apply(kinds, weights, acts, alpha)
        value = result["perplexity"][name] = harness.perplexity()
        print(f"{name}: {value:.4f} ({100 * (value / base - 1):+.2f}%, {time.perf_counter() - start:.0f} s)", flush=True)
    harness.llm.close()
    result["relative_to_unquantized"] = {k: v / base - 1 for k, v in result["perplexity"].items() if k != "none"}
    out = Path(args.output_json) if args.output_json else Path(__file__).parent / "results" / "fp8_error_sources_cpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
