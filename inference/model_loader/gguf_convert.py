"""Convert one GGUF file into a Hugging Face style directory.

The output holds ``config.json``, the tokenizer files (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) and ``model.safetensors`` with
float32 weights. Config and tokenizer come from transformers' own GGUF readers
(``from_pretrained(..., gguf_file=...)``), patched where they fall short (see
``_convert_config``); the weights are dequantized here with the ``gguf`` library (see
``gguf_tensors``). Writing is not atomic: ``gguf_cache`` converts into a temporary
directory and renames it.

Peak memory is about the float32 size of the model (4 bytes per parameter, about
540 MB for SmolLM2-135M), because ``safetensors.torch.save_file`` takes a whole dict.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ModelLoadError, UnsupportedArchitectureError
from .gguf_tensors import iter_gguf_tensors
from .hf_config import SUPPORTED_ARCHITECTURES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"

# GGUF ``general.architecture`` values we convert (transformers' name for each is the
# config's model_type, e.g. "llama" → LlamaConfig).
GGUF_ARCHITECTURES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

# Errors transformers and gguf raise for a file they cannot parse.
_PARSE_ERRORS = (OSError, ValueError, KeyError, IndexError, TypeError, NotImplementedError)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    """Write the Hugging Face form of ``gguf_path`` into the existing ``out_dir``.

    Takes seconds to minutes (SmolLM2-135M Q4_1: 20-25 s on 2 CPU cores, two thirds of it
    ``gguf.GGUFReader`` parsing the 49k-entry vocabulary, once for the config and once
    for the tokenizer inside transformers, once for us).

    Raises:
        UnsupportedArchitectureError: the file's architecture is not llama, mistral,
            qwen2 or qwen3.
        ModelLoadError: the file is not a readable GGUF file, or holds a tensor or
            quantization type this converter does not handle.
    """
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    started = time.perf_counter()
    try:
        reader = GGUFReader(gguf_path)
    except _PARSE_ERRORS as exc:
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
    architecture = str(_field(reader, "general.architecture", ""))
    if architecture not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF file {gguf_path} has architecture {architecture!r}; supported GGUF architectures: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))} (i.e. {', '.join(SUPPORTED_ARCHITECTURES.values())}).")

    config = _convert_config(gguf_path, reader, architecture)
    _convert_tokenizer(gguf_path, reader, out_dir)
    _convert_weights(reader, architecture, config, out_dir / WEIGHTS_FILE)
    config.save_pretrained(out_dir)
    logger.info("Converted %s (%s) into %s in %.1f s", gguf_path, architecture, out_dir,
                time.perf_counter() - started)


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _convert_config(gguf_path: Path, reader, architecture: str) -> PretrainedConfig:
    """transformers' GGUF config, with what it leaves out or gets wrong filled in.

    * ``architectures`` is not set by transformers; the engine dispatches on it.
    * ``dtype`` is set to float32, the dtype of the weights we write.
    * ``tie_word_embeddings`` is true exactly when the file has no ``output.weight``.
    * ``head_dim`` is taken from ``<arch>.attention.key_length`` or the Q projection's
      row count: transformers' Qwen3 mapping omits it, and Qwen3 heads are not
      ``hidden_size / num_heads`` wide (Qwen3-0.6B: 128, not 64).
    """
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    except _PARSE_ERRORS as exc:
        raise ModelLoadError(f"Cannot read the config of GGUF file {gguf_path}: {exc}") from exc
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF file {gguf_path} reads as model_type {config.model_type!r}; supported architectures: "
            f"{', '.join(SUPPORTED_ARCHITECTURES.values())}.")
    config.architectures = [SUPPORTED_ARCHITECTURES[config.model_type]]
    config.dtype = torch.float32
    tensor_names = {tensor.name for tensor in reader.tensors}
    config.tie_word_embeddings = "output.weight" not in tensor_names
    config.head_dim = _head_dim(reader, architecture, config.num_attention_heads)
    return config


def _head_dim(reader, architecture: str, num_heads: int) -> int:
    q_rows = next((int(t.shape[-1]) for t in reader.tensors if t.name == "blk.0.attn_q.weight"), None)
    if q_rows is None:
        raise ModelLoadError("GGUF file has no blk.0.attn_q.weight tensor.")
    key_length = _field(reader, f"{architecture}.attention.key_length")
    head_dim = int(key_length) if key_length is not None else q_rows // num_heads
    if head_dim * num_heads != q_rows:
        raise ModelLoadError(
            f"GGUF Q projection has {q_rows} rows, which is not {num_heads} heads of {head_dim}.")
    return head_dim


def _convert_tokenizer(gguf_path: Path, reader, out_dir: Path) -> None:
    """Save transformers' GGUF tokenizer, making sure the chat template comes along."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True)
    except _PARSE_ERRORS as exc:
        raise ModelLoadError(f"Cannot read the tokenizer of GGUF file {gguf_path}: {exc}") from exc
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))


def _convert_weights(reader, architecture: str, config: PretrainedConfig, path: Path) -> None:
    from safetensors.torch import save_file

    tensors = dict(iter_gguf_tensors(
        reader, architecture, config.num_attention_heads, config.num_key_value_heads))
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        expected.add("lm_head.weight")
    missing = expected - tensors.keys()
    if missing:
        raise ModelLoadError(f"GGUF file lacks tensors for {sorted(missing)}.")
    save_file(tensors, str(path), metadata={"format": "pt", "converted_from": "gguf"})
