"""Checks on a served model's ``source`` and a LoRA adapter's ``path`` before they are saved: the forms the
engine accepts.

Only cheap checks run here (names and paths), on the machine of the web process: a GGUF
file is converted, and weights are read, only by the worker that loads the model, which
reports what fails then (see ``Worker.error``). Workers on other machines need the same
paths there.
"""
from __future__ import annotations

from pathlib import Path

from django.core.exceptions import ValidationError

from inference import LoRARequest
from inference.errors import InvalidRequestError
from inference.lora.checkpoint import read_adapter_config
from inference.model_loader.sources import PACKAGED_MODEL_NAMES

ACCEPTED = ("the packaged model's name (smollm2-135m-instruct), a Hugging Face model directory holding "
            "config.json, or a .gguf file")


def validate_source(source: str) -> None:
    """Raises:
        ValidationError: ``source`` is none of the accepted forms (the message says which
            forms are accepted, and what is wrong with a path).
    """
    if source.strip().lower() in PACKAGED_MODEL_NAMES:
        return
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValidationError(f"The directory {source} holds no config.json; expected {ACCEPTED}.")
        return
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValidationError(f"The GGUF file {source} does not exist.")
        return
    raise ValidationError(f"'{source}' is not a model source: expected {ACCEPTED}.")


def validate_adapter_path(path: str) -> None:
    """The engine's checks of a PEFT adapter that need no model: the folder, ``adapter_config.json`` and what
    it asks for (:func:`inference.lora.checkpoint.read_adapter_config`). The rank and the tensors' shapes are
    checked by a worker that loads it.

    Raises:
        ValidationError: the engine's reason, naming the folder or the field.
    """
    request = LoRARequest("adapter", 1, path.strip())  # the field's own check: the name is not known here
    try:
        read_adapter_config(request)
    except InvalidRequestError as error:
        prefix = f"LoRA adapter {request.lora_name!r} (lora_path={request.lora_path!r}): "
        raise ValidationError(f"{request.lora_path}: {str(error).removeprefix(prefix)}") from None
