"""Per-step sampling parameters of the batch, as tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import Request


@dataclass
class SamplingMetadata:
    """Sampling settings of the ``N`` rows that sample in this step.

    Attributes:
        temperature, top_p, min_p: ``[N]`` float32; top_k: ``[N]`` int64 (vocab size when disabled).
        greedy: ``[N]`` bool.
        presence, frequency, repetition: ``[N]`` float32 penalties, or None when no row uses them.
        output_ids, prompt_ids: per row token lists the penalties read (None when unused).
        logit_bias: per row ``{token_id: bias}`` or None.
        min_tokens_mask: per row the token ids banned because ``min_tokens`` is not reached yet.
        generators: row -> ``torch.Generator`` for seeded rows.
        max_num_logprobs: largest ``logprobs`` asked for, or None.
    """

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    needs_top_k_top_p: bool
    needs_min_p: bool
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_ids: list[list[int]] | None
    prompt_ids: list[list[int]] | None
    logit_bias: list[dict[int, float] | None]
    min_tokens_mask: list[list[int]]
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: str) -> "SamplingMetadata":
        params = [r.sampling_params for r in requests]

        def tensor(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        penalised = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
        banned = []
        for r, p in zip(requests, params):
            stop_ids = list(p.stop_token_ids or [])
            if not p.ignore_eos:
                stop_ids += list(p.eos_token_ids)
            banned.append(stop_ids if r.num_output_tokens < p.min_tokens else [])
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)]),
            top_p=tensor([p.top_p for p in params]),
            top_k=tensor(top_k, torch.int64),
            min_p=tensor([p.min_p for p in params]),
            greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            needs_top_k_top_p=any(not g and (p.top_p < 1.0 or k < vocab_size)
                                  for g, p, k in zip(greedy, params, top_k)),
            needs_min_p=any(not g and p.min_p > 0 for g, p in zip(greedy, params)),
            presence=tensor([p.presence_penalty for p in params]) if penalised else None,
            frequency=tensor([p.frequency_penalty for p in params]) if penalised else None,
            repetition=tensor([p.repetition_penalty for p in params]) if penalised else None,
            output_ids=[r.output_token_ids for r in requests] if penalised else None,
            prompt_ids=[r.prompt_token_ids for r in requests] if penalised else None,
            logit_bias=[p.logit_bias for p in params],
            min_tokens_mask=banned,
            generators={i: r.generator for i, r in enumerate(requests) if r.generator is not None},
            max_num_logprobs=max(logprobs) if logprobs else None,
        )
