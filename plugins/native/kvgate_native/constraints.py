"""A request's output constraint as the engine's GrammarSpec: OpenAI's `response_format`
(json_object, json_schema) or vLLM's `structured_outputs` (json, regex, choice, grammar,
json_object), one of the two.

The gateway has checked the shapes it knows (a json_schema's schema against its metaschema, the
sizes in server.limits); this reads them and refuses, naming the parameter, what only the native
engine cannot serve. Whether the library compiles the constraint is the engine's answer (a 400
before any token)."""

from __future__ import annotations

import json

from gateway.backend import GenerationRequest
from gateway.errors import InvalidRequestError
from native_backend.text.grammar_spec import GrammarSpec

# vLLM's structured_outputs keys that choose the constraint (exactly one), and those that tune
# it: the engine writes JSON compactly whatever these say (text.grammar_spec), so they are accepted.
STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
STRUCTURED_OPTIONS = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                      "disable_fallback", "backend"}
UNSUPPORTED = {"structural_tag": "structural tags are not supported by the native engine"}


def grammar_spec(request: GenerationRequest) -> GrammarSpec | None:
    """The request's constraint, or None; InvalidRequestError naming the parameter."""
    structured = request.extra.get("structured_outputs")
    response_format = request.response_format
    constrained_format = response_format is not None and response_format.get("type") != "text"
    if structured is not None and constrained_format:
        raise InvalidRequestError("Send one of response_format and structured_outputs: both constrain the output.",
                                  param="structured_outputs")
    if structured is not None:
        return _from_structured_outputs(structured)
    if constrained_format:
        return _from_response_format(response_format)
    return None


def _from_response_format(response_format: dict) -> GrammarSpec:
    if response_format["type"] == "json_object":
        return GrammarSpec("json_object", param="response_format")
    schema = response_format["json_schema"].get("schema")
    if schema is None:  # a name without a schema: any JSON object
        return GrammarSpec("json_object", param="response_format.json_schema")
    return GrammarSpec("json_schema", json.dumps(schema), param="response_format.json_schema.schema")


def _from_structured_outputs(structured) -> GrammarSpec:
    if not isinstance(structured, dict):
        raise InvalidRequestError("structured_outputs must be an object.", param="structured_outputs")
    for key, why in UNSUPPORTED.items():
        if structured.get(key) is not None:
            raise InvalidRequestError(f"structured_outputs.{key}: {why}.", param=f"structured_outputs.{key}")
    unknown = sorted(set(structured) - set(STRUCTURED_KINDS) - STRUCTURED_OPTIONS - set(UNSUPPORTED))
    if unknown:
        raise InvalidRequestError(f"structured_outputs: unknown field '{unknown[0]}' (known: "
                                  f"{', '.join(sorted(STRUCTURED_KINDS))} and options).",
                                  param=f"structured_outputs.{unknown[0]}")
    chosen = [key for key in STRUCTURED_KINDS if structured.get(key) not in (None, False)]
    if len(chosen) != 1:
        raise InvalidRequestError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}; "
                                  f"got {', '.join(chosen) or 'none'}.", param="structured_outputs")
    key = chosen[0]
    return GrammarSpec(STRUCTURED_KINDS[key], _text(key, structured[key]), param=f"structured_outputs.{key}")


def _text(key: str, value) -> str:
    param = f"structured_outputs.{key}"
    if key == "json_object":
        return ""
    if key == "json":  # a schema, or its JSON text
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(f"{param} is not valid JSON: {exc}.", param=param) from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequestError(f"{param} must be a JSON schema (an object).", param=param)
        return json.dumps(value)
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings.", param=param)
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string.", param=param)
    return value
