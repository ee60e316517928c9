"""Embeddings, /tokenize and /detokenize through an OpenAI-compatible upstream.

Embeddings are OpenAI's `/v1/embeddings` everywhere (asked for as floats: the gateway encodes
them as its client asked). Tokenizing differs by server (`settings.server`):

| dialect | tokenize | detokenize | chat messages |
|---|---|---|---|
| vllm (vLLM, another kvgate) | POST /tokenize {prompt or messages, ...} -> {tokens, max_model_len, token_strs} | POST /detokenize {tokens} -> {prompt} | yes |
| llamacpp (llama-server) | POST /tokenize {content, add_special, with_pieces} -> {tokens} | POST /detokenize {tokens} -> {content} | rendered first by POST /apply-template |
| llama_cpp_python | POST /extras/tokenize {input} -> {tokens} (always with BOS) | POST /extras/detokenize {tokens} -> {text} | no |

What a dialect cannot do is the request's 400, naming the parameter, not a silent difference.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.backend import DetokenizeRequest, EmbeddingRequest, EmbeddingResult, TokenizeRequest, TokenizeResult
from gateway.errors import BackendError, InvalidRequestError

PATHS = {"vllm": ("/tokenize", "/detokenize"), "llamacpp": ("/tokenize", "/detokenize"),
         "llama_cpp_python": ("/extras/tokenize", "/extras/detokenize")}


class TokenCalls:
    """Mixed into OpenAIBackend (which has `post_once`, `settings` and `name`)."""

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResult:
        body = {"model": request.model, "input": request.inputs, "encoding_format": "float", **request.extra}
        if request.dimensions is not None:
            body["dimensions"] = request.dimensions
        if request.user:
            body["user"] = request.user
        answer = await self.post_once(self.settings.base_url + "/embeddings", body, request)
        try:
            rows = sorted(answer["data"], key=lambda row: row["index"])
            vectors = [[float(x) for x in row["embedding"]] for row in rows]
            prompt_tokens = int((answer.get("usage") or {}).get("prompt_tokens") or 0)
        except (KeyError, TypeError, ValueError):
            raise self._not_an_answer("embeddings") from None
        if len(vectors) != len(request.inputs):
            raise BackendError(f"The backend '{self.name}' sent {len(vectors)} embeddings for "
                               f"{len(request.inputs)} inputs.")
        return EmbeddingResult(vectors, prompt_tokens)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        dialect = self._dialect()
        if dialect == "vllm":
            return await self._tokenize_vllm(request)
        if request.messages is not None:
            if dialect == "llama_cpp_python":
                raise InvalidRequestError(f"Deployment '{self.name}' (llama-cpp-python) tokenizes prompts only; "
                                          "send 'prompt'.", param="messages")
            rendered = await self.post_once(self.settings.origin + "/apply-template",
                                            {"messages": request.messages}, request)
            request = replace(request, prompt=_field(rendered, "prompt", self), messages=None)
        if dialect == "llama_cpp_python":
            return await self._tokenize_llama_cpp_python(request)
        return await self._tokenize_llamacpp(request)

    async def detokenize(self, request: DetokenizeRequest) -> str:
        dialect = self._dialect()
        body = {"tokens": request.tokens}
        if dialect != "llamacpp":
            body["model"] = request.model
        answer = await self.post_once(self.settings.origin + PATHS[dialect][1], body, request)
        return _field(answer, {"vllm": "prompt", "llamacpp": "content", "llama_cpp_python": "text"}[dialect], self)

    # -- per dialect -------------------------------------------------------------------------

    async def _tokenize_vllm(self, request: TokenizeRequest) -> TokenizeResult:
        body = {"model": request.model, "return_token_strs": request.return_token_strs, **request.extra}
        if request.add_special_tokens is not None:
            body["add_special_tokens"] = request.add_special_tokens
        if request.messages is not None:
            body.update(messages=request.messages, add_generation_prompt=request.add_generation_prompt,
                        continue_final_message=request.continue_final_message)
            if request.tools:
                body["tools"] = request.tools
        else:
            body["prompt"] = request.prompt
        answer = await self.post_once(self.settings.origin + "/tokenize", body, request)
        tokens = _tokens(answer, self)
        return TokenizeResult(tokens, answer.get("max_model_len"), answer.get("token_strs"))

    async def _tokenize_llamacpp(self, request: TokenizeRequest) -> TokenizeResult:
        body = {"content": request.prompt, "add_special": request.add_special_tokens is not False,
                "with_pieces": request.return_token_strs, **request.extra}
        answer = await self.post_once(self.settings.origin + "/tokenize", body, request)
        raw = answer.get("tokens") if isinstance(answer, dict) else None
        if request.return_token_strs and isinstance(raw, list) and raw and isinstance(raw[0], dict):
            return TokenizeResult([int(t["id"]) for t in raw], None, [str(t.get("piece", "")) for t in raw])
        return TokenizeResult(_tokens(answer, self), None, None)

    async def _tokenize_llama_cpp_python(self, request: TokenizeRequest) -> TokenizeResult:
        if request.add_special_tokens is False:
            raise InvalidRequestError(f"Deployment '{self.name}' (llama-cpp-python) always adds the BOS token; "
                                      "add_special_tokens false is not available there.", param="add_special_tokens")
        if request.return_token_strs:
            raise InvalidRequestError(f"Deployment '{self.name}' (llama-cpp-python) does not return token strings.",
                                      param="return_token_strs")
        answer = await self.post_once(self.settings.origin + "/extras/tokenize",
                                      {"model": request.model, "input": request.prompt}, request)
        return TokenizeResult(_tokens(answer, self), None, None)

    def _dialect(self) -> str:
        dialect = self.settings.tokenize_dialect
        if dialect is None:  # only when the operator declared tokenize for a server of unknown kind
            return "vllm"
        return dialect

    def _not_an_answer(self, what: str) -> BackendError:
        return BackendError(f"The backend '{self.name}' sent an answer that is not a {what} response.")


def _tokens(answer, backend) -> list[int]:
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise backend._not_an_answer("tokenize")
    return tokens


def _field(answer, name: str, backend) -> str:
    value = answer.get(name) if isinstance(answer, dict) else None
    if not isinstance(value, str):
        raise backend._not_an_answer(name)
    return value
