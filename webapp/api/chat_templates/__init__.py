"""Chat templates Tessera ships for models whose own template knows no tools.

``TOOL_USE_TEMPLATES`` maps a packaged model's name to a Jinja file in this folder; the
templates take the ``tools`` and ``messages`` (with ``tool_calls`` and ``role: "tool"``)
that ``apply_chat_template`` passes, and ask for calls in the hermes format, which
``webapp.api.tool_parsers`` reads back with the ``hermes`` parser.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).resolve().parent

TOOL_USE_TEMPLATES: dict[str, str] = {
    "smollm2-135m-instruct": "smollm2_tool_use.jinja",
}


@lru_cache(maxsize=None)
def _read(file_name: str) -> str:
    return (_HERE / file_name).read_text(encoding="utf-8")


def tool_use_template(model_name: str) -> str | None:
    """The tool-capable chat template (Jinja source) for ``model_name``, or None if there is none.

    Raises:
        OSError: the template file listed for the model cannot be read.
    """
    file_name = TOOL_USE_TEMPLATES.get(model_name)
    return None if file_name is None else _read(file_name)
