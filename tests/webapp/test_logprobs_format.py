"""Log-probabilities from the engine's ``Logprob`` through the worker's wire message to the OpenAI objects."""
from __future__ import annotations

import json

from inference.outputs import CompletionOutput, Logprob, RequestOutput
from webapp.api.formatting import chat_logprobs, completion_logprobs, echo_logprobs
from webapp.serving.messages import encode_output

# SmolLM2 splits "日" (E6 97 A5) as " \xe6" + "\x97" + "\xa5": each token alone decodes to U+FFFD
POSITIONS = [
    {17097: Logprob(-0.5, 1, " \ufffd", [0x20, 0xE6]), 330: Logprob(-1.5, 2, " the")},
    {241: Logprob(-0.1, 1, "\ufffd", [0x97]), 115: Logprob(-3.0, 2, "\ufffd", [0xA5])},
]


def _wire_positions() -> list:
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, " \ufffd\ufffd", [17097, 241], logprobs=POSITIONS)])
    return json.loads(json.dumps(encode_output(out)))["outputs"][0]["logprobs"]


def test_chat_bytes_are_the_tokens_own_through_the_wire():
    content = chat_logprobs(_wire_positions(), [17097, 241], top_n=2)["content"]
    assert [c["token"] for c in content] == [" \ufffd", "\ufffd"]
    assert [c["bytes"] for c in content] == [[0x20, 0xE6], [0x97]]
    assert [[t["bytes"] for t in c["top_logprobs"]] for c in content] == [[[0x20, 0xE6], list(b" the")],
                                                                          [[0x97], [0xA5]]]
    assert bytes(sum((c["bytes"] for c in content), [])) + bytes([0xA5]) == " 日".encode("utf-8")


def test_whole_tokens_keep_four_items_and_their_texts_bytes():
    wire = _wire_positions()
    assert [len(entry) for entry in wire[0]] == [5, 4]
    legacy = completion_logprobs(wire, [17097, 241], top_n=2, text_offset=0)
    assert legacy["top_logprobs"][0] == {"bytes: \\xe6": -0.5, " the": -1.5}  # a whole token keeps its text


def test_legacy_tokens_that_are_part_of_a_character_keep_their_own_keys_and_their_characters_offset():
    """Legacy completions write such a token as OpenAI does (``bytes:`` and its bytes): the alternatives of one
    position stay apart instead of all being U+FFFD, and a token's offset is that of its character."""
    legacy = completion_logprobs(_wire_positions(), [17097, 241], top_n=2, text_offset=7)
    assert legacy["tokens"] == ["bytes: \\xe6", "bytes:\\x97"]
    assert legacy["top_logprobs"][1] == {"bytes:\\x97": -0.1, "bytes:\\xa5": -3.0}  # two entries, not one
    assert legacy["text_offset"] == [7, 8]  # after the space, both in 日's place


def test_echo_with_a_character_split_over_tokens():
    """``echo``: the first prompt token's text is what the prompt has before the others' bytes, and offsets count
    characters (seen: an emoji at the prompt's end made the first token '' and every offset wrong)."""
    prompt = [None, *_wire_positions(), [[115, -0.2, 1, "\ufffd", [0xA5]]]]  # "Hi" + " \xe6" + "\x97" + "\xa5"
    echoed = echo_logprobs(prompt, [12000, 17097, 241, 115], "Hi 日", [[[30, -0.3, 1, "!"]]], [30], top_n=0)
    assert echoed["tokens"] == ["Hi", "bytes: \\xe6", "bytes:\\x97", "bytes:\\xa5", "!"]
    assert echoed["text_offset"] == [0, 2, 3, 3, 4]
    assert echoed["token_logprobs"] == [None, -0.5, -0.1, -0.2, -0.3]
