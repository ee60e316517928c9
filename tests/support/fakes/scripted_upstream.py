"""A loopback OpenAI-compatible server that implements the features agents and RAG apps use:
tool calls (whole and streamed in fragments), JSON mode and JSON schemas, reasoning, refusals,
embeddings and vLLM's /tokenize and /detokenize. Tests put kvgate in front of it (an `openai`
deployment with `server: vllm` or `kvgate`) and check, with real clients, that everything
reaches the client as the upstream sent it.

Its answers are functions of the request, so a test can predict them:
- `tools` offered (tool_choice not "none") and the last message not a tool result: it calls the
  tools: the named one (tool_choice {function: {name}}), else the first, or every tool when
  `parallel_tool_calls` is not false and tool_choice is "required". Arguments are
  `tool_arguments[name]` when the test set them, else an instance built from the tool's schema
  (`instance_of`); ids are `call_<n>`;
- the last message a tool result: "Tool <tool_call_id> said: <content>";
- response_format json_schema: `instance_of(schema)` as JSON text; json_object: {"ok": true};
- reasoning_effort set: a `reasoning_content` "Thinking at <effort> effort." before the answer;
- a last user message starting with "refuse:": a `refusal` with the rest;
- otherwise it echoes the last user message's words;
- /v1/embeddings: a unit vector per input from a hash of it (`vector_of`), `dimensions` long
  (default 8);
- /tokenize: one token per word, ids from a vocabulary it grows; /detokenize maps them back.
Streams send tool calls as OpenAI does: the first fragment of a call has its id, type and
name, the others pieces of its arguments of `fragment_chars` characters; then a chunk with
finish_reason, the usage chunk when asked for, and [DONE]. `seen` holds every body received.
"""

from __future__ import annotations

import hashlib
import json
import math
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.support.servers.loopback import AppServer

DEFAULT_DIMENSIONS = 8


@pytest.fixture(scope="module")
def scripted_upstream():
    """One `ScriptedUpstream` for a test module's tests (a test that sets `tool_arguments` sets
    them before its own request). Registered for every test by tests/conftest.py."""
    with ScriptedUpstream() as server:
        yield server


