"""The proposer for an engine's `speculative` settings (None: speculation off)."""

from __future__ import annotations

from torch import nn

from native_backend.config.engine import EngineConfig
from native_backend.execution.spec_decode.draft_model import make_draft_proposer
from native_backend.execution.spec_decode.ngram import NgramProposer
from native_backend.execution.spec_decode.proposer import Proposer
from native_backend.model.kv_cache import KVCache


def make_proposer(config: EngineConfig, target: nn.Module, target_cache: KVCache, draft: nn.Module | None,
                  device, dtype) -> Proposer | None:
    """n-gram lookup, or a draft model (`draft`: a separate checkpoint; None: the target's first
    layers) whose KV lives in the target's blocks."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec)
    return make_draft_proposer(spec, target, target_cache, draft, device, dtype)
