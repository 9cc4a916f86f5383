"""Tokenizers of the served models, loaded in the web process (no weights), and chat templates.

The web process tokenizes (and applies the chat template) before enqueueing, so that it can
reject a prompt that does not fit the context without bothering a worker.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from django.conf import settings

from inference.errors import ModelLoadError
from inference.model_loader import load_tokenizer, resolve_model
from inference.token_bytes import partial_token_bytes
from inference.model_loader.sources import PACKAGED_MODEL_NAMES

from .chat_templates import tool_use_template

from .errors import APIError, bad_request

logger = logging.getLogger(__name__)


def read_chat_template(option: str) -> str:
    """``--chat-template``'s value as a template: the value itself when it holds ``{`` or a line break (Jinja
    text), else the text of the file it names (``~`` expanded), as vLLM reads it.

    Raises:
        ValueError: the value names no readable file (naming the path).
    """
    if "{" in option or "\n" in option:
        return option
    path = Path(option).expanduser()
    try:
        return path.read_text()
    except OSError as error:
        raise ValueError(f"--chat-template: {option!r} is not a readable file ({error.strerror or error}); "
                         "give a file, or the Jinja template itself") from None


@dataclass(frozen=True)
class ServedModel:
    """A model this server answers for.

    Attributes:
        name: the name clients send in ``"model"`` (``--served-model-name``).
        model: what the engine loads (packaged name, directory or GGUF file).
        tokenizer: tokenizer source when it differs from ``model``.
        chat_template: a Jinja template, or a path to a file with one (``--chat-template``).
    """

    name: str
    model: str
    tokenizer: str | None = None
    chat_template: str | None = None


def served_models() -> list[ServedModel]:
    """The models configured in settings (one per ``manage.py serve``); which models are live
    now, and the lookup of a request's model, are in :mod:`.served`."""
    cfg = settings.TESSERA
    return [ServedModel(cfg["SERVED_MODEL_NAME"], cfg["MODEL"], cfg["TOKENIZER"], cfg["CHAT_TEMPLATE"])]


class Tokenizer:
    """A served model's Hugging Face tokenizer and its chat template."""

    def __init__(self, served: ServedModel) -> None:
        resolved = resolve_model(served.model, served.tokenizer, load_format="dummy")  # tokenizer only: no weights read
        self.hf = load_tokenizer(resolved.tokenizer_dir)
        self._template_option = served.chat_template
        self._packaged = served.model.lower() in PACKAGED_MODEL_NAMES and served.tokenizer is None
        # An upper bound on the characters of text one token covers: its longest vocabulary entry (byte-level
        # BPE spells each byte as one character, SentencePiece each character as itself), at least 16. Here,
        # where the tokenizer loads off the event loop: a 150K vocabulary takes a moment.
        self.max_token_chars = max(16, max((len(token) for token in self.hf.get_vocab()), default=0))

    @cached_property
    def chat_template(self) -> str | None:
        """``--chat-template`` if given; for the packaged model, Tessera's tool-capable template
        (the same prompt as the model's own without tools); else the tokenizer's."""
        option = self._template_option
        if option:
            return read_chat_template(option)
        if self._packaged:
            return tool_use_template("smollm2-135m-instruct")
        return getattr(self.hf, "chat_template", None) or None

    @cached_property
    def vocab_size(self) -> int:
        return len(self.hf)

    def max_text_chars(self, max_model_len: int) -> int:
        """Characters beyond which a text cannot fit ``max_model_len`` tokens, with a margin of 2 for
        normalizers that shorten text; longer texts are refused without tokenizing them (a 33 MB prompt took a
        web process to 6 GB and 20 s before its 400)."""
        return 2 * max_model_len * self.max_token_chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes of one token (also of one that is part of a character, whose text alone is U+FFFD)."""
        text = self.hf.decode([token_id])
        return bytes(partial_token_bytes(self.hf, token_id, text) or text.encode("utf-8"))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render the conversation (and the ``tools`` the model may call) to prompt text.

        Raises:
            APIError: 400 when the tokenizer has no chat template (naming ``--chat-template``)
                or the template fails on these messages.
        """
        if self.chat_template is None:
            raise bad_request(
                "This model's tokenizer has no chat template, so chat requests cannot be formatted. "
                "Start the server with --chat-template <file or Jinja string>, or use /v1/completions.",
                param="messages", code="chat_template_missing")
        try:
            return self.hf.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, tools=tools or None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
        except Exception as error:  # Jinja errors of all kinds: the messages do not fit the template
            raise bad_request(f"The chat template could not format these messages: {error}",
                              param="messages") from error


_tokenizers: dict[ServedModel, Tokenizer] = {}  # by the whole spec: a model reloaded from elsewhere gets its own
_lock = threading.Lock()


def cached_tokenizer(served: ServedModel) -> Tokenizer | None:
    """The tokenizer of ``served`` if it is loaded already (never blocks)."""
    return _tokenizers.get(served)


def get_tokenizer(served: ServedModel) -> Tokenizer:
    """The (cached) tokenizer of ``served``.

    Raises:
        APIError: 503 when the model's tokenizer cannot be loaded.
    """
    tokenizer = _tokenizers.get(served)
    if tokenizer is None:
        with _lock:
            tokenizer = _tokenizers.get(served)
            if tokenizer is None:
                try:
                    tokenizer = _tokenizers[served] = Tokenizer(served)
                except ModelLoadError as error:
                    raise APIError(f"The tokenizer of '{served.name}' cannot be loaded: {error}", 503) from error
    return tokenizer


def warm_up_tokenizers() -> None:
    """Load the tokenizers in the background, so the first request does not wait for them."""
    def load() -> None:
        for served in served_models():
            try:
                get_tokenizer(served)
            except APIError as error:
                logger.warning("%s", error.message)

    threading.Thread(target=load, name="tessera-tokenizer-warmup", daemon=True).start()
