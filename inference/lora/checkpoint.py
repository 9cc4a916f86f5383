"""Reading and checking a PEFT LoRA checkpoint against the base model.

A PEFT adapter folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``, ...) and ``adapter_model.safetensors`` with, per adapted projection, ``lora_A``
``[r, in_features]`` and ``lora_B`` ``[out_features, r]`` (Hu et al., "LoRA", 2021):
``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
rsLoRA (Kalajdzievski, 2023). The scaling is folded into ``B`` once, at load.

Everything is checked before anything is returned, so a bad adapter changes no engine state.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InvalidRequestError
from .request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target, and the decoder block each lives in.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(" + "|".join(TARGET_MODULES)
                  + r")\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$")


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A loaded adapter, in host memory.

    Attributes:
        request: the ``LoRARequest`` it was loaded for.
        rank: its rank ``r`` (tokens' low-rank width).
        key: a digest of its config and weights: requests share prefix-cache blocks and device slots only
            with requests of the same key.
        weights: ``(layer index, projection name) -> (A [r, in] , B [out, r])``, float32 on the CPU,
            ``B`` already multiplied by the scaling. Projections the adapter does not target are absent.
    """

    request: LoRARequest
    rank: int
    key: str
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def lora_name(self) -> str:
        return self.request.lora_name

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def projection_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection of the base model's decoder layers (unsplit)."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _fail(request: LoRARequest, message: str, param: str = "lora_path") -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {request.lora_name!r} (lora_path={request.lora_path!r}): {message}",
                               param=param)


def targeted_modules(config: dict) -> set[str] | None:
    """The projection names a list ``target_modules`` names (``"model.layers.0.q_proj"`` counts as ``q_proj``);
    None for a string (a regular expression, ``all-linear``), which is not matched."""
    targets = config.get("target_modules")
    return {str(t).rsplit(".", 1)[-1] for t in targets} if isinstance(targets, list) else None


def read_adapter_config(request: LoRARequest) -> dict:
    """The adapter's ``adapter_config.json``, checked for what the engine supports.

    Raises:
        InvalidRequestError: no such folder or file, malformed JSON, missing ``r``/``lora_alpha``
            (``param="lora_path"``); a DoRA, bias or ``modules_to_save`` adapter, per-module ranks
            (``"lora_path"``); a target outside :data:`TARGET_MODULES` (``"target_modules"``).
    """
    folder = Path(request.lora_path)
    if request.lora_path and folder.is_file():
        raise _fail(request, "a file, not a folder: an adapter is a folder holding adapter_config.json and "
                             "adapter_model.safetensors.")
    if not request.lora_path or not folder.is_dir():
        raise _fail(request, "no such folder.")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _fail(request, f"no {CONFIG_FILE} in the folder (a PEFT LoRA checkpoint has {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE}).")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _fail(request, f"{CONFIG_FILE} is not valid JSON ({error}).") from None
    if not isinstance(config, dict):
        raise _fail(request, f"{CONFIG_FILE} must hold a JSON object.")
    if config.get("peft_type", "LORA") != "LORA":
        raise _fail(request, f"peft_type is {config.get('peft_type')!r}; only LORA adapters are served.")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if (not isinstance(r, int) or isinstance(r, bool) or r < 1 or not isinstance(alpha, (int, float))
            or isinstance(alpha, bool) or not math.isfinite(alpha)):
        raise _fail(request, f"{CONFIG_FILE} needs a positive integer 'r' and a finite number 'lora_alpha'; got "
                             f"r={r!r}, lora_alpha={alpha!r}.")
    unsupported = [name for name in ("use_dora", "fan_in_fan_out", "lora_bias", "layer_replication",
                                     "trainable_token_indices", "target_parameters", "exclude_modules",
                                     "layers_to_transform", "layers_pattern", "alora_invocation_tokens",
                                     "use_qalora") if config.get(name) not in (None, False, [], "", {})]
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config['bias']!r}")
    if config.get("modules_to_save"):
        unsupported.append("modules_to_save")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        unsupported.append("rank_pattern/alpha_pattern")
    if unsupported:
        raise _fail(request, f"{', '.join(unsupported)} is not supported (plain LoRA on "
                             f"{', '.join(TARGET_MODULES)} only).")
    targets = targeted_modules(config)
    if targets is not None:
        outside = sorted(targets - set(TARGET_MODULES))
        if outside:
            raise _fail(request, f"target_modules {outside} cannot be served; supported: "
                                 f"{', '.join(TARGET_MODULES)}.", param="target_modules")
    return config


