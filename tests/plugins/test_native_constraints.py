"""How the native plugin reads a request's output constraint (response_format or vLLM's
structured_outputs) into the engine's GrammarSpec, and what it refuses, naming the parameter."""

import json

import pytest

from gateway.backend import GenerationRequest, SamplingParams
from gateway.errors import InvalidRequestError
from kvgate_native.constraints import grammar_spec
from native_backend.text.grammar_spec import GrammarSpec

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def request(response_format=None, **extra) -> GenerationRequest:
    return GenerationRequest("r", "m", SamplingParams(max_tokens=4), messages=[{"role": "user", "content": "hi"}],
                             response_format=response_format, extra=extra)


@pytest.mark.parametrize("req, spec", [
    (request(), None),
    (request({"type": "text"}), None),
    (request({"type": "json_object"}), GrammarSpec("json_object", "", "response_format")),
    (request({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}),
     GrammarSpec("json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema")),
    (request({"type": "json_schema", "json_schema": {"name": "x"}}),
     GrammarSpec("json_object", "", "response_format.json_schema")),
    (request(structured_outputs={"json": SCHEMA}), GrammarSpec("json_schema", json.dumps(SCHEMA), "structured_outputs.json")),
    (request(structured_outputs={"json": json.dumps(SCHEMA), "disable_any_whitespace": True}),
     GrammarSpec("json_schema", json.dumps(SCHEMA), "structured_outputs.json")),
    (request(structured_outputs={"regex": "[0-9]+"}), GrammarSpec("regex", "[0-9]+", "structured_outputs.regex")),
    (request(structured_outputs={"choice": ["a", "b"]}), GrammarSpec("choice", '["a", "b"]', "structured_outputs.choice")),
    (request(structured_outputs={"grammar": 'root ::= "x"'}),
     GrammarSpec("grammar", 'root ::= "x"', "structured_outputs.grammar")),
    (request(structured_outputs={"json_object": True}), GrammarSpec("json_object", "", "structured_outputs.json_object")),
])
def test_constraints_become_grammar_specs(req, spec):
    assert grammar_spec(req) == spec


@pytest.mark.parametrize("req, param", [
    (request({"type": "json_object"}, structured_outputs={"regex": "x"}), "structured_outputs"),
    (request(structured_outputs="regex"), "structured_outputs"),
    (request(structured_outputs={}), "structured_outputs"),
    (request(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (request(structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag"),
    (request(structured_outputs={"regexp": "a"}), "structured_outputs.regexp"),
    (request(structured_outputs={"json": "{not json"}), "structured_outputs.json"),
    (request(structured_outputs={"json": [1]}), "structured_outputs.json"),
    (request(structured_outputs={"choice": []}), "structured_outputs.choice"),
    (request(structured_outputs={"choice": ["a", 1]}), "structured_outputs.choice"),
    (request(structured_outputs={"regex": ""}), "structured_outputs.regex"),
    (request(structured_outputs={"grammar": 3}), "structured_outputs.grammar"),
])
def test_what_cannot_be_a_constraint_is_refused_by_name(req, param):
    with pytest.raises(InvalidRequestError) as caught:
        grammar_spec(req)
    assert caught.value.param == param
