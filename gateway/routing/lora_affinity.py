"""`lora_affinity`: send a LoRA adapter's requests where the adapter is active, else where a slot
is free, so engines swap adapters in and out of their `max_loras` slots less often.

Each deployment's `load().lora` (gateway.backend.LoRAState: what the native engine's stats say,
vLLM's `vllm:lora_requests_info`) gives the adapters of its running and waiting requests and its
slots. A request for adapter a scores on each candidate, as llm-d's lora-affinity scorer does,

    affinity(d) = 1.0  a runs on d          0.8  d has a free slot (fewer running adapters than max_loras)
                  0.6  a waits on d         0.0  d's slots are full of other adapters

blended with load as precise_prefix blends its prefix score:

    score(d) = lora_weight * affinity(d)  -  load_weight * load_score(d) / weight(d)

so with the default weights (1, 1) an engine running the adapter wins until it is 0.2 load units
(a fifth of its capacity) busier than one with a free slot. Base-model requests, and deployments
that report no LoRA state, score on load alone. Ties go in turn. Candidates are already those
that hold the adapter (ModelPool.take).
"""

from __future__ import annotations

import itertools

from gateway.policy import RoutingPolicy
from gateway.routing.options import check_known, weights
from gateway.routing.policies import load_score

OPTIONS = {"lora_weight", "load_weight"}
RUNNING, FREE_SLOT, WAITING, FULL = 1.0, 0.8, 0.6, 0.0  # llm-d's lora-affinity scores


def affinity(lora, adapter: str | None) -> float:
    """How well a deployment with LoRA state `lora` suits a request for `adapter`."""
    if adapter is None or lora is None:
        return FULL
    if adapter in lora.running:
        return RUNNING
    if len(lora.running) < lora.max_loras:
        return FREE_SLOT
    return WAITING if adapter in lora.waiting else FULL


class LoRAAffinity(RoutingPolicy):
    def __init__(self, options: dict):
        check_known("lora_affinity", options, OPTIONS)
        self.lora_weight, self.load_weight = weights("lora_affinity", options, "lora_weight", "load_weight")
        self._turn = itertools.count()

    def choose(self, request, candidates):
        adapter = request.needs.adapter
        scores = [self.score(d, adapter) for d in candidates]
        best = max(scores)
        ties = [d for d, s in zip(candidates, scores) if best - s < 1e-9]
        return ties[next(self._turn) % len(ties)]

    def score(self, deployment, adapter: str | None) -> float:
        lora = deployment.backend.load().lora
        return (self.lora_weight * affinity(lora, adapter)
                - self.load_weight * load_score(deployment) / deployment.weight)
