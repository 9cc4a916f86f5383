"""Batched token sampling: penalties, temperature, top-k/top-p/min-p, seeds and logprobs."""
from .metadata import SamplingMetadata
from .sampler import Sampler, SamplerOutput, compute_topk_logprobs

__all__ = ["SamplingMetadata", "Sampler", "SamplerOutput", "compute_topk_logprobs"]
