"""Incremental detokenization on SmolLM2's byte-level BPE tokenizer and a SentencePiece-style one
(``tokenizer_samples``): plain text, partial characters, leading spaces, special tokens."""
from __future__ import annotations

import random

import pytest

from inference.detokenizer import IncrementalDetokenizer, special_token_ids
from tests.inference.tokenizer_samples import (TEXTS, chat_ids, encode, sentencepiece, smollm2,  # noqa: F401
                                              split_characters, stream)



# -- plain detokenization ------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_deltas_concatenate_to_decode(smollm2, name, chunk):
    ids = encode(smollm2, TEXTS[name])
    if name in ("chinese", "emoji", "mixed"):
        assert split_characters(smollm2, ids)  # the text exercises multi-token characters
    det = IncrementalDetokenizer(smollm2, encode(smollm2, "Write something:"))
    deltas = stream(det, ids, chunk)
    assert "".join(deltas) == det.output_text == smollm2.decode(ids) == TEXTS[name]
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("skip,spaces", [(True, True), (False, False), (False, True)])
@pytest.mark.parametrize("tokenizer", ["smollm2", "sentencepiece"])
def test_multi_token_updates_give_the_token_by_token_text(request, tokenizer, skip, spaces):
    """Several tokens per update (a multi-step window; a FINAL_ONLY output decoded once at its finish) give
    the text of one token per update, on text and on random ids (invalid bytes, partial characters, special
    tokens); after invalid bytes, up to the number of U+FFFD showing them."""
    tok = request.getfixturevalue(tokenizer)
    rng, specials = random.Random(0), sorted(special_token_ids(tok))
    prompt = encode(tok, "Write something:")
    for trial in range(30):
        if trial % 2:
            ids = [rng.randrange(len(tok)) for _ in range(rng.randint(2, 60))]
        else:
            ids = encode(tok, TEXTS[sorted(TEXTS)[trial // 2 % len(TEXTS)]])
        if trial % 3 == 0:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        make = lambda: IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip,  # noqa: E731
                                              spaces_between_special_tokens=spaces)
        expected = "".join(stream(make(), ids, 1))
        for chunk in (3, 8, len(ids)):
            det = make()
            got = "".join(stream(det, ids, chunk))
            assert got == det.output_text and _same_text(got, expected), (trial, chunk)
        det = make()
        assert det.update(ids, finished=True) == (expected, None) and det.output_text == expected


def _same_text(got: str, expected: str) -> bool:
    """Equal, or when invalid bytes show as U+FFFD, equal up to how many (see ``_append_many``)."""
    return got == expected or ("\ufffd" in expected and got.replace("\ufffd", "") == expected.replace("\ufffd", ""))


def test_multi_token_update_then_invalid_byte_fallback_bytes(sentencepiece):
    """Valid text in a multi-token update, then bytes that never complete a character: the same text as one
    token per update but for the number of U+FFFD (the byte-fallback decoder replaces the window's whole run)."""
    tok = sentencepiece
    ids = (encode(tok, "He") + [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "机器学习很".encode()]
           + [tok.convert_tokens_to_ids("<0xE6>"), tok.convert_tokens_to_ids("<0x9C>")] + encode(tok, " a"))
    one = "".join(stream(IncrementalDetokenizer(tok, []), ids, 1))
    det = IncrementalDetokenizer(tok, [])
    bulk = "".join([det.update(ids[:10])[0]] + stream(det, ids[10:], 1))
    assert one.startswith("He机器学习很\ufffd") and one.endswith("\ufffd a")
    assert _same_text(bulk, one)


def test_partial_character_is_held_until_complete(smollm2):
    ids = encode(smollm2, "a 🎉")
    assert len(ids) >= 3 and smollm2.decode(ids[:-1]).endswith("\ufffd")
    det = IncrementalDetokenizer(smollm2, [])
    deltas = [det.update([i])[0] for i in ids]
    assert deltas[-2] == "" and deltas[-1].endswith("🎉")
    assert det.output_text == "a 🎉"


def test_partial_character_at_finish_is_dropped(smollm2):
    """max_tokens cutting an emoji: the text ends before it (vLLM), not in U+FFFD."""
    ids = encode(smollm2, "ok 🎉")[:-1]
    assert smollm2.decode(ids).endswith("\ufffd")
    for chunk in (1, len(ids)):
        det = IncrementalDetokenizer(smollm2, [])
        deltas = stream(det, ids, chunk)
        assert "".join(deltas) == "ok " == det.output_text


def test_prompt_cut_inside_a_character(smollm2):
    full = encode(smollm2, TEXTS["emoji"])
    text = smollm2.decode(full)
    cuts = 0
    for k in range(1, len(full)):
        det = IncrementalDetokenizer(smollm2, full[:k])
        out = "".join(stream(det, full[k:]))
        j = k  # the character the prompt split is shown whole, in the output
        while not text.startswith(smollm2.decode(full[:j])):
            j -= 1
        cuts += j < k
        assert out == text[len(smollm2.decode(full[:j])):]
    assert cuts > 0


def test_output_window_stays_small(smollm2):
    ids = encode(smollm2, " hello world 🎉" * 400)
    det = IncrementalDetokenizer(smollm2, [], stop=["never"])
    for i in ids:
        det.update([i])
        assert len(det._ids) <= 16  # decode cost per step does not grow with the output
    det.update([], finished=True)
    assert det.output_text == smollm2.decode(ids)


def test_invalid_bytes_are_emitted_and_window_stays_small(smollm2):
    stray = smollm2.convert_tokens_to_ids("ĳ")  # a lone UTF-8 continuation byte
    ids = [stray] * 100 + encode(smollm2, " ok")
    det = IncrementalDetokenizer(smollm2, [])
    for i in ids[:100]:
        det.update([i])
        assert len(det._ids) <= 32
    assert det.output_text.count("\ufffd") >= 80  # not held back until finish
    det.update(ids[100:], finished=True)
    assert det.output_text == smollm2.decode(ids) == "\ufffd" * 100 + " ok"


# -- SentencePiece-style leading spaces -----------------------------------------------------

def test_first_token_gets_its_space_from_the_prompt(sentencepiece):
    full = encode(sentencepiece, "Hello world")
    prompt, output = full[:1], full[1:]
    assert sentencepiece.convert_ids_to_tokens(output[0]).startswith("▁")
    assert sentencepiece.decode(output) == "world"  # decoded alone, the space is lost
    det = IncrementalDetokenizer(sentencepiece, prompt)
    assert "".join(stream(det, output)) == " world"


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_sentencepiece_deltas_match_decode_in_context(sentencepiece, name):
    full = encode(sentencepiece, "The lazy fox said: " + TEXTS[name])
    if name in ("emoji", "mixed"):
        assert split_characters(sentencepiece, full)  # byte-fallback pieces for unseen chars
    text = sentencepiece.decode(full)
    for k in (1, 5):
        det = IncrementalDetokenizer(sentencepiece, full[:k])
        deltas = stream(det, full[k:])
        assert "".join(deltas) == text[len(sentencepiece.decode(full[:k])):]
        assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_without_prompt_matches_decode(sentencepiece):
    ids = encode(sentencepiece, "Hello world 🎉 fox")
    assert "".join(stream(IncrementalDetokenizer(sentencepiece, []), ids)) == "Hello world 🎉 fox"


# -- special tokens -------------------------------------------------------------------------


def test_special_tokens_skipped(smollm2):
    ids = chat_ids(smollm2) + [smollm2.convert_tokens_to_ids("<repo_name>")]
    det = IncrementalDetokenizer(smollm2, [], skip_special_tokens=True)
    assert "".join(stream(det, ids)) == smollm2.decode(ids, skip_special_tokens=True)
    assert det.output_text == "assistant\nHi there"


def test_special_tokens_kept_without_spaces(smollm2):
    ids = chat_ids(smollm2)
    det = IncrementalDetokenizer(smollm2, [], skip_special_tokens=False,
                                 spaces_between_special_tokens=False)
    assert "".join(stream(det, ids)) == smollm2.decode(ids, skip_special_tokens=False)
    assert det.output_text == "<|im_start|>assistant\nHi there<|im_end|>"


def test_special_tokens_kept_with_spaces(smollm2):
    prompt = chat_ids(smollm2)  # ends in a special token: no space before the first text
    det = IncrementalDetokenizer(smollm2, prompt, skip_special_tokens=False)
    assert "".join(stream(det, chat_ids(smollm2))) == "<|im_start|> assistant\nHi there <|im_end|>"
    det = IncrementalDetokenizer(smollm2, prompt, skip_special_tokens=False)
    assert "".join(stream(det, encode(smollm2, "Hi") + chat_ids(smollm2)[:1])) == "Hi <|im_start|>"


def test_sentencepiece_special_tokens(sentencepiece):
    ids = [1] + encode(sentencepiece, "Hello world") + [2]
    det = IncrementalDetokenizer(sentencepiece, [], skip_special_tokens=False,
                                 spaces_between_special_tokens=False)
    assert "".join(stream(det, ids)) == sentencepiece.decode(ids, skip_special_tokens=False)
    det = IncrementalDetokenizer(sentencepiece, [], skip_special_tokens=False)
    assert "".join(stream(det, ids)) == "<s> Hello world </s>"
    det = IncrementalDetokenizer(sentencepiece, [1])
    assert "".join(stream(det, ids)) == "Hello world"
