"""A multi-step window's tokens appended at once (``sched.token_appends.append_sampled_tokens``) end a request
where appending them one by one (``append_sampled_token``) would: length limits, EOS, stop token ids,
``min_tokens`` and ``ignore_eos``, with the same tokens kept and the same stop reason."""
from __future__ import annotations

import random

from inference.sched.token_appends import append_sampled_token, append_sampled_tokens
from inference.request import Request
from inference.sampling_params import SamplingParams


def _request(rng: random.Random) -> tuple[Request, int]:
    max_tokens = rng.randint(1, 12)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(max_tokens, rng.choice([0, 0, 2, 5])),
                            ignore_eos=rng.random() < 0.3, stop_token_ids=rng.sample(range(8), rng.randint(0, 2)),
                            eos_token_ids=(7,) if rng.random() < 0.8 else ())
    prompt = [100] * rng.randint(1, 6)
    request = Request("r", "r", 0, prompt, params, max_tokens=params.max_tokens)
    for token in [50] * rng.randint(0, params.max_tokens - 1):  # some tokens already out
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
    return request, rng.randint(len(request.all_token_ids) + 1, len(request.all_token_ids) + 14)


def test_window_appends_match_token_by_token():
    rng = random.Random(0)
    finishes = set()
    for _ in range(3000):
        window = [rng.randrange(10) for _ in range(rng.randint(1, 8))]
        seed = rng.random()
        one, max_model_len = _request(random.Random(seed))
        many, _ = _request(random.Random(seed))
        expected_status, kept = None, []
        for token in window:
            kept.append(token)
            expected_status = append_sampled_token(one, token, max_model_len)
            if expected_status is not None:
                break
        appended, status = append_sampled_tokens(many, window, max_model_len)
        assert (list(appended), status) == (kept, expected_status)
        assert many.output_token_ids == one.output_token_ids and many.all_token_ids == one.all_token_ids
        assert getattr(many, "stop_reason", None) == getattr(one, "stop_reason", None)
        finishes.add(status)
    assert len(finishes) == 3  # None, FINISHED_LENGTH and FINISHED_STOPPED all came up
