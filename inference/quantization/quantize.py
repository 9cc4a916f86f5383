"""Produce AWQ and GPTQ checkpoints: calibrate on the text shipped in ``data/``, quantize each decoder
layer in turn, and write the published on-disk format (see ``packing``) with its
``quantization_config``, which this engine and transformers (with GPTQModel installed) both read.

The float model runs in transformers on the CPU (or ``device``). Layers are processed sequentially:
each layer's linears see the inputs produced by the already-quantized layers before it (as in
AutoAWQ and GPTQ's reference code); within a layer all linears are calibrated on the float layer's
activations.

A GGUF source whose linears are already quantized (the packaged SmolLM2 is Q4_1: 4-bit blocks of 32
with a fractional minimum) cannot be reproduced by AWQ/GPTQ's integer zero points; the error compounds,
and ``quantize_model`` warns (see docs/quantization.md for the measured cost).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import InvalidRequestError
from ..model_loader import check_architecture, load_hf_config, load_tokenizer, resolve_model
from ..model_loader.sources import ResolvedModel, find_packaged_gguf
from . import awq, gptq, packing
from .config import QuantizationConfig, _checkpoint_config
from .layer_error import LayerErrors

logger = logging.getLogger(__name__)
DATA_DIR = Path(__file__).parent / "data"
CALIBRATION_TEXT = DATA_DIR / "calibration.txt"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class CalibrationConfig:
    """How much shipped calibration text to use (``num_samples`` sequences of ``seq_len`` tokens) and
    how finely AWQ searches (``awq_grid`` scale exponents, the paper's 20; half as many clipping ratios)."""

    num_samples: int = 16
    seq_len: int = 256
    awq_grid: int = awq.N_GRID


def calibration_batch(tokenizer, calibration: CalibrationConfig) -> torch.Tensor:
    """``[num_samples, seq_len]`` int64 token ids cut from ``data/calibration.txt`` (wrapping around)."""
    ids = tokenizer.encode(CALIBRATION_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    need = calibration.num_samples * calibration.seq_len
    ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor(ids, dtype=torch.int64).view(calibration.num_samples, calibration.seq_len)


def default_group_size(hf_config) -> int:
    """The largest of 128, 64, 32 that divides every linear layer's input features (SmolLM2's 576 needs 64)."""
    sizes = [hf_config.hidden_size, hf_config.intermediate_size,
             hf_config.num_attention_heads * (getattr(hf_config, "head_dim", None)
                                              or hf_config.hidden_size // hf_config.num_attention_heads)]
    for group in (128, 64, 32):
        if all(size % group == 0 for size in sizes):
            return group
    return -1


def quantized_source_types(resolved: ResolvedModel) -> set[str]:
    """GGUF tensor types other than F32/F16/BF16 among the source's decoder-layer weights (e.g. ``{"Q4_1"}``
    for the packaged SmolLM2); empty for a Hugging Face directory or an unquantized GGUF."""
    if resolved.source not in ("gguf", "packaged"):
        return set()
    import gguf

    path = find_packaged_gguf() if resolved.source == "packaged" else Path(resolved.name).expanduser()
    reader = gguf.GGUFReader(str(path))
    return {tensor.tensor_type.name for tensor in reader.tensors
            if tensor.name.startswith("blk.") and tensor.tensor_type.name not in ("F32", "F16", "BF16")}


class _Stop(Exception):
    pass


def _first_layer_inputs(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    captured = {}

    def hook(module, args, kwargs):
        captured["hidden"] = args[0] if args else kwargs.pop("hidden_states")
        captured["kwargs"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return captured["hidden"], captured["kwargs"]


def _run_layer(layer, hidden: torch.Tensor, kwargs: dict, record: dict | None = None) -> torch.Tensor:
    handles = []
    if record is not None:
        for name in LINEARS:
            module = layer.self_attn if name in LINEARS[:4] else layer.mlp
            handles.append(getattr(module, name).register_forward_pre_hook(
                lambda m, args, name=name: record.__setitem__(name, args[0].reshape(-1, args[0].shape[-1]))))
    try:
        out = layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def quantize_model(model: str, output_dir: str | Path, method: str, group_size: int | None = None,
                   desc_act: bool = False, static_groups: bool = False,
                   calibration: CalibrationConfig = CalibrationConfig(),
                   device: str = "cpu", round_to_nearest: bool = False,
                   layer_errors: LayerErrors | None = None) -> Path:
    """Quantize ``model`` with AWQ or GPTQ (4-bit) and write the checkpoint to ``output_dir``.

    Args:
        model: what the engine accepts: the packaged model name, a Hugging Face directory or a .gguf file.
        method: ``"awq"`` or ``"gptq"``.
        group_size: input channels per scale (None: the largest of 128/64/32 dividing the layers; -1:
            per output channel).
        desc_act: GPTQ act-order.
        static_groups: with ``desc_act``, each group's scale and zero point fixed from the float weights
            before the columns are visited: groups stay consecutive rows (no permutation when served).
        round_to_nearest: skip AWQ's scale and clipping search and GPTQ's error feedback: min-max rounding
            per group in the same format (AWQ's asymmetric, GPTQ's symmetric), the baseline both improve on.
        layer_errors: filled with each linear's output error on the calibration activations it was
            quantized from, and each layer's on the calibration text and on ``layer_errors.held_out_ids``
            (:class:`~.layer_error.LayerErrors`).
    Returns:
        ``output_dir``, holding config.json (with ``quantization_config``), model.safetensors and the tokenizer.
    Raises:
        InvalidRequestError: a bad ``method`` / ``group_size`` / ``desc_act``; ModelLoadError: a bad ``model``.
    """
    from transformers import AutoModelForCausalLM

    if method not in ("awq", "gptq"):
        raise InvalidRequestError(f"quantization must be 'awq' or 'gptq', got {method!r}.", param="quantization")
    if desc_act and method != "gptq":
        raise InvalidRequestError("desc_act (act-order) applies to GPTQ only.", param="desc_act")
    if static_groups and not desc_act:
        raise InvalidRequestError("static_groups applies to GPTQ with desc_act (act-order).", param="static_groups")
    resolved = resolve_model(model)
    config = load_hf_config(resolved.model_dir)
    check_architecture(config)
    existing = _checkpoint_config(config)
    if existing:
        raise InvalidRequestError(f"{model} is already quantized (quant_method {existing.get('quant_method')!r}); "
                                  "quantize an unquantized checkpoint.", param="model")
    positions = getattr(config, "max_position_embeddings", None)
    if calibration is not None and positions and calibration.seq_len > positions:
        raise InvalidRequestError(f"seq_len={calibration.seq_len} is longer than the model's {positions} positions "
                                  "(max_position_embeddings).", param="seq_len")
    group_size = default_group_size(config) if group_size is None else group_size
    for size in (config.hidden_size, config.intermediate_size):
        if group_size != -1 and (group_size <= 0 or size % group_size or group_size % 16):
            raise InvalidRequestError(f"group_size={group_size} must be -1 or a multiple of 16 dividing the layers' "
                                      f"input features ({config.hidden_size}, {config.intermediate_size}).",
                                      param="group_size")
    already = quantized_source_types(resolved)
    if already:
        logger.warning("%s: the source's linear layers are already quantized (GGUF %s); 4-bit %s with integer "
                       "zero points cannot reproduce them, so the error compounds (perplexity well above the "
                       "source's). Quantize a 16-bit checkpoint for the best quality.", model,
                       ", ".join(sorted(already)), method.upper())
    hf_model = AutoModelForCausalLM.from_pretrained(str(resolved.model_dir), dtype=torch.float32,
                                                    local_files_only=True).to(device).eval()
    qconfig = QuantizationConfig(method, group_size=group_size, zero_point=method == "awq", sym=True,
                                 desc_act=desc_act, static_groups=static_groups)
    tokenizer = load_tokenizer(resolved.tokenizer_dir)
    hidden, kwargs = _first_layer_inputs(hf_model, calibration_batch(tokenizer, calibration).to(device))
    held_out = None  # (hidden, kwargs) of held-out text through the layers quantized so far
    if layer_errors is not None and layer_errors.held_out_ids is not None:
        held_out = _first_layer_inputs(hf_model, layer_errors.held_out_ids.to(device))
    results: dict[str, tuple] = {}
    for index, layer in enumerate(hf_model.model.layers):
        inputs: dict[str, torch.Tensor] = {}
        float_output = _run_layer(layer, hidden, kwargs, record=inputs)
        held_float = _run_layer(layer, *held_out) if held_out is not None else None
        # the float weights the quantized ones stand for (AWQ: once its scales are folded)
        float_weights = {name: _linear(layer, name).weight.detach().clone() for name in LINEARS}
        if round_to_nearest:
            layer_results = _round_to_nearest_layer(layer, qconfig)
        elif method == "awq":
            layer_results = awq.quantize_layer(layer, inputs, group_size, calibration.awq_grid, float_weights)
        else:
            layer_results = _gptq_layer(layer, inputs, qconfig)
        if layer_errors is not None:
            for name in LINEARS:
                layer_errors.add(index, name, inputs[awq.SHARED_INPUTS.get(name, name)], float_weights[name],
                                 _linear(layer, name).weight)
        for name, result in layer_results.items():
            module = "self_attn" if name in LINEARS[:4] else "mlp"
            results[f"model.layers.{index}.{module}.{name}"] = result
        quantized_output = _run_layer(layer, hidden, kwargs)
        if layer_errors is not None:
            layer_errors.add_residual(index, "calibration", hidden, float_output, quantized_output)
        if held_out is not None:
            held_quantized = _run_layer(layer, *held_out)
            layer_errors.add_residual(index, "held_out", held_out[0], held_float, held_quantized)
            held_out = (held_quantized, held_out[1])
        hidden = quantized_output
        logger.info("%s: quantized layer %d/%d", method.upper(), index + 1, len(hf_model.model.layers))
    return write_checkpoint(hf_model, results, qconfig, tokenizer, Path(output_dir))


def _linear(layer, name: str):
    return getattr(layer.self_attn if name in LINEARS[:4] else layer.mlp, name)


@torch.no_grad()
def _round_to_nearest_layer(layer, qconfig: QuantizationConfig) -> dict[str, tuple]:
    """Min-max rounding of each linear of one layer, in place (weights replaced by their 4-bit values)."""
    result = {}
    for name in LINEARS:
        linear = _linear(layer, name)
        result[name] = awq.round_to_nearest(linear.weight, qconfig.group_size, sym=qconfig.method == "gptq")
        linear.weight.copy_(packing.dequantize(*result[name]).t().to(linear.weight.dtype))
    return result


def _gptq_layer(layer, inputs: dict[str, torch.Tensor], qconfig: QuantizationConfig) -> dict[str, tuple]:
    """GPTQ the linears of one layer; those reading the same input (Q/K/V, gate/up) share one Hessian
    and are quantized as one matrix (GPTQ treats every output row on its own, so this is exact)."""
    attn, mlp = layer.self_attn, layer.mlp
    fused = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
    result = {}
    for names in fused:
        linears = [getattr(attn if name in LINEARS[:4] else mlp, name) for name in names]
        weight = torch.cat([linear.weight for linear in linears])
        codes, scales, zeros, g_idx = gptq.gptq_quantize(weight, gptq.hessian(inputs[names[0]]), qconfig.group_size,
                                                         qconfig.sym, qconfig.desc_act, qconfig.static_groups)
        start = 0
        for name, linear in zip(names, linears):
            rows = slice(start, start + linear.weight.shape[0])
            start = rows.stop
            result[name] = (codes[:, rows], scales[:, rows], zeros[:, rows], g_idx)
            linear.weight.copy_(packing.dequantize(*result[name]).t().to(linear.weight.dtype))
    return result


def pack_linear(method: str, codes, scales, zeros, g_idx) -> dict[str, torch.Tensor]:
    """One linear layer's tensors in the published format (names without the module prefix)."""
    if method == "awq":
        return {"qweight": packing.pack_awq(codes), "qzeros": packing.pack_awq(zeros),
                "scales": scales.to(torch.float16)}
    return {"qweight": packing.pack_gptq_qweight(codes), "qzeros": packing.pack_cols((zeros - 1) & 0xF),
            "scales": scales.to(torch.float16), "g_idx": g_idx.to(torch.int32).clone()}


def write_checkpoint(hf_model, results: dict[str, tuple], qconfig: QuantizationConfig, tokenizer,
                     output_dir: Path) -> Path:
    """Write config.json (float16, with ``quantization_config``), model.safetensors and the tokenizer.

    All of it goes to a scratch folder beside ``output_dir``, renamed into place at the end (``output_dir``
    must not exist or be empty): a run stopped midway leaves no half-written checkpoint."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.partial-", dir=output_dir.parent))
    try:
        _write_files(hf_model, results, qconfig, tokenizer, scratch)
        if output_dir.is_dir():
            output_dir.rmdir()  # empty (the caller checks); a non-empty one raises here, nothing lost
        os.replace(scratch, output_dir)
        os.chmod(output_dir, 0o777 & ~_umask())
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return output_dir


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _write_files(hf_model, results: dict[str, tuple], qconfig: QuantizationConfig, tokenizer,
                 output_dir: Path) -> None:
    tied = bool(getattr(hf_model.config, "tie_word_embeddings", False))
    state: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        module, leaf = name.rsplit(".", 1)
        if (module in results and leaf == "weight") or (tied and name == "lm_head.weight"):
            continue
        state[name] = tensor.detach().to("cpu", torch.float16).contiguous()
    for module, (codes, scales, zeros, g_idx) in results.items():
        for leaf, tensor in pack_linear(qconfig.method, codes, scales, zeros, g_idx).items():
            state[f"{module}.{leaf}"] = tensor.cpu().contiguous()
    _save_weights(state, output_dir / "model.safetensors")
    config = hf_model.config.to_dict()
    config.update(quantization_config=qconfig.to_hf_dict(), dtype="float16", torch_dtype="float16")
    (output_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tokenizer.save_pretrained(str(output_dir))


def dequantize_checkpoint(quantized_dir: str | Path, output_dir: str | Path,
                          dtype: torch.dtype = torch.float32) -> Path:
    """Write an unquantized copy of an AWQ/GPTQ checkpoint, each linear's weights dequantized with the
    reference (``packing``): the same weights, loadable by plain transformers (no GPTQModel needed)."""
    from .config import _from_checkpoint

    quantized_dir, output_dir = Path(quantized_dir), Path(output_dir)
    config = json.loads((quantized_dir / "config.json").read_text(encoding="utf-8"))
    qconfig = _from_checkpoint(config.pop("quantization_config"))
    with safe_open(str(quantized_dir / "model.safetensors"), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    state = {}
    for name, tensor in tensors.items():
        module, leaf = name.rsplit(".", 1)
        if leaf in ("qzeros", "scales", "g_idx"):
            continue
        if leaf != "qweight":
            state[name] = tensor.to(dtype)
            continue
        if qconfig.method == "awq":
            codes, zeros = packing.unpack_awq(tensor), packing.unpack_awq(tensors[f"{module}.qzeros"])
            g_idx = packing.group_index(codes.shape[0], qconfig.group_size)
        else:
            codes = packing.unpack_gptq_qweight(tensor)
            zeros = (packing.unpack_cols(tensors[f"{module}.qzeros"]) + 1) & 0xF
            g_idx = tensors[f"{module}.g_idx"]
        weight = packing.dequantize(codes, tensors[f"{module}.scales"], zeros, g_idx, torch.float32)
        state[f"{module}.weight"] = weight.t().contiguous().to(dtype)
    output_dir.mkdir(parents=True, exist_ok=True)
    _save_weights(state, output_dir / "model.safetensors")
    config.update(dtype=str(dtype).removeprefix("torch."), torch_dtype=str(dtype).removeprefix("torch."))
    (output_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for path in quantized_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors") and path.is_file():
            shutil.copy(path, output_dir / path.name)
    return output_dir


def _save_weights(state: dict, path: Path) -> None:
    """safetensors' ``save_file`` with the file mode every other written file gets (it creates 0600)."""
    save_file(state, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())
