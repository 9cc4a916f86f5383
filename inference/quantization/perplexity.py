"""Perplexity of a model on the text sample shipped in ``data/perplexity.txt`` (about 2,000 tokens of
public-domain English), computed with the engine's own forward pass (``prompt_logprobs``)."""
from __future__ import annotations

import math
from pathlib import Path

from ..sampling_params import SamplingParams

PERPLEXITY_TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def perplexity_tokens(tokenizer) -> list[int]:
    """The token ids of the shipped perplexity sample."""
    return tokenizer.encode(PERPLEXITY_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)


def perplexity(llm, token_ids: list[int], chunk_len: int = 512) -> float:
    """``exp(-mean log p(token | preceding tokens of its chunk))`` over ``token_ids`` cut into chunks of
    ``chunk_len`` tokens (the first token of each chunk is context, not scored).

    Args:
        llm: an ``inference.LLM``; its ``max_model_len`` must be at least ``chunk_len``.
    Raises:
        ValueError: fewer than two tokens.
    """
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    chunks = [token_ids[i:i + chunk_len] for i in range(0, len(token_ids), chunk_len)]
    chunks = [chunk for chunk in chunks if len(chunk) > 1]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = llm.generate(sampling_params=params, use_tqdm=False, prompt_token_ids=chunks)
    total, count = 0.0, 0
    for chunk, output in zip(chunks, outputs):
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            total += entry[chunk[position]].logprob
            count += 1
    return math.exp(-total / count)
