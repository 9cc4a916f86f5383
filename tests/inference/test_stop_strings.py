"""Stop strings in incremental detokenization (``IncrementalDetokenizer``): matches across and inside tokens,
held-back prefixes, ``min_tokens``, special tokens as stop strings."""
from __future__ import annotations

import tracemalloc

import pytest

from inference import detokenizer
from inference.detokenizer import IncrementalDetokenizer
from tests.inference.tokenizer_samples import PARIS, TEXTS, chat_ids, encode, smollm2, stream  # noqa: F401



# -- stop strings ---------------------------------------------------------------------------

@pytest.fixture(autouse=True, params=["prefix_set", "scan"])
def stop_prefix_lookup(request, monkeypatch):
    """Every test runs with the held-back tail found in the set of stop-string prefixes and by
    scanning the stop strings (the path taken when the set would be too large)."""
    if request.param == "scan":
        monkeypatch.setattr(detokenizer, "_MAX_PREFIX_SET_CHARS", -1)
    return request.param


def test_a_one_megabyte_stop_string_holds_back_its_prefix_in_little_memory(smollm2):
    """A 1 MB stop string (a client's, through the API) must not build its 10^6 prefixes."""
    stop = "Paris" + "x" * 1_000_000
    tracemalloc.start()
    try:
        det = IncrementalDetokenizer(smollm2, [], stop=[stop])
        ids = encode(smollm2, PARIS)
        paris = next(k for k, i in enumerate(ids) if smollm2.decode([i]) == " Paris")
        deltas = [det.update([i])[0] for i in ids]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert deltas[paris] == " " and deltas[paris + 1] == "Paris."  # held while it could grow into the stop
    assert det.output_text == PARIS and peak < 20 * 2 ** 20, peak

def run_stop(tokenizer, text: str, stop: list[str], include: bool = False, chunk: int = 1):
    ids = encode(tokenizer, text)
    det = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Tell me:"), stop=stop,
                                 include_stop_str_in_output=include)
    seen = []
    for i in range(0, len(ids), chunk):
        delta, stop_str = det.update(ids[i:i + chunk])
        seen.append(det.output_text)
        if stop_str is not None:
            return det, stop_str, ids, seen
    det.update([], finished=True)
    return det, None, ids, seen


def test_stop_string_spanning_tokens(smollm2):
    assert not any("France is" in smollm2.decode([i]) for i in encode(smollm2, PARIS))
    det, stop_str, ids, seen = run_stop(smollm2, PARIS, ["France is"])
    assert (stop_str, det.output_text) == ("France is", "The capital of ")
    assert not any("Fr" in s for s in seen)  # the stop prefix never showed
    n = det.truncate_token_ids_to
    assert "France is" in smollm2.decode(ids[:n]) and "France is" not in smollm2.decode(ids[:n - 1])


def test_stop_string_included(smollm2):
    det, stop_str, _, _ = run_stop(smollm2, PARIS, ["France is"], include=True)
    assert (stop_str, det.output_text) == ("France is", "The capital of France is")


@pytest.mark.parametrize("include, expected", [(False, "The c"), (True, "The capit")])
def test_stop_string_inside_one_token(smollm2, include, expected):
    assert any(smollm2.decode([i]) == " capital" for i in encode(smollm2, PARIS))
    det, stop_str, _, _ = run_stop(smollm2, PARIS, ["apit"], include=include)
    assert (stop_str, det.output_text, det.truncate_token_ids_to) == ("apit", expected, 2)


@pytest.mark.parametrize("stop, chunk, expected", [
    (["museums", "is", "France", "city"], 1, "France"),
    (["museums", "is", "France", "city"], 100, "France"),  # all match within one update
    (["ital", "capital"], 1, "capital"),  # both complete on the token " capital"
])
def test_earliest_stop_string_wins(smollm2, stop, chunk, expected):
    det, stop_str, _, _ = run_stop(smollm2, PARIS, stop, chunk=chunk)
    assert stop_str == expected and det.output_text == PARIS[:PARIS.index(expected)]


@pytest.mark.parametrize("chunk", [3, 100])
def test_stop_in_multi_token_update(smollm2, chunk):
    det, stop_str, ids, _ = run_stop(smollm2, PARIS, ["Paris."], chunk=chunk)
    assert (stop_str, det.output_text) == ("Paris.", "The capital of France is ")
    assert smollm2.decode(ids[:det.truncate_token_ids_to]) == "The capital of France is Paris."
    with pytest.raises(RuntimeError):
        det.update(ids[-1:])


