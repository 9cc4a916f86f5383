"""Each quantized linear's output error on the calibration activations it was quantized from: the quantity
GPTQ (Frantar et al., 2022, eq. 1) and AWQ (Lin et al., 2023, eq. 4) minimise, reported per layer and per
projection type so that calibrated methods can be compared with round-to-nearest.

For a linear with float weight ``W [N, K]``, quantized weight ``Q`` and calibration input ``X [T, K]``, the
relative error is ``||X Q^T - X W^T||^2 / ||X W^T||^2``. With AWQ, ``X`` and ``W`` are the input and weight once
its per-channel scales are folded (``X`` divided, ``W``'s columns multiplied, and the rows of a linear whose
output feeds a scaled one divided): the same float model, the weights AWQ actually rounds.

Whole layers are measured too, on the calibration text and optionally on held-out text: the error of the
layer's output relative to its residual update, ``||layer_q(h) - layer(h)||^2 / ||layer(h) - h||^2``, with ``h``
the layer's input in the model quantized so far. A method that fits the calibration activations without
generalising shows a gap between the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LayerErrors:
    """Squared errors and reference energies by ``(layer index, linear name)``, float64 sums."""

    squared_error: dict[tuple[int, str], float] = field(default_factory=dict)
    reference: dict[tuple[int, str], float] = field(default_factory=dict)
    # held-out token ids ``[B, T]`` int64 (optional): each whole layer is also measured on them
    held_out_ids: torch.Tensor | None = None
    # (layer, "calibration" | "held_out") -> (squared error, reference energy) of the layer's residual update
    residual: dict[tuple[int, str], tuple[float, float]] = field(default_factory=dict)

    @torch.no_grad()
    def add(self, layer: int, name: str, x: torch.Tensor, weight: torch.Tensor,
            weight_quantized: torch.Tensor) -> None:
        """Record one linear: ``x [T, K]`` its calibration input, ``weight`` / ``weight_quantized [N, K]`` its
        float and dequantized weights (any float dtype; computed in float32, summed in float64)."""
        x = x.float()
        reference = x @ weight.float().t()
        error = x @ weight_quantized.float().t() - reference
        key = (layer, name)
        self.squared_error[key] = self.squared_error.get(key, 0.0) + error.double().pow(2).sum().item()
        self.reference[key] = self.reference.get(key, 0.0) + reference.double().pow(2).sum().item()

    @torch.no_grad()
    def add_residual(self, layer: int, split: str, hidden: torch.Tensor, float_output: torch.Tensor,
                     quantized_output: torch.Tensor) -> None:
        """Record one decoder layer on one text: ``hidden`` its input, the float and quantized layers' outputs
        (all ``[B, T, hidden_size]``); the error is relative to the float layer's residual update."""
        error = (quantized_output.double() - float_output.double()).pow(2).sum().item()
        update = (float_output.double() - hidden.double()).pow(2).sum().item()
        self.residual[(layer, split)] = (error, update)

    def residual_by_layer(self, split: str) -> list[float]:
        """``||layer_q(h) - layer(h)||^2 / ||layer(h) - h||^2`` of each layer on ``split``, index order."""
        return [e / r for (_, s), (e, r) in sorted(self.residual.items()) if s == split]

    def relative(self, layer: int, name: str) -> float:
        """``||X' Q^T - X W^T||^2 / ||X W^T||^2`` of one linear."""
        return self.squared_error[(layer, name)] / self.reference[(layer, name)]

    def by_type(self) -> dict[str, float]:
        """The relative error of each projection type over all layers (errors and energies summed first)."""
        names = sorted({name for _, name in self.squared_error}, key=_ORDER.index)
        return {name: sum(e for (_, n), e in self.squared_error.items() if n == name)
                / sum(r for (_, n), r in self.reference.items() if n == name) for name in names}

    def by_layer(self) -> dict[str, list[float]]:
        """Each projection type's relative error, layer by layer (index order)."""
        layers = sorted({layer for layer, _ in self.squared_error})
        return {name: [self.relative(layer, name) for layer in layers] for name in self.by_type()}


_ORDER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
