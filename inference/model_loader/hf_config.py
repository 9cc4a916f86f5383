"""Read a model directory's config and tokenizer, and check the engine implements it.

Everything here reads local files only: paths are passed to ``from_pretrained`` with
``local_files_only=True``, so no call ever reaches the Hugging Face Hub. transformers
is imported inside the functions because importing it takes seconds and a cache hit in
``resolve_model`` should not pay for it.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ModelLoadError, UnsupportedArchitectureError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# Architectures the engine's model code implements, keyed by the config's model_type.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """Load ``model_dir/config.json`` as a transformers config.

    Raises:
        ModelLoadError: ``config.json`` is missing, is not valid JSON, or names a
            ``model_type`` that transformers does not know.
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelLoadError(f"No config.json in {model_dir}.")
    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"Cannot read {model_dir / 'config.json'}: {exc}") from exc


def check_architecture(hf_config: PretrainedConfig) -> str:
    """Return the architecture name the engine will run for ``hf_config``.

    The first entry of ``hf_config.architectures`` that the engine supports wins; a
    config without ``architectures`` falls back to its ``model_type`` (``"llama"`` →
    ``"LlamaForCausalLM"``).

    Returns:
        One of ``"LlamaForCausalLM"``, ``"MistralForCausalLM"``, ``"Qwen2ForCausalLM"``,
        ``"Qwen3ForCausalLM"``.

    Raises:
        UnsupportedArchitectureError: none of them; the message lists the supported ones.
    """
    supported = set(SUPPORTED_ARCHITECTURES.values())
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in supported:
            return arch
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[model_type]
    given = ", ".join(architectures) if architectures else f"model_type {model_type!r}"
    raise UnsupportedArchitectureError(
        f"Architecture {given} is not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES.values())}.")


def load_tokenizer(tokenizer_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in ``tokenizer_dir`` (``tokenizer.json`` and friends).

    The chat template comes along when the directory has one (``chat_template.jinja``
    or the ``chat_template`` key of ``tokenizer_config.json``).

    Raises:
        ModelLoadError (param ``"tokenizer"``): the directory is missing or holds no
            tokenizer transformers can load.
    """
    from transformers import AutoTokenizer

    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise ModelLoadError(f"Tokenizer directory {tokenizer_dir} does not exist.", param="tokenizer")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"Cannot load a tokenizer from {tokenizer_dir}: {exc}", param="tokenizer") from exc