class ScriptedUpstream(AppServer):
    def __init__(self, model: str = "scripted", max_model_len: int = 2048, fragment_chars: int = 7):
        self.model = model
        self.max_model_len = max_model_len
        self.fragment_chars = fragment_chars
        self.tool_arguments: dict[str, dict] = {}
        self.seen: list[tuple[str, dict]] = []  # (path, body) of every request
        self.vocabulary: dict[str, int] = {}
        app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])
        super().__init__(app)

    def bodies(self, path: str) -> list[dict]:
        return [body for p, body in self.seen if p == path]

    # -- chat ------------------------------------------------------------------------------

    async def chat(self, request: Request):
        body = await self._body(request)
        answer = self.answer(body)
        usage = {"prompt_tokens": _words_in(body["messages"]), "completion_tokens": answer.tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("stream"):
            include_usage = (body.get("stream_options") or {}).get("include_usage")
            return StreamingResponse(self._chat_stream(answer, usage if include_usage else None),
                                     media_type="text/event-stream")
        message = {"role": "assistant", "content": answer.content}
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        if answer.refusal:
            message["refusal"] = answer.refusal
        return JSONResponse({"id": "chatcmpl-scripted", "object": "chat.completion", "created": int(time.time()),
                             "model": self.model, "usage": usage,
                             "choices": [{"index": 0, "message": message, "finish_reason": answer.finish_reason}]})

    def answer(self, body: dict) -> "Answer":
        messages = body["messages"]
        last = messages[-1]
        reasoning = f"Thinking at {body['reasoning_effort']} effort." if body.get("reasoning_effort") else None
        tools = body.get("tools") or []
        if tools and body.get("tool_choice", "auto") != "none" and last["role"] != "tool":
            return Answer(tool_calls=self._calls(tools, body), reasoning=reasoning, finish_reason="tool_calls")
        if last["role"] == "tool":
            return Answer(content=f"Tool {last['tool_call_id']} said: {_text(last['content'])}", reasoning=reasoning)
        fmt = body.get("response_format") or {"type": "text"}
        if fmt["type"] == "json_schema":
            schema = fmt["json_schema"].get("schema") or {}
            return Answer(content=json.dumps(instance_of(schema)), reasoning=reasoning)
        if fmt["type"] == "json_object":
            return Answer(content=json.dumps({"ok": True}), reasoning=reasoning)
        text = _text(last.get("content"))
        if text.startswith("refuse:"):
            return Answer(content=None, refusal=text.removeprefix("refuse:").strip(), reasoning=reasoning)
        return Answer(content=" ".join(text.split()), reasoning=reasoning)

    def _calls(self, tools: list[dict], body: dict) -> list[dict]:
        choice = body.get("tool_choice", "auto")
        if isinstance(choice, dict):
            chosen = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        elif choice == "required" and body.get("parallel_tool_calls", True):
            chosen = tools
        else:
            chosen = tools[:1]
        calls = []
        for i, tool in enumerate(chosen):
            name = tool["function"]["name"]
            arguments = self.tool_arguments.get(name)
            if arguments is None:
                arguments = instance_of(tool["function"].get("parameters") or {"type": "object"})
            calls.append({"id": f"call_{i}", "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments)}})
        return calls

    async def _chat_stream(self, answer: "Answer", usage: dict | None):
        head = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model}

        def chunk(delta: dict, finish=None) -> bytes:
            data = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        yield chunk({"role": "assistant", "content": ""})
        if answer.reasoning:
            for piece in _pieces(answer.reasoning, self.fragment_chars):
                yield chunk({"reasoning_content": piece})
        if answer.refusal:
            yield chunk({"refusal": answer.refusal})
        for i, word in enumerate(answer.content.split(" ") if answer.content else ()):
            yield chunk({"content": word if i == 0 else " " + word})
        for index, call in enumerate(answer.tool_calls):
            first = {"index": index, "id": call["id"], "type": "function",
                     "function": {"name": call["function"]["name"], "arguments": ""}}
            yield chunk({"tool_calls": [first]})
            for piece in _pieces(call["function"]["arguments"], self.fragment_chars):
                yield chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
        yield chunk({}, answer.finish_reason)
        if usage is not None:
            yield b"data: " + json.dumps({**head, "choices": [], "usage": usage}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def completions(self, request: Request):
        body = await self._body(request)
        text = " ".join(str(body["prompt"]).split())
        return JSONResponse({"id": "cmpl-scripted", "object": "text_completion", "model": self.model,
                             "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": len(text.split()), "completion_tokens": len(text.split())}})

    # -- embeddings and tokens -------------------------------------------------------------

    async def embeddings(self, request: Request):
        body = await self._body(request)
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if inputs and isinstance(inputs[0], int):
            inputs = [inputs]  # one token array
        size = body.get("dimensions") or DEFAULT_DIMENSIONS
        data = [{"object": "embedding", "index": i, "embedding": vector_of(item, size)} for i, item in enumerate(inputs)]
        tokens = sum(len(item) if isinstance(item, list) else len(item.split()) for item in inputs)
        return JSONResponse({"object": "list", "model": self.model, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def tokenize(self, request: Request):
        body = await self._body(request)
        tokens, words = self.token_ids(body)
        return JSONResponse({"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens,
                             "token_strs": words if body.get("return_token_strs") else None})

    def token_ids(self, body: dict) -> tuple[list[int], list[str]]:
        """(token ids, their words) of a /tokenize body, or of a chat or completion body (the
        prompt it computes): one token per word, chat messages' contents joined."""
        text = body["prompt"] if "prompt" in body else " ".join(_text(m.get("content")) for m in body["messages"])
        words = text.split()
        tokens = [self.vocabulary.setdefault(w, len(self.vocabulary) + 1) for w in words]
        if body.get("add_special_tokens", "prompt" in body):
            tokens = [0] + tokens  # a BOS token, as vLLM adds for a prompt by default
            words = ["<s>"] + words
        return tokens, words

    async def detokenize(self, request: Request):
        body = await self._body(request)
        words = {i: w for w, i in self.vocabulary.items()}
        return JSONResponse({"prompt": " ".join(words.get(t, "<s>" if t == 0 else "?") for t in body["tokens"])})

    async def health(self, request: Request):
        return Response(status_code=200)  # vLLM's and SGLang's /health: 200, no body

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model",
                                                         "max_model_len": self.max_model_len}]})

    async def _body(self, request: Request) -> dict:
        body = await request.json()
        self.seen.append((request.url.path, body))
        return body


class Answer:
    def __init__(self, content: str | None = None, tool_calls: list[dict] | None = None, reasoning: str | None = None,
                 refusal: str | None = None, finish_reason: str = "stop"):
        self.content, self.tool_calls, self.reasoning, self.refusal = content, tool_calls or [], reasoning, refusal
        self.finish_reason = finish_reason

    @property
    def tokens(self) -> int:
        text = " ".join(filter(None, [self.content, self.reasoning, self.refusal]))
        return len(text.split()) + sum(len(c["function"]["arguments"]) // 4 + 1 for c in self.tool_calls)


def instance_of(schema: dict):
    """A small value valid against a simple JSON schema (objects, arrays, scalars, enum, const)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    kind = schema.get("type", "object")
    if isinstance(kind, list):
        kind = kind[0]
    if kind == "object":
        props = schema.get("properties") or {}
        return {name: instance_of(props[name]) for name in schema.get("required", list(props))}
    if kind == "array":
        return [instance_of(schema.get("items") or {"type": "string"})] * max(1, schema.get("minItems", 1))
    return {"string": "text", "integer": 1, "number": 1.5, "boolean": True, "null": None}[kind]


def vector_of(item, size: int) -> list[float]:
    """A deterministic unit vector for a text or a token array."""
    seed = hashlib.sha256(json.dumps(item).encode()).digest()
    raw = [(seed[i % len(seed)] - 127.5) / 127.5 + i * 1e-3 for i in range(size)]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def _words_in(messages: list[dict]) -> int:
    return sum(len(_text(m.get("content")).split()) for m in messages)
