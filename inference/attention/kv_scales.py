"""Where an FP8 KV cache's per-layer scales come from: the checkpoint, or a calibration pass at start-up.

An e4m3 value keeps 3 mantissa bits between 2^-6 and 448 and loses them below (subnormals down to 2^-9).
Keys and values stored with vLLM's default scale of 1.0 therefore lose precision wherever they are small:
on the packaged SmolLM2, layer 0's values have a median magnitude of 0.018, and with 1.0 scales its
perplexity rises 2.3% (docs/quantization.md). So the scales are, in this order:

1. the checkpoint's, where it has them: ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (llm-compressor's
   ``kv_cache_scheme``), the older single ``kv_scale``, or ``k_proj.output_scale`` / ``v_proj.output_scale``;
2. otherwise, with ``calculate_kv_scales`` (on by default with an FP8 cache), measured at start-up: four
   128-token prefills of the text shipped in ``inference/quantization/data/calibration.txt`` (in the model's chat
   template where it has one) records each layer's largest key and value magnitude, and the scale maps
   it to e4m3's largest value, 448, as llm-compressor's static scales do. Larger values met later are
   clipped to 448. The calibration text is not the text of the perplexity check;
3. otherwise 1.0, as vLLM.

A key's largest magnitude is taken before rotary embedding as the largest norm of a rotated pair
``(k_i, k_{i + D/2})``, which bounds every rotated value ``k_i cos - k_{i + D/2} sin`` at any position:
the bound holds for the fused Triton rotary-and-store kernel too, which never exposes the rotated keys.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from .kv_quant import FP8_MAX

logger = logging.getLogger(__name__)

CALIBRATED_MAX = FP8_MAX  # a calibrated layer's largest magnitude (for keys a rotated-pair norm) is stored as this
CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "quantization" / "data" / "calibration.txt"
CALIBRATION_SEQUENCES = 4  # calibration prompts, prefilled one after the other
CALIBRATION_SEQUENCE_LEN = 128  # tokens of each at most (fewer only when max_model_len is)
CALIBRATION_TURN_WORDS = 36  # words of the text in each user and each assistant turn of a chat prompt

# checkpoint tensor name suffix -> which scales of the layer's attention it sets
_CHECKPOINT_SCALES = {"self_attn.k_scale": ("k",), "self_attn.v_scale": ("v",), "self_attn.kv_scale": ("k", "v"),
                      "self_attn.k_proj.output_scale": ("k",), "self_attn.v_proj.output_scale": ("v",)}


def checkpoint_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``(attention module name, ("k" | "v", ...))`` for a checkpoint tensor that holds KV cache scales,
    e.g. ``model.layers.3.self_attn.k_scale`` -> ``("model.layers.3.self_attn", ("k",))``; None otherwise."""
    for suffix, which in _CHECKPOINT_SCALES.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1] + ".self_attn", which
    return None


def scale_value(tensor: torch.Tensor, name: str) -> float:
    """The one positive finite float of a checkpoint's scale tensor (any shape of one element).

    Raises:
        ValueError: more than one element, or a value that is not a positive finite number (naming the tensor).
    """
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a KV cache scale must be one number per layer, got shape {tuple(tensor.shape)}")
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: a KV cache scale must be a positive finite number, got {value}")
    return value