def test_stop_string_never_matching(smollm2):
    det, stop_str, ids, _ = run_stop(smollm2, PARIS, ["Berlin", "Paris!"])
    assert stop_str is None and det.truncate_token_ids_to is None
    assert det.output_text == PARIS


def test_held_prefix_is_released(smollm2):
    ids = encode(smollm2, PARIS)
    paris = next(k for k, i in enumerate(ids) if smollm2.decode([i]) == " Paris")
    det = IncrementalDetokenizer(smollm2, [], stop=["Paris!"])
    deltas = [det.update([i])[0] for i in ids[:paris + 2]]
    assert deltas[paris] == " "  # "Paris" could still become "Paris!"
    assert deltas[paris + 1] == "Paris." and det.output_text == "The capital of France is Paris."


def test_held_prefix_is_flushed_at_finish(smollm2):
    det = IncrementalDetokenizer(smollm2, [], stop=["Paris"])
    ids = encode(smollm2, "We will meet in Par")
    deltas = stream(det, ids)
    assert det.output_text == "We will meet in Par" and deltas[-1] == "Par"


@pytest.mark.parametrize("text, stop, expected", [
    (TEXTS["chinese"], "世界", "你好，"),
    (TEXTS["emoji"], "🎊", "Party time 🎉"),
])
def test_stop_string_of_multi_token_characters(smollm2, text, stop, expected):
    det, stop_str, _, seen = run_stop(smollm2, text, [stop])
    assert (stop_str, det.output_text) == (stop, expected)
    assert not any("\ufffd" in s for s in seen)


def test_special_token_as_stop_string(smollm2):
    ids = chat_ids(smollm2) + encode(smollm2, "more")
    det = IncrementalDetokenizer(smollm2, [], skip_special_tokens=False,
                                 spaces_between_special_tokens=False, stop=["<|im_end|>"])
    delta, stop_str = det.update(ids)
    assert (delta, stop_str) == ("<|im_start|>assistant\nHi there", "<|im_end|>")
    assert det.output_text == delta and det.truncate_token_ids_to == len(chat_ids(smollm2))


# -- min_tokens and stop tokens ---------------------------------------------------------------

def run_min_tokens(tokenizer, stop: list[str], min_tokens: int, chunk: int) -> tuple[str, str | None]:
    """PARIS streamed ``chunk`` tokens at a time: ``(the text, the stop string that ended it)``."""
    det = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Tell me:"), stop=stop, min_tokens=min_tokens)
    ids, deltas = encode(tokenizer, PARIS), []
    for i in range(0, len(ids), chunk):
        delta, stop_str = det.update(ids[i:i + chunk], finished=i + chunk >= len(ids))
        deltas.append(delta)
        if stop_str is not None:
            break
    assert "".join(deltas) == det.output_text
    return det.output_text, stop_str


@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("min_tokens, expected", [
    (0, "The capital of France "),  # " is" (token 5) matches "is"
    (5, "The capital of France is Par"),  # the first 5 tokens' "is" is text; " Paris" (token 6) matches
    (6, "The capital of France is Paris. It "),
    (100, PARIS),  # never past min_tokens: no match at all
])
def test_min_tokens_holds_back_stop_strings(smollm2, min_tokens, expected, chunk):
    assert [smollm2.decode([i]) for i in encode(smollm2, PARIS)[:6]] == [
        "The", " capital", " of", " France", " is", " Paris"]
    text, stop_str = run_min_tokens(smollm2, ["is"], min_tokens, chunk)
    assert text == expected and stop_str == (None if expected == PARIS else "is")


def test_stop_string_may_start_within_min_tokens(smollm2):
    # "France" is text of token 4, " is" of token 5: the match ends past min_tokens=4 and counts
    text, stop_str = run_min_tokens(smollm2, ["France is"], 4, 1)
    assert (text, stop_str) == ("The capital of ", "France is")
    text, stop_str = run_min_tokens(smollm2, ["France is"], 5, 1)
    assert (text, stop_str) == (PARIS, None)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 100])
def test_stop_token_text_is_left_out(smollm2, include, chunk):
    ids = encode(smollm2, "Paris, France")  # "Paris" "," " France": ends at the stop token ","
    ids = ids[:ids.index(encode(smollm2, ",")[0]) + 1]
    det = IncrementalDetokenizer(smollm2, [], include_stop_str_in_output=include)
    deltas = [det.update(ids[i:i + chunk], finished=i + chunk >= len(ids), stop_terminated=i + chunk >= len(ids))[0]
              for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == det.output_text == ("Paris," if include else "Paris")
