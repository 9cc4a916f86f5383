"""Per-step sampling parameters of the batch, as tensors."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..host_to_device import to_device
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
        step_invariant: nothing here depends on the tokens generated so far (no penalties, no
            ``min_tokens`` ban), so the same requests in the next step get the same metadata.
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
    step_invariant: bool = False

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of the raw logits: greedy, no logprobs, penalties, bias or bans."""
        return (self.all_greedy and self.max_num_logprobs is None and self.presence is None
                and not any(self.logit_bias) and not any(self.min_tokens_mask))

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: str) -> "SamplingMetadata":
        params = [r.sampling_params for r in requests]

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
        f32 = np.float32
        arrays = [np.array([1.0 if g else p.temperature for g, p in zip(greedy, params)], f32),
                  np.array([p.top_p for p in params], f32), np.array(top_k, np.int64),
                  np.array([p.min_p for p in params], f32), np.array(greedy, np.bool_)]
        if penalised:
            arrays += [np.array([p.presence_penalty for p in params], f32),
                       np.array([p.frequency_penalty for p in params], f32),
                       np.array([p.repetition_penalty for p in params], f32)]
        temperature, top_p, top_k_t, min_p, greedy_t, *penalties = to_device(arrays, device)
        presence, frequency, repetition = penalties if penalised else (None, None, None)
        return cls(
            temperature=temperature, top_p=top_p, top_k=top_k_t, min_p=min_p, greedy=greedy_t,
            all_greedy=all(greedy),
            needs_top_k_top_p=any(not g and (p.top_p < 1.0 or k < vocab_size)
                                  for g, p, k in zip(greedy, params, top_k)),
            needs_min_p=any(not g and p.min_p > 0 for g, p in zip(greedy, params)),
            presence=presence, frequency=frequency, repetition=repetition,
            output_ids=[r.output_token_ids for r in requests] if penalised else None,
            prompt_ids=[r.prompt_token_ids for r in requests] if penalised else None,
            logit_bias=[p.logit_bias for p in params],
            min_tokens_mask=banned,
            generators={i: r.generator for i, r in enumerate(requests) if r.generator is not None},
            max_num_logprobs=max(logprobs) if logprobs else None,
            step_invariant=not penalised and not any(banned),
        )
