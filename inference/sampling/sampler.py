"""The sampler: logits ``[N, V]`` -> one token id per row, plus logprobs."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..host_to_device import tensor_to_device, to_device
from .draws import draw_tokens
from .metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    """Attributes:
        token_ids: ``[N]`` int64 sampled ids.
        logprob_token_ids: ``[N, k+1]`` int64, sampled token first then the top-k, or None.
        logprobs: ``[N, k+1]`` float32 log-probabilities of those tokens, or None.
        sampled_ranks: ``[N]`` int64 rank (1 = most likely) of the sampled token, or None.
    """

    token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def compute_topk_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int):
    """Log-probabilities of ``token_ids [N]`` and the ``k`` most likely tokens per row.

    Args:
        logprobs: ``[N, V]`` float32 log_softmax of the raw logits.
    Returns:
        ``(ids [N, k+1] int64, values [N, k+1] float32, ranks [N] int64)``; column 0 is ``token_ids``.
    """
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
        return torch.cat([token_ids[:, None], top_ids], 1), torch.cat([chosen, top_values], 1), ranks
    return token_ids[:, None], chosen, ranks


class Sampler:
    """Applies, in order: logit bias and ``min_tokens`` bans, repetition / frequency / presence
    penalties, greedy argmax or temperature, top-k, top-p (Holtzman et al., 2020), min-p
    (Nguyen et al., 2024), then samples: on a GPU with the exponential-race trick
    (``argmax(p / E)``, ``E ~ Exp(1)``), on the CPU by inversion with one uniform a row
    (:mod:`.draws`); either way a seeded row draws from its own generator.

    Logprobs are those of the raw model distribution (``log_softmax`` of the logits before
    any processing), like vLLM's default and like transformers' ``log_softmax(logits)``.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """``logits [N, V]`` (any float dtype; float32 is used for everything but a plain greedy argmax,
        which converting would not change) -> one token per row."""
        if not meta.plain_greedy:
            logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = self._apply_bias_and_bans(logits, meta)
        if meta.presence is not None:
            logits = self._apply_penalties(logits, meta)
        # torch.argmax, not a Triton kernel: one that read the logits twice as fast (32 against 57 us at
        # 256 x 151,936 on the H200) lost W2 2-4% to its two launches' host time on this step-by-step path.
        greedy_ids = logits.argmax(dim=-1)
        if meta.all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = torch.where(meta.greedy, greedy_ids, self._sample(logits, meta))
        out = SamplerOutput(token_ids=token_ids)
        if raw_logprobs is not None:
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = compute_topk_logprobs(
                raw_logprobs, token_ids, meta.max_num_logprobs)
        return out

    @staticmethod
    def _apply_bias_and_bans(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        needs = any(meta.logit_bias) or any(meta.min_tokens_mask)
        if not needs:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for row, bias in enumerate(meta.logit_bias):
            if bias:
                kept = [t for t in bias if 0 <= t < vocab]
                ids, vals = to_device([np.array(kept, np.int64), np.array([bias[t] for t in kept], np.float32)],
                                      logits.device)
                logits[row].index_add_(0, ids, vals.to(logits.dtype))
        for row, banned in enumerate(meta.min_tokens_mask):
            if banned:
                logits[row].index_fill_(0, tensor_to_device(torch.tensor(banned), logits.device), float("-inf"))
        return logits

    @staticmethod
    def _token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
        counts = torch.zeros(len(rows), vocab + 1, device=device)
        width = max((len(r) for r in rows), default=0)
        if width:
            padded = torch.full((len(rows), width), vocab, dtype=torch.long)
            for i, r in enumerate(rows):
                padded[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            padded = tensor_to_device(padded, device)
            counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
        return counts[:, :vocab]

    def _apply_penalties(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        vocab = logits.shape[1]
        out_counts = self._token_counts(meta.output_ids, vocab, logits.device)
        seen = (self._token_counts(meta.prompt_ids, vocab, logits.device) + out_counts) > 0
        rep = meta.repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - meta.frequency[:, None] * out_counts
        return logits - meta.presence[:, None] * (out_counts > 0).to(logits.dtype)

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        logits = logits / meta.temperature[:, None]
        if meta.needs_top_k_top_p:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[1]
            positions = torch.arange(vocab, device=logits.device)[None, :]
            drop = positions >= meta.top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            drop = (probs.cumsum(dim=-1) - probs) > meta.top_p[:, None]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if meta.needs_min_p:
            threshold = probs.max(dim=-1, keepdim=True).values * meta.min_p[:, None]
            probs = probs.masked_fill(probs < threshold, 0.0)
        return draw_tokens(probs, meta.generators)
