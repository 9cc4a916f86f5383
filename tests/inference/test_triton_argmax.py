"""Greedy sampling's Triton argmax against ``torch.argmax`` (interpreter on CPU, CUDA on the H200)."""
from __future__ import annotations

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: E402  (sets TRITON_INTERPRET=1 without a GPU)

triton = pytest.importorskip("triton")

from inference.sampling.triton_argmax import argmax_rows  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vocab", [5, 4096, 9001, pytest.param(151936, marks=pytest.mark.skipif(
    not HAS_CUDA, reason="GPU-sized vocabulary"))])
def test_argmax_rows_is_torch_argmax(dtype, vocab):
    g = torch.Generator(device=DEVICE).manual_seed(vocab)
    logits = (torch.randn(7, vocab, generator=g, device=DEVICE) * 5).to(dtype)
    logits[1] = 0.5                      # a flat row: the first index
    logits[2, -1] = 1e4                  # the maximum in the last, partial chunk
    logits[3, vocab // 2:] = 1e4         # ties across chunks: the first one
    logits[4] = float("-inf")            # nothing finite: index 0, as torch gives
    logits[5, vocab // 3] = float("nan")  # NaN counts as the maximum
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_argmax_rows_of_a_row_view_and_no_rows():
    logits = torch.randn(6, 3000, device=DEVICE)
    assert torch.equal(argmax_rows(logits[::2]), logits[::2].argmax(dim=-1))
    assert argmax_rows(logits[:0]).shape == (0,)
    with pytest.raises(ValueError, match="unit column stride"):
        argmax_rows(logits.t())
