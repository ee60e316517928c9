"""kvgate-tensorrt-llm: NVIDIA TensorRT-LLM behind kvgate, two ways.

- `backend: tensorrt_llm` runs `tensorrt_llm.LLM` inside the gateway process (needs NVIDIA GPUs
  and the tensorrt_llm package, imported only when the deployment starts);
- `backend: trtllm_serve` talks to a `trtllm-serve` process over its OpenAI API: kvgate-openai's
  backend with the trtllm metrics preset.
"""

from __future__ import annotations

from gateway.hookspecs import hookimpl
from kvgate_openai import make_openai_backend
from kvgate_tensorrt_llm.engine import TensorRtLlmBackend, llm_kwargs
from kvgate_tensorrt_llm.settings import TrtLlmSettings, parse_settings

__all__ = ["TensorRtLlmBackend", "TrtLlmSettings", "llm_kwargs", "make_tensorrt_llm_backend",
           "make_trtllm_serve_backend"]


def make_tensorrt_llm_backend(settings: dict, deployment: str) -> TensorRtLlmBackend:
    return TensorRtLlmBackend(parse_settings(settings), name=deployment)


def make_trtllm_serve_backend(settings: dict, deployment: str):
    """trtllm-serve speaks OpenAI; its metrics differ (Prometheus at /prometheus/metrics), and so
    does what it serves out of the box (server kind trtllm)."""
    return make_openai_backend(settings, deployment, metrics="trtllm", server="trtllm")


@hookimpl
def register_backends(register, config):
    register("tensorrt_llm", make_tensorrt_llm_backend)
    register("trtllm_serve", make_trtllm_serve_backend)
