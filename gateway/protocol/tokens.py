"""Request bodies of /v1/embeddings, /tokenize and /detokenize: validated and bounded.

Embeddings take OpenAI's body (`input`: a string, a list of strings, a token array or a list of
token arrays; `encoding_format` float | base64; `dimensions`; `user`). /tokenize and
/detokenize take vLLM's (a `prompt`, or chat `messages` with `add_generation_prompt`,
`continue_final_message`, `add_special_tokens`, `return_token_strs`, `tools`; /detokenize
`tokens`); `model` may be left out when the gateway serves one model, as with vLLM. A client's
chat template is refused (`chat_template`): only the model's own renders prompts. Other fields
are vendor fields, forwarded to deployments that accept them (as on chat).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import ConfigDict, Field, model_validator

from gateway.capabilities import Needs
from gateway.config import RequestLimits
from gateway.errors import InvalidRequestError
from gateway.protocol.completions import (
    Int, Message, TokenId, Unsupported, check_message_count, message_dict, prompt_list, validate_body, vendor_extras)
from gateway.protocol.tools import FunctionTool, StrictModel, check_tools


class _Open(StrictModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields are vendor fields

    model: str | None = Field(None, min_length=1)


class EmbeddingsBody(_Open):
    model: str = Field(min_length=1)
    input: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1, le=65536)
    user: str | None = Field(None, max_length=512)


class TokenizePromptBody(_Open):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(_Open):
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[FunctionTool] | None = None
    chat_template: Any = None

    @model_validator(mode="after")
    def _rules(self):
        if self.chat_template is not None:
            raise Unsupported("chat_template", "'chat_template' is not supported: prompts are rendered with the "
                               "model's own chat template only")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self


class DetokenizeBody(_Open):
    tokens: list[TokenId]


@dataclass
class ParsedEmbeddings:
    model: str
    inputs: list[str | list[int]]
    encoding_format: str
    dimensions: int | None
    user: str | None
    extra: dict | None
    needs: Needs


@dataclass
class ParsedTokenize:
    model: str | None
    fields: dict  # TokenizeRequest's fields, but for ids, model and routing
    needs: Needs


def parse_embeddings(body: Any, limits: RequestLimits) -> ParsedEmbeddings:
    req = validate_body(EmbeddingsBody, body)
    inputs = prompt_list(req.input, "input")
    _check_inputs(inputs, limits)
    extra = vendor_extras(req, limits)
    return ParsedEmbeddings(req.model, inputs, req.encoding_format, req.dimensions, req.user, extra,
                            Needs("embeddings", extras=frozenset(extra or ())))


def _check_inputs(inputs: list, limits: RequestLimits) -> None:
    if len(inputs) > limits.max_embedding_inputs:
        raise InvalidRequestError(f"{len(inputs)} inputs, over this server's limit of {limits.max_embedding_inputs} "
                                  "per request.", param="input")
    for i, item in enumerate(inputs):
        where = "input" if len(inputs) == 1 else f"input[{i}]"
        if not item:
            raise InvalidRequestError("An input must not be empty.", param=where)
        if isinstance(item, str) and len(item) > limits.max_embedding_input_chars:
            raise InvalidRequestError(f"An input is {len(item)} characters, over this server's limit of "
                                      f"{limits.max_embedding_input_chars}.", param=where)
    token_ids = sum(len(item) for item in inputs if isinstance(item, list))
    if token_ids > limits.max_prompt_tokens:
        raise InvalidRequestError(f"The inputs hold {token_ids} token ids, over this server's limit of "
                                  f"{limits.max_prompt_tokens}.", param="input")


def parse_tokenize(body: Any, limits: RequestLimits) -> ParsedTokenize:
    chat = isinstance(body, dict) and "messages" in body
    if chat and "prompt" in body:
        raise InvalidRequestError("Give either 'prompt' or 'messages', not both.", param="prompt")
    req = validate_body(TokenizeChatBody if chat else TokenizePromptBody, body)
    extra = vendor_extras(req, limits)
    features = set()
    if chat:
        check_message_count(req.messages, limits)
        check_tools(req.tools, None, limits)
        if req.tools or any(m.uses_tools for m in req.messages):
            features.add("tools")
        fields = dict(messages=[message_dict(m) for m in req.messages],
                      add_generation_prompt=req.add_generation_prompt,
                      continue_final_message=req.continue_final_message,
                      tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None)
    else:
        if len(req.prompt) > limits.max_embedding_input_chars:
            raise InvalidRequestError(f"The prompt is {len(req.prompt)} characters, over this server's limit of "
                                      f"{limits.max_embedding_input_chars}.", param="prompt")
        fields = dict(prompt=req.prompt)
    fields.update(add_special_tokens=req.add_special_tokens, return_token_strs=req.return_token_strs,
                  extra=extra or {})
    return ParsedTokenize(req.model, fields, Needs("tokenize", frozenset(features), frozenset(extra or ())))


def parse_detokenize(body: Any, limits: RequestLimits) -> ParsedTokenize:
    req = validate_body(DetokenizeBody, body)
    if len(req.tokens) > limits.max_prompt_tokens:
        raise InvalidRequestError(f"{len(req.tokens)} tokens, over this server's limit of {limits.max_prompt_tokens}.",
                                  param="tokens")
    extra = vendor_extras(req, limits)
    if extra:  # no backend takes vendor fields here: refuse them as an unknown argument
        name = next(iter(extra))
        raise InvalidRequestError(f"Unrecognized request argument supplied: {name}", param=name,
                                  code="unknown_parameter")
    return ParsedTokenize(req.model, dict(tokens=list(req.tokens)), Needs("tokenize"))
