"""The CPU sampler's draw by inversion: the right distribution, tails included, and never a masked token."""
from __future__ import annotations

import torch

from inference.sampling.draws import BLOCK, inverse_cdf_sample
from inference.sampling.metadata import SamplingMetadata
from inference.sampling.sampler import Sampler


def _distribution(vocab: int = 1000) -> torch.Tensor:
    """Heavy head, a long tail, zeroed entries (one whole block, the last entries, scattered ones)."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(vocab, generator=g) ** 8
    p[[3, 600, 731]] = torch.tensor([4.0, 2.0, 1.0])
    p[BLOCK:2 * BLOCK] = 0.0
    p[-5:] = 0.0
    p[torch.randperm(vocab, generator=g)[:100]] = 0.0
    return p / p.sum()


def test_frequencies_match_the_distribution_and_masked_tokens_never_come():
    probs = _distribution()
    rows, rounds = 20_000, 5
    counts = torch.zeros_like(probs, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    for _ in range(rounds):
        # rows scaled by 0.3: min-p zeroes entries without renormalising
        ids = inverse_cdf_sample((0.3 * probs).expand(rows, -1).contiguous(),
                                 torch.rand(rows, dtype=torch.float64, generator=g))
        counts += torch.bincount(ids, minlength=probs.numel()).double()
    n = rows * rounds
    assert counts[probs == 0].sum() == 0
    expected = probs.double() * n
    sigma = (expected * (1 - probs.double())).sqrt()
    big = expected > 30
    assert int(big.sum()) > 50
    assert ((counts - expected).abs()[big] < 5 * sigma[big]).all()
    assert abs(counts[~big].sum() - expected[~big].sum()) < 5 * expected[~big].sum().sqrt() + 5


def test_tail_tokens_keep_their_own_interval():
    """A token of probability 1e-9 after a mass of about 1 still owns its interval of [0, 1): a single float32
    prefix sum would round it away (the spacing of floats near 1 is 6e-8)."""
    vocab = 3 * BLOCK
    probs = torch.full((vocab,), 1e-9)
    probs[0] = 1.0
    probs[BLOCK + 7] = 0.0
    probs = probs / probs.sum()
    cdf = probs.double().cumsum(0)
    targets = torch.tensor([1, 2, BLOCK, BLOCK + 8, 2 * BLOCK + 100, vocab - 1])
    # the middle of each target's interval
    uniforms = (cdf[targets] - probs.double()[targets] / 2) / cdf[-1]
    got = inverse_cdf_sample(probs.expand(len(targets), -1).contiguous(), uniforms)
    assert got.tolist() == targets.tolist()


def test_sampler_draws_seeded_rows_from_their_own_generator_on_cpu():
    """A seeded row gives the same token whatever the other rows are, and unseeded rows vary."""
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(2))

    def draw(seed_row: int, seed: int) -> torch.Tensor:
        rows, vocab = logits.shape
        meta = SamplingMetadata(
            temperature=torch.ones(rows), top_p=torch.ones(rows), top_k=torch.full((rows,), vocab),
            min_p=torch.zeros(rows), greedy=torch.zeros(rows, dtype=torch.bool), all_greedy=False,
            needs_top_k_top_p=False, needs_min_p=False, presence=None, frequency=None, repetition=None,
            output_ids=None, prompt_ids=None, logit_bias=[None] * rows, min_tokens_mask=[[]] * rows,
            generators={seed_row: torch.Generator().manual_seed(seed)}, max_num_logprobs=None)
        return Sampler()(logits, meta).token_ids

    firsts = {int(draw(4, 123)[4]) for _ in range(5)}
    assert len(firsts) == 1
    others = {tuple(draw(4, 123)[:4].tolist()) for _ in range(5)}
    assert len(others) > 1
