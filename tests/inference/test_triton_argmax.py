"""The window graphs' Triton argmax (``sampling/triton_argmax.py``) against ``torch.argmax``, ties included."""
from __future__ import annotations

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)

pytest.importorskip("triton")

from inference.sampling.triton_argmax import SLICE, greedy_argmax  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("vocab", [7, SLICE, 2 * SLICE + 5])
def test_greedy_argmax_matches_torch(dtype, vocab):
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype).to(DEVICE)
    # Ties, within one slice and across slices: the lowest index wins, as torch.argmax's does.
    logits[1, :] = 0.0
    logits[2, vocab // 2] = logits[2, vocab - 1] = 100.0
    logits[3, 0] = logits[3, vocab - 1] = 100.0
    expected = logits.argmax(dim=-1)
    assert torch.equal(greedy_argmax(logits), expected)
    assert expected[1] == 0 and expected[2] == vocab // 2 and expected[3] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_greedy_argmax_nan_inf_and_row_strides(dtype):
    """NaN wins as in torch.argmax (on the GPU a NaN compared as it is would lose to the reduction's next value,
    masked padding included: a token past the vocabulary); all -inf rows, +-0 and a row stride other than V."""
    vocab = SLICE + 5  # a partial last slice: padding lanes exist
    wide = torch.randn(6, vocab + 11, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    logits = wide[:, :vocab]  # row stride vocab + 11
    logits[0] = float("nan")
    logits[1, 7] = logits[1, SLICE + 2] = float("nan")
    logits[2] = float("-inf")
    logits[3] = 0.0
    logits[3, 9] = -0.0
    logits[4, SLICE + 4] = float("inf")
    expected = logits.argmax(dim=-1)
    got = greedy_argmax(logits)
    assert torch.equal(got, expected)
    assert got.tolist()[:5] == [0, 7, 0, 0, SLICE + 4] and bool((got < vocab).all())


def test_greedy_argmax_writes_a_strided_column():
    logits = torch.randn(4, 300, device=DEVICE)
    tokens = torch.full((4, 3), -1, dtype=torch.int64, device=DEVICE)
    greedy_argmax(logits, out=tokens[:, 1])
    assert torch.equal(tokens[:, 1], logits.argmax(dim=-1))
    assert (tokens[:, [0, 2]] == -1).all()


def test_greedy_argmax_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unit column stride"):
        greedy_argmax(torch.randn(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="V > 0"):
        greedy_argmax(torch.randn(3, 0, device=DEVICE))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        greedy_argmax(torch.randn(3, 10, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be \[3\] int64 on"):
        greedy_argmax(torch.randn(3, 10, device=DEVICE), out=torch.empty(3, dtype=torch.int32, device=DEVICE))
