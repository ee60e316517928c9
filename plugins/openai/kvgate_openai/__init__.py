"""kvgate-openai: a backend for any OpenAI-compatible server.

vLLM, SGLang, trtllm-serve, llama.cpp's server, LiteLLM or another kvgate: anything that speaks
`/v1/completions` and `/v1/chat/completions` with SSE streaming. Load comes from the upstream's
Prometheus metrics when it publishes them (see `metrics.py`), from in-flight counts otherwise.

    - name: vllm-0
      backend: openai
      upstream_model: meta-llama/Llama-3.1-8B-Instruct
      settings:
        base_url: http://vllm-0:8000/v1
        api_key_env: VLLM_API_KEY
        metrics: vllm
"""

from __future__ import annotations

from gateway.hookspecs import hookimpl
from kvgate_openai.backend import OpenAIBackend
from kvgate_openai.settings import OpenAISettings, parse_settings

__all__ = ["OpenAIBackend", "OpenAISettings", "make_openai_backend", "parse_settings"]


def make_openai_backend(settings: dict, deployment: str, **defaults) -> OpenAIBackend:
    """`defaults` lets a plugin preset fields (trtllm_serve presets metrics: trtllm)."""
    return OpenAIBackend(parse_settings(settings, **defaults), name=deployment)


@hookimpl
def register_backends(register, config):
    register("openai", make_openai_backend)
