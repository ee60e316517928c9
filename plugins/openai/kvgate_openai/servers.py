"""What each known kind of OpenAI-compatible server serves out of the box (`settings.server`).

A deployment's capabilities are its kind's defaults below, each list of which
`settings.capabilities` may replace (an operator who started vLLM with an embedding model adds
`embeddings`; one whose trtllm-serve has a tool parser adds `tools`). The defaults are what each
server does without extra flags:

| kind | endpoints | features | tokenize dialect |
|---|---|---|---|
| openai (default: OpenAI itself, or a server of unknown kind) | chat, completions, embeddings | tools, json_object, json_schema, logprobs, n, reasoning | - |
| vllm | chat, completions, tokenize, responses, messages | all | vLLM |
| sglang | chat, completions | all | - |
| trtllm (trtllm-serve) | chat, completions | logprobs, n (tools need --tool_parser, JSON a guided-decoding backend) | - |
| llamacpp (llama-server) | chat, completions, embeddings, tokenize | tools (--jinja), json_object, json_schema, logprobs, n | llama-server |
| llama_cpp_python | chat, completions, embeddings, tokenize | tools (chat_format chatml-function-calling), json_object, json_schema (sent as its json_object with a schema), logprobs, n | llama-cpp-python |
| kvgate (another kvgate) | all | all | vLLM |

`extras` are the vendor request fields each server documents (vLLM's SamplingParams extensions,
SGLang's and llama.cpp's sampler options); another kvgate takes any (`*`: it validates them
itself). A vendor field outside the list is refused at the gateway, naming it.
"""

from __future__ import annotations

from typing import Literal

from gateway.capabilities import ENDPOINTS, FEATURES, Capabilities

ServerKind = Literal["openai", "vllm", "sglang", "trtllm", "llamacpp", "llama_cpp_python", "kvgate"]
TokenizeDialect = Literal["vllm", "llamacpp", "llama_cpp_python"]

ALL_FEATURES = frozenset(FEATURES)
PLAIN = frozenset({"logprobs", "n"})
NO_REASONING = ALL_FEATURES - {"reasoning"}

VLLM_EXTRAS = frozenset({
    "chat_template_kwargs", "structured_outputs", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "echo", "truncate_prompt_tokens", "prompt_logprobs",
    "bad_words", "allowed_token_ids", "length_penalty", "return_tokens_as_token_ids", "cache_salt",
    "documents", "thinking_token_budget", "vllm_xargs",
})
SGLANG_EXTRAS = frozenset({
    "chat_template_kwargs", "regex", "ebnf", "json_schema", "min_tokens", "skip_special_tokens",
    "no_stop_trim", "separate_reasoning", "stream_reasoning", "continue_final_message", "lora_path",
})
LLAMACPP_EXTRAS = frozenset({
    "chat_template_kwargs", "grammar", "json_schema", "cache_prompt", "n_probs", "typical_p", "mirostat",
    "mirostat_tau", "mirostat_eta", "repeat_last_n", "dry_multiplier", "dry_base", "dry_allowed_length",
    "xtc_probability", "xtc_threshold", "samplers", "n_keep", "id_slot", "return_tokens",
})
LLAMA_CPP_PYTHON_EXTRAS = frozenset({"grammar", "typical_p", "mirostat_mode", "mirostat_tau", "mirostat_eta",
                                     "tfs_z", "logit_bias_type"})


def _caps(endpoints, features, extras=frozenset()) -> Capabilities:
    return Capabilities(frozenset(endpoints), frozenset(features), frozenset(extras))


SERVER_DEFAULTS: dict[str, Capabilities] = {
    "openai": _caps({"chat", "completions", "embeddings"}, ALL_FEATURES),
    "vllm": _caps({"chat", "completions", "tokenize", "responses", "messages"}, ALL_FEATURES, VLLM_EXTRAS),
    "sglang": _caps({"chat", "completions"}, ALL_FEATURES, SGLANG_EXTRAS),
    "trtllm": _caps({"chat", "completions"}, PLAIN),
    "llamacpp": _caps({"chat", "completions", "embeddings", "tokenize"}, NO_REASONING, LLAMACPP_EXTRAS),
    "llama_cpp_python": _caps({"chat", "completions", "embeddings", "tokenize"}, NO_REASONING,
                              LLAMA_CPP_PYTHON_EXTRAS),
    "kvgate": _caps(ENDPOINTS, ALL_FEATURES, {"*"}),
}

TOKENIZE_DIALECTS: dict[str, str] = {"vllm": "vllm", "kvgate": "vllm", "llamacpp": "llamacpp",
                                     "llama_cpp_python": "llama_cpp_python"}


def capabilities(kind: str, endpoints=None, features=None, extras=None) -> Capabilities:
    """The kind's defaults, each list replaced where given."""
    base = SERVER_DEFAULTS[kind]
    return Capabilities(
        base.endpoints if endpoints is None else frozenset(endpoints),
        base.features if features is None else frozenset(features),
        base.extras if extras is None else frozenset(extras),
    ).checked("capabilities")
