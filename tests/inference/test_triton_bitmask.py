"""The grammar-bitmask Triton kernel (``structured_output/triton_bitmask.py``) against its PyTorch
reference: rows picked, the last partial word, every float dtype, a row stride other than V."""
from __future__ import annotations

import pytest
import torch

from .triton_interpreter import HAS_CUDA  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)

pytest.importorskip("triton")

from inference.structured_output.bitmask import apply_token_bitmask_reference, bitmask_width  # noqa: E402
from inference.structured_output.triton_bitmask import BLOCK, apply_token_bitmask_triton  # noqa: E402

DEVICE = "cuda" if HAS_CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("vocab", [45, BLOCK + 37])
def test_kernel_matches_reference(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(5, vocab + 3, generator=gen).to(dtype)
    logits = wide[:, :vocab]  # row stride vocab + 3
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, bitmask_width(vocab)), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # all allowed
    bitmask[2] = 0  # nothing allowed
    rows = torch.tensor([4, 0, 2])
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, rows)
    on_device = wide.to(DEVICE)
    apply_token_bitmask_triton(on_device[:, :vocab], bitmask.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(on_device[:, :vocab].cpu(), expected)
    assert torch.equal(on_device[:, vocab:].cpu(), wide[:, vocab:])  # past the vocabulary: untouched
    assert torch.isinf(expected[2]).all() and not torch.isinf(expected[0]).any()