def record_amax(amax: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ``amax`` ``[2]`` float32 (keys, values) to the largest magnitudes of a step's ``k``, ``v``
    ``[T, Hk, D]`` (keys before rotary embedding: the largest rotated-pair norm, see the module doc)."""
    half = k.shape[-1] // 2
    kf = k.float()
    pair_norm = torch.sqrt(kf[..., :half] ** 2 + kf[..., half:] ** 2)
    step = torch.stack([pair_norm.amax(), v.float().abs().amax()])
    torch.maximum(amax, step, out=amax)


def calibration_sequences(tokenizer_dir: str, max_len: int) -> list[list[int]] | None:
    """The calibration prompts: :data:`CALIBRATION_SEQUENCES` sequences of at most ``min(max_len,
    CALIBRATION_SEQUENCE_LEN)`` tokens, or None where no tokenizer loads. Where the tokenizer has a chat
    template, each is a user turn and an assistant turn of the text's next words in it: served requests are
    mostly chats, and the keys and values of their special tokens are often the largest of all (on SmolLM2,
    plain-text scales clipped a chat prompt's keys: its first greedy token changed). Their lengths do not
    depend on the cache or on ``max_model_len`` above 128 tokens, so neither do the scales."""
    from ..model_loader import load_tokenizer  # noqa: PLC0415
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the scales at 1.0, logged
        logger.warning("FP8 KV cache: no tokenizer for the calibration pass (%s); scales stay 1.0", exc)
        return None
    length = min(max_len, CALIBRATION_SEQUENCE_LEN)
    text = CALIBRATION_TEXT.read_text(encoding="utf-8")
    if not getattr(tokenizer, "chat_template", None):
        ids = tokenizer.encode(text, add_special_tokens=True)
        return [ids[i:i + length] for i in range(0, length * CALIBRATION_SEQUENCES, length)]
    words = text.split()
    sequences = []
    for start in range(0, len(words), 2 * CALIBRATION_TURN_WORDS):
        user = " ".join(words[start:start + CALIBRATION_TURN_WORDS])
        assistant = " ".join(words[start + CALIBRATION_TURN_WORDS:start + 2 * CALIBRATION_TURN_WORDS])
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        chat = tokenizer.apply_chat_template(turns, tokenize=False)
        sequences.append(tokenizer.encode(chat, add_special_tokens=False)[:length])
        if len(sequences) == CALIBRATION_SEQUENCES:
            break
    return sequences


def calibrate(model: torch.nn.Module, sequences: list[list[int]], kv_caches: list[torch.Tensor], block_size: int,
              device: str, backend: str, tp=None) -> list[tuple[float, float]]:
    """Prefill each of ``sequences`` through ``model`` in turn (writing blocks ``0..`` of ``kv_caches``: a
    scratch cache of the model's dtype, so that no layer's inputs are rounded to e4m3 yet) and set every attention layer's ``k_scale`` / ``v_scale`` to its largest magnitude over
    all of them divided by :data:`CALIBRATED_MAX` (1.0 where a layer saw only zeros). With tensor parallelism
    (``tp``, every rank calling) the largest magnitudes are taken over all ranks' heads: one scale per layer,
    as on one rank, so the ranks store what one rank would.

    Returns:
        Each layer's ``(k_scale, v_scale)``, in layer order.
    """
    from ..runner.input_batch import HostBatch, device_inputs  # noqa: PLC0415
    layers = [m for m in model.modules() if hasattr(m, "kv_amax")]
    for layer in layers:
        layer.kv_amax = torch.zeros(2, dtype=torch.float32, device=device)
    try:
        for token_ids in sequences:
            n = len(token_ids)
            positions = np.arange(n, dtype=np.int64)
            host = HostBatch(np.asarray(token_ids, dtype=np.int64), positions, positions.copy(),
                             np.array([0, n], dtype=np.int32), np.zeros(1, dtype=np.int32),
                             [list(range(-(-n // block_size)))], np.array([n - 1], dtype=np.int64), {})
            inputs = device_inputs(host, block_size, device, backend)
            with torch.inference_mode():
                model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)
        scales = []
        for layer in layers:
            if tp is not None:
                tp.all_reduce_max(layer.kv_amax)
            k_amax, v_amax = layer.kv_amax.tolist()
            layer.k_scale = k_amax / CALIBRATED_MAX if k_amax > 0 else 1.0
            layer.v_scale = v_amax / CALIBRATED_MAX if v_amax > 0 else 1.0
            scales.append((layer.k_scale, layer.v_scale))
    finally:
        for layer in layers:
            layer.kv_amax = None
    return scales


def describe(scales: list[tuple[float, float]]) -> str:
    """One log phrase for per-layer scales: their range over the layers."""
    ks, vs = [s[0] for s in scales], [s[1] for s in scales]
    return f"k_scale {min(ks):.3g}-{max(ks):.3g}, v_scale {min(vs):.3g}-{max(vs):.3g} over the layers"
