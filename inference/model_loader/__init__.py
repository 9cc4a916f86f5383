"""Find a model's files and read its config, tokenizer and weights.

``resolve_model`` turns the user's ``model`` argument (a Hugging Face directory, a GGUF
file, the packaged SmolLM2 name, or a weightless benchmark shape such as ``qwen2.5-7b``)
into a Hugging Face style directory, converting GGUF files once into a cache. The other
functions read such a directory; none of them touches the network.

Typical use by the model runner::

    resolved = resolve_model("SmolLM2-135M-Instruct")
    hf_config = load_hf_config(resolved.model_dir)
    architecture = check_architecture(hf_config)
    tokenizer = load_tokenizer(resolved.tokenizer_dir)
    for name, tensor in iter_weights(resolved.model_dir):
        ...
"""
from __future__ import annotations

from .hf_config import SUPPORTED_ARCHITECTURES, check_architecture, load_hf_config, load_tokenizer
from .sources import ResolvedModel, is_dummy_only, resolve_model
from .weights import iter_weights

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ResolvedModel",
    "check_architecture",
    "is_dummy_only",
    "iter_weights",
    "load_hf_config",
    "load_tokenizer",
    "resolve_model",
]
