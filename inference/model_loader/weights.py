"""Stream a checkpoint's tensors from a Hugging Face style directory.

Two on-disk formats are read: ``*.safetensors`` (preferred, memory-mapped through
``safetensors.safe_open``) and, when a directory has none, the older pickled
``pytorch_model*.bin`` files (``torch.load(weights_only=True, mmap=True)``, which runs
no arbitrary code). Sharded checkpoints are simply every matching file, read in
sorted order; the ``*.index.json`` files are not needed for that.
"""
from __future__ import annotations

import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import ModelLoadError

# What torch.load and safe_open raise for a truncated, corrupt or foreign file.
_READ_ERRORS = (
    SafetensorError, OSError, RuntimeError, ValueError, EOFError,
    pickle.UnpicklingError, zipfile.BadZipFile,
)


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint files of ``model_dir``, in the order ``iter_weights`` reads them.

    Returns every ``*.safetensors`` file if there is at least one, else every
    ``pytorch_model*.bin`` file, sorted by name.

    Raises:
        ModelLoadError: the directory holds neither kind of file.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        files = sorted(model_dir.glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(
            f"No weights in {model_dir}: expected *.safetensors or pytorch_model*.bin files.")
    return files


def iter_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in ``model_dir``.

    Names are the checkpoint's own (Hugging Face names such as
    ``model.layers.0.self_attn.q_proj.weight``); tensors keep their stored dtype and
    shape and live on the CPU. Tied weights the checkpoint omits (``lm_head.weight``
    when ``tie_word_embeddings`` is set) are not invented here. Files are opened one at
    a time, so at most one ``.bin`` shard is mapped at once.

    Raises:
        ModelLoadError: no weight files, or a file is truncated, corrupt or not a
            checkpoint (the message names the file).
    """
    for path in weight_files(model_dir):
        if path.suffix == ".safetensors":
            yield from _iter_safetensors(path)
        else:
            yield from _iter_torch_bin(path)


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # safe_open checks the header and that the data section matches the file size,
    # so a truncated file fails here rather than with SIGBUS on a mapped page.
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except _READ_ERRORS as exc:
        raise _unreadable(path, exc) from exc
    with handle:
        for name in list(handle.keys()):
            try:
                tensor = handle.get_tensor(name)
            except _READ_ERRORS as exc:
                raise _unreadable(path, exc) from exc
            yield name, tensor


def _iter_torch_bin(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except _READ_ERRORS as exc:
        raise _unreadable(path, exc) from exc
    if not isinstance(state_dict, dict):
        raise ModelLoadError(f"Weights file {path} does not hold a state dict (got {type(state_dict).__name__}).")
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor):
            raise ModelLoadError(f"Weights file {path}: entry {name!r} is not a tensor.")
        yield name, tensor


def _unreadable(path: Path, exc: BaseException) -> ModelLoadError:
    return ModelLoadError(
        f"Weights file {path} is truncated or corrupt ({type(exc).__name__}: {exc}).")
