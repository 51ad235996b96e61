"""JSON Schemas that bind a reply: checked as JSON Schema, written canonically, hashed.

A request names a schema in its API's own field (``schema`` on ``/v2/infer``,
``response_format`` on Chat Completions, ``text.format`` on the Responses API); each API turns
it into one :class:`OutputSchema` through :func:`output_schema`, and the engines and the audit
log see that alone. Whether an engine can enforce every keyword of a valid schema is the
engine's to say (:meth:`~seedance.engines.base.Engine.check_schema`).
"""

from __future__ import annotations

import functools
from typing import Any, Final, Literal

import jsonschema
import msgspec

from seedance.protocol.errors import InvalidRequest

#: ``{"type": "json_object"}``: any JSON object.
ANY_OBJECT: Final = {"type": "object"}

_encode = msgspec.json.Encoder().encode

#: Keywords whose values are schemas, lists of schemas or maps of names to schemas.
_SUBSCHEMAS: Final = (
    "properties", "patternProperties", "additionalProperties", "items", "prefixItems",
    "contains", "anyOf", "oneOf", "allOf", "$defs", "definitions", "not", "if", "then", "else",
    "dependentSchemas", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
)  # fmt: skip


class OutputSchema(msgspec.Struct, frozen=True):
    """What a reply is bound to: a checked JSON Schema (its text: compact JSON, its keys in
    the order given, so the order of ``properties`` is the order the reply writes them in), or
    the grammar of a reply to tools (``kind`` ``lark``: :func:`seedance.protocol.tools.grammar`)."""

    text: str
    #: The API's name for it (``response_format.json_schema.name``), where it gave one.
    name: str | None = None
    kind: Literal["json", "lark"] = "json"


def output_schema(schema: Any, field: str, name: str | None = None) -> OutputSchema:
    """``schema`` (decoded JSON) checked against its JSON Schema dialect's meta-schema (2020-12
    when it names none); :class:`InvalidRequest` naming ``field`` and the fault otherwise."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field}: must be a JSON Schema (an object)", param=field)
    try:
        text = _encode(schema).decode()
    except RecursionError:
        raise InvalidRequest(f"{field}: nested too deeply", param=field) from None
    fault = _fault(text)
    if fault is not None:
        raise InvalidRequest(f"{field}{fault}", param=field)
    return OutputSchema(text, name)


@functools.lru_cache(maxsize=256)
def _fault(text: str) -> str | None:
    """What makes a schema (its text) invalid: ``"[path]: why"``; None: it is valid.
    Cached: the meta-schema check takes about 4 ms for a schema of a dozen fields, and clients
    send the same few schemas again and again."""
    schema = msgspec.json.decode(text)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{part!r}]" for part in exc.path)
        return f"{where}: not a valid JSON Schema: {exc.message}"
    except RecursionError:
        return ": nested too deeply"
    return None


def format_schema(
    kind: str, schema: Any, field: str, *, strict: bool | None = None
) -> dict[str, Any] | None:
    """The schema an OpenAI ``response_format`` (Chat Completions) or ``text.format``
    (Responses) of type ``kind`` binds the reply to, checked (None: free text); ``field``
    names the format object in errors. ``strict``, as OpenAI means it: an object schema that
    does not say whether other properties may appear gets none (see :func:`closed`)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return dict(ANY_OBJECT)
    if kind != "json_schema":
        raise InvalidRequest(
            f"{field}.type: {kind!r} is not supported (text, json_object, json_schema)",
            param=f"{field}.type",
        )
    if schema is None:
        raise InvalidRequest(f"{field}.schema: required for json_schema", param=f"{field}.schema")
    output_schema(schema, f"{field}.schema")
    return closed(schema) if strict else dict(schema)


def closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` in each object schema that declares
    ``properties`` and says nothing of others (OpenAI's strict mode asks clients to write it
    everywhere; a model left free adds properties of its own)."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = (
                {name: closed(sub) for name, sub in value.items()}
                if isinstance(value, dict)
                else value
            )
        elif key in _SUBSCHEMAS:
            out[key] = closed(value)
        else:
            out[key] = value
    if (
        "properties" in out
        and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys()
    ):
        out["additionalProperties"] = False
    return out
