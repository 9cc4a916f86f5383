"""What a request's output must match: vLLM's ``StructuredOutputsParams``.

Exactly one of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (EBNF, xgrammar's
dialect of GBNF) or ``json_object`` (any JSON object) is given. The constraint is checked when
the params are built, by building the grammar without a tokenizer (xgrammar's
``Grammar.from_*``), so a bad schema or an unsupported regex construct is refused before the
request is queued; compiling it against the model's vocabulary happens in the engine
(:mod:`.compiler`).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

from ..errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 20  # characters of a schema, regex or grammar (1 MiB)
_VALIDATED_CACHE_SIZE = 1024  # distinct constraints whose validity is remembered
_validated: OrderedDict[tuple[str, str, bool, bool], None] = OrderedDict()
_validated_lock = threading.Lock()
_LOCATION = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: ")  # xgrammar's "[time] file.cc:line: " prefix


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output text (vLLM's names).

    Args:
        json: a JSON schema (a dict, or its JSON text); the output is one JSON value valid
            under it.
        regex: a regular expression the whole output matches (no lookaround or
            backreferences).
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's GBNF dialect, start symbol ``root``).
        json_object: any JSON object.
        disable_any_whitespace: JSON with fixed separators (``", "``, ``": "``) and no other
            whitespace between tokens. On by default, unlike vLLM: small models given free
            whitespace loop on newlines until ``max_tokens``; the output validates the same.
        strict: for ``json``: additional properties and items only where the schema allows
            them explicitly (OpenAI's ``strict: true``); otherwise JSON Schema's defaults.

    Raises:
        InvalidRequestError: not exactly one constraint given, a value of the wrong type, or a
            schema / regex / grammar xgrammar cannot build (``param`` names the field, e.g.
            ``structured_outputs.json``).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = True
    strict: bool = False

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured_outputs must give exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}.", param="structured_outputs")
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json, separators=(",", ":")))
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                                          f"got {self.choice!r:.80}.", param="structured_outputs.choice")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidRequestError(f"structured_outputs.{name} must be a string, got {type(value).__name__}.",
                                          param=f"structured_outputs.{name}")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise InvalidRequestError(f"structured_outputs.{name} must be at most {MAX_SPEC_CHARS} characters, "
                                          f"got {len(value)}.", param=f"structured_outputs.{name}")
        for name in ("json_object", "disable_any_whitespace", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"structured_outputs.{name} must be true or false.",
                                          param=f"structured_outputs.{name}")
        self._check_buildable()

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict[str, Any]) -> StructuredOutputsParams:
        """``value`` itself, or built from a dict of its fields (the wire and API form).

        Raises:
            InvalidRequestError: ``value`` is neither, or has an unknown field.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"structured_outputs must be an object, got {type(value).__name__}.",
                                      param="structured_outputs")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; known: "
                                      f"{', '.join(sorted(known))}.", param="structured_outputs")
        return cls(**value)

    @property
    def kind(self) -> str:
        """Which constraint: one of :data:`KINDS`."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool, bool]:
        """What identifies the compiled grammar: ``(kind, spec, disable_any_whitespace, strict)``."""
        kind = self.kind
        spec = {"choice": lambda: json.dumps(list(self.choice)), "json_object": lambda: ""}.get(
            kind, lambda: getattr(self, kind))()
        return kind, spec, self.disable_any_whitespace, self.strict

    def build_grammar(self):
        """The ``xgrammar.Grammar`` of this constraint (no tokenizer involved).

        Raises:
            RuntimeError: xgrammar cannot build it (the message says why).
        """
        import xgrammar as xgr  # noqa: PLC0415 - imported where constraints are used

        kind = self.kind
        if kind == "json":
            return xgr.Grammar.from_json_schema(self.json, any_whitespace=not self.disable_any_whitespace,
                                                strict_mode=self.strict)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not self.disable_any_whitespace,
                                                strict_mode=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(self.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in self.choice))
        return xgr.Grammar.from_ebnf(self.grammar)

    def _check_buildable(self) -> None:
        cache_key = self.key
        kind = cache_key[0]
        with _validated_lock:
            if cache_key in _validated:
                _validated.move_to_end(cache_key)
                return
        if kind == "json":
            try:
                schema = json.loads(self.json)
            except ValueError as error:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {error}.",
                                          param="structured_outputs.json") from None
            _check_schema_keywords(schema)
        try:
            self.build_grammar()
        except RuntimeError as error:
            what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar",
                    "choice": "choice", "json_object": "JSON object"}[kind]
            message = _LOCATION.sub("", str(error).strip())
            raise InvalidRequestError(f"structured_outputs.{kind}: unsupported or invalid {what}: {message}",
                                      param=f"structured_outputs.{kind}") from None
        with _validated_lock:
            _validated[cache_key] = None
            while len(_validated) > _VALIDATED_CACHE_SIZE:
                _validated.popitem(last=False)


# JSON Schema keywords xgrammar does not enforce (it would silently allow what they forbid).
# multipleOf: held only where xgrammar can list the range's numbers (a user saw 123 for multipleOf 5 without minimum).
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "contains", "uniqueItems",
                       "unevaluatedProperties", "unevaluatedItems", "multipleOf")
# Where subschemas sit, searched for those keywords too.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "propertyNames", "additionalItems")


def _check_schema_keywords(schema: Any, path: str = "") -> None:
    """Refuse a schema whose constraints the grammar would not enforce: the keywords in
    :data:`UNENFORCED_KEYWORDS`, ``allOf`` of more than one schema, a ``$ref`` outside the schema, and a
    ``pattern`` that is not a regular expression xgrammar supports (lookaround, backreferences).

    Raises:
        InvalidRequestError (param ``structured_outputs.json``): naming the keyword and where it is.
    """
    if not isinstance(schema, dict):
        return
    where = path or "the schema's root"

    def refuse(what: str) -> None:
        raise InvalidRequestError(f"structured_outputs.json: {what} at {where} is not supported: the output could "
                                  "not be held to it.", param="structured_outputs.json")

    for keyword in UNENFORCED_KEYWORDS:
        if keyword in schema:
            refuse(f"'{keyword}'")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):  # nothing is fetched: the output would be unconstrained
        refuse(f"'$ref' to {ref!r:.80} (only references inside the schema, '#/...', are followed)")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        refuse("'allOf' of more than one schema")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        import xgrammar as xgr  # noqa: PLC0415

        try:
            xgr.Grammar.from_regex(pattern)
        except RuntimeError as error:
            refuse(f"'pattern' {pattern!r:.60} ({_LOCATION.sub('', str(error).strip())})")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _check_schema_keywords(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _check_schema_keywords(sub, f"{path}/{key}/{i}")
    for key in _SCHEMA_VALUES:
        _check_schema_keywords(schema.get(key), f"{path}/{key}")
