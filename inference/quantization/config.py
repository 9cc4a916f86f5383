"""Which quantization a model runs with: the user's ``quantization`` argument and the checkpoint's
``quantization_config`` (config.json), reconciled into one frozen ``QuantizationConfig``.

Published formats read (and written by ``manage.py quantize``):

* AWQ (``quant_method: "awq"``, ``version``/``format: "gemm"``): 4-bit, asymmetric (zero points),
  ``group_size`` 32/64/128 or -1 (one group per output channel).
* GPTQ (``quant_method: "gptq"``, ``checkpoint_format``/``format: "gptq"``, the v1 layout):
  4-bit, symmetric or not, with or without act-order (``desc_act``).

FP8 is not a checkpoint format here: ``quantization="fp8"`` quantizes a bf16/fp16 checkpoint at load.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidRequestError, ModelLoadError

QUANTIZATION_METHODS = ("awq", "gptq", "fp8")
DUMMY_GROUP_SIZE = 128  # group size of random quantized weights (load_format="dummy" without a config)


@dataclass(frozen=True)
class QuantizationConfig:
    """A model's quantization.

    Attributes:
        method: ``"awq"``, ``"gptq"`` or ``"fp8"``.
        bits: weight bits (4 for AWQ/GPTQ, 8 for FP8).
        group_size: input channels sharing one scale (and zero point); -1 = the whole input
            dimension (per output channel). Unused by FP8 (per-channel weight scales).
        zero_point: AWQ's asymmetric zero points (always true for AWQ GEMM checkpoints).
        sym: GPTQ symmetric quantization (zero point 8 everywhere).
        desc_act: GPTQ act-order: columns quantized by decreasing Hessian diagonal; rows of a
            group are then scattered over the input dimension (``g_idx``), unless ``static_groups``.
        static_groups: GPTQ act-order with each group's parameters fixed before the columns are visited
            (AutoGPTQ's option): groups stay runs of consecutive input rows, the layout without act-order.
        from_checkpoint: the weights on disk are already quantized (AWQ/GPTQ); false for FP8
            (quantized at load) and for random weights.
    """

    method: str
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    sym: bool = True
    desc_act: bool = False
    from_checkpoint: bool = True
    static_groups: bool = False

    @property
    def scattered_groups(self) -> bool:
        """GPTQ groups whose input rows are scattered (``g_idx`` not ``row // group_size``)."""
        return self.desc_act and not self.static_groups

    def to_hf_dict(self) -> dict:
        """The ``quantization_config`` entry of config.json that transformers and vLLM read."""
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                    "zero_point": self.zero_point, "version": "gemm", "modules_to_not_convert": None}
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                    "desc_act": self.desc_act, "sym": self.sym, "true_sequential": False,
                    "damp_percent": 0.1, "static_groups": self.static_groups, "checkpoint_format": "gptq"}
        raise ValueError(f"{self.method} has no checkpoint format")


def _checkpoint_config(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc if isinstance(qc, dict) else qc.to_dict())


def _from_checkpoint(qc: dict) -> QuantizationConfig:
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ModelLoadError(
            f"The checkpoint's quantization_config has quant_method={method!r}; Tessera reads 'awq' and 'gptq' "
            "checkpoints (for FP8, pass quantization='fp8' with an unquantized bf16/fp16 checkpoint).",
            param="quantization")
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits != 4:
        raise ModelLoadError(f"quantization_config.bits={bits}: only 4-bit {method.upper()} is supported.",
                             param="quantization")
    if group_size != -1 and group_size <= 0:
        raise ModelLoadError(f"quantization_config.group_size={group_size}: must be positive or -1.",
                             param="quantization")
    if method == "awq":
        version = str(qc.get("version", qc.get("format", "gemm"))).lower()
        if version != "gemm" or not qc.get("zero_point", True):
            raise ModelLoadError(f"AWQ checkpoint with version={version!r}, zero_point={qc.get('zero_point')}: "
                                 "only the GEMM layout with zero points is supported.", param="quantization")
        return QuantizationConfig("awq", bits, group_size, zero_point=True)
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt != "gptq":
        raise ModelLoadError(f"GPTQ checkpoint_format={fmt!r}: only 'gptq' (the v1 layout) is supported.",
                             param="quantization")
    return QuantizationConfig("gptq", bits, group_size, zero_point=False, sym=bool(qc.get("sym", True)),
                              desc_act=bool(qc.get("desc_act", False)),
                              static_groups=bool(qc.get("static_groups", False)))


def resolve_quantization(requested: str | None, hf_config, load_format: str = "auto") -> QuantizationConfig | None:
    """The quantization to run with, or None for none.

    Args:
        requested: the user's ``quantization`` (None = whatever config.json says).
        hf_config: the model's transformers config (``quantization_config`` read when present).
        load_format: ``"dummy"`` allows ``awq``/``gptq`` without a quantized checkpoint (random
            packed weights, group size 128, for benchmarks).
    Raises:
        InvalidRequestError (param ``"quantization"``): an unknown method, a method that contradicts
            the checkpoint's, or ``awq``/``gptq`` for an unquantized checkpoint.
        ModelLoadError (param ``"quantization"``): a checkpoint format that is not supported.
    """
    if requested is not None:
        requested = requested.lower()
        if requested not in QUANTIZATION_METHODS:
            raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got "
                                      f"{requested!r}.", param="quantization")
    qc = _checkpoint_config(hf_config)
    if load_format == "dummy":
        if requested in ("awq", "gptq"):
            return _from_checkpoint(qc) if qc else QuantizationConfig(requested, group_size=DUMMY_GROUP_SIZE,
                                                                      zero_point=requested == "awq",
                                                                      from_checkpoint=False)
        qc = None  # random weights: a checkpoint's own config does not apply
    if qc is not None:
        found = _from_checkpoint(qc)
        if requested not in (None, found.method):
            raise InvalidRequestError(f"quantization={requested!r} contradicts the checkpoint, which is "
                                      f"{found.method.upper()}-quantized (config.json quantization_config).",
                                      param="quantization")
        return found
    if requested in ("awq", "gptq"):
        raise InvalidRequestError(
            f"quantization={requested!r} needs {'an AWQ' if requested == 'awq' else 'a GPTQ'} checkpoint (a "
            "quantization_config in "
            f"config.json); this one is not quantized. Make one with `python manage.py quantize --model ... "
            f"--output-dir ... --quantization {requested}`, or, on a GPU with FP8 tensor cores (compute "
            "capability >= 8.9), use quantization='fp8' (quantized at load).",
            param="quantization")
    if requested == "fp8":
        return QuantizationConfig("fp8", bits=8, group_size=-1, zero_point=False, from_checkpoint=False)
    return None