def load_adapter(request: LoRARequest, hf_config, max_lora_rank: int, dtype: torch.dtype | None = None) -> LoRAAdapter:
    """Load and check a PEFT LoRA adapter for the base model of ``hf_config``.

    Raises:
        InvalidRequestError: see :func:`read_adapter_config`; a rank above ``max_lora_rank``
            (``param="max_lora_rank"``); a missing or unreadable weights file, a tensor that is not
            a LoRA tensor of a supported projection, a layer the model does not have, a shape that
            does not fit the model, NaN or infinite values, values beyond ``dtype``'s range (the model's:
            ``lora_B`` once scaled by ``lora_alpha / r``), a projection with ``lora_A`` but no ``lora_B``
            (``"lora_path"``). A batch's rows meet every slot's ``B`` in one matmul
            (:func:`.triton_lora.lora_expand_all_slots`), so a non-finite value would reach other requests.
    """
    config = read_adapter_config(request)
    rank = config["r"]
    if rank > max_lora_rank:
        raise _fail(request, f"its rank r={rank} is above max_lora_rank={max_lora_rank} (start the engine with "
                             f"a larger --max-lora-rank).", param="max_lora_rank")
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors, digest = _read_weights(request)
    digest.update(json.dumps(config, sort_keys=True).encode())
    shapes = projection_shapes(hf_config)
    targeted = targeted_modules(config)  # as PEFT: only those get a LoRA layer; other tensors are not applied
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in sorted(tensors.items()):  # sorted: the first bad tensor named is the same every time
        match = _KEY.search(key)
        if match is None:
            raise _fail(request, f"tensor {key!r} is not a LoRA weight of {', '.join(TARGET_MODULES)}.",
                        param="target_modules")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if targeted is not None and module not in targeted:
            continue
        if layer >= hf_config.num_hidden_layers:
            raise _fail(request, f"tensor {key!r} is for layer {layer}; the model has {hf_config.num_hidden_layers}.")
        in_features, out_features = shapes[module]
        expected = (rank, in_features) if which == "A" else (out_features, rank)
        shape = tuple(tensor.shape)
        if shape != expected:
            rank_dim = 0 if which == "A" else 1
            if len(shape) == 2 and shape[1 - rank_dim] == expected[1 - rank_dim]:
                raise _fail(request, f"tensor {key!r} has rank {shape[rank_dim]}; {CONFIG_FILE} says r={rank}.")
            raise _fail(request, f"tensor {key!r} has shape {shape}; the base model needs {expected} "
                                 "(an adapter of another model?).")
        values = tensor.to(torch.float32)
        if not torch.isfinite(values).all():
            raise _fail(request, f"tensor {key!r} holds NaN or infinite values.")
        largest = float((values * (scaling if which == "B" else 1.0)).abs().max()) if values.numel() else 0.0
        if dtype is not None and dtype.is_floating_point and largest > torch.finfo(dtype).max:
            scaled = f" once multiplied by the scaling {scaling:g}" if which == "B" else ""
            raise _fail(request, f"tensor {key!r} holds values beyond {str(dtype).removeprefix('torch.')}'s range "
                                 f"(largest {largest:.4g}{scaled}; the model computes in "
                                 f"{str(dtype).removeprefix('torch.')}).")
        parts.setdefault((layer, module), {})[which] = values
    weights = {}
    for (layer, module), pair in sorted(parts.items()):
        if set(pair) != {"A", "B"}:
            raise _fail(request, f"layers.{layer}.{module} has lora_{''.join(pair)} but not both lora_A and lora_B.")
        weights[(layer, module)] = (pair["A"].contiguous(), (pair["B"] * scaling).contiguous())
    if not weights:
        raise _fail(request, f"{WEIGHTS_FILE} holds no LoRA weights.")
    return LoRAAdapter(request, rank, digest.hexdigest(), weights)


def _read_weights(request: LoRARequest):
    """The tensors of ``adapter_model.safetensors`` and a SHA-256 digest of the file's bytes."""
    from safetensors import SafetensorError  # noqa: PLC0415
    from safetensors.torch import load  # noqa: PLC0415

    path = Path(request.lora_path) / WEIGHTS_FILE
    if not path.is_file():
        raise _fail(request, f"no {WEIGHTS_FILE} in the folder (only safetensors checkpoints are read).")
    data = path.read_bytes()
    try:
        tensors = load(data)
    except (SafetensorError, ValueError) as error:
        raise _fail(request, f"{WEIGHTS_FILE} is not a valid safetensors file ({error}).") from None
    return tensors, hashlib.sha256(data)
