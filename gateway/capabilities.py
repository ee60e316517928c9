"""What a deployment can serve, what a request needs, and the match between the two.

A backend declares its `Capabilities`: the endpoints it serves, the request features it honours
and the vendor fields (`extras`) it accepts verbatim. A request states its `Needs`. The gateway
routes a request only to deployments whose capabilities cover its needs; when no deployment of
the model has them, the client gets a 400 naming the parameter and the deployments that lack it
(`unservable`), never a silent downgrade.

A backend without a `capabilities()` method (a third-party plugin written before this existed)
serves what every backend served then: chat and completions, logprobs and n, no extras.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.errors import InvalidRequestError

# Endpoint names: what a backend can be asked to run.
ENDPOINTS = ("chat", "completions", "embeddings", "tokenize", "responses", "messages")
# Request features a deployment may lack (a feature asked for goes only where it is declared):
#   tools        tools / tool_choice, and tool-role messages or assistant tool_calls in the conversation
#   json_object  response_format {"type": "json_object"}
#   json_schema  response_format {"type": "json_schema", ...}
#   logprobs     logprobs / top_logprobs
#   n            n > 1 (the gateway runs each choice as its own backend request, so a backend sees one)
#   reasoning    reasoning_effort
FEATURES = ("tools", "json_object", "json_schema", "logprobs", "n", "reasoning")
ANY_EXTRA = "*"  # in `extras`: any vendor field is forwarded verbatim (a trusted upstream)

# The parameter a refusal names for each feature (the one the client set).
FEATURE_PARAMS = {"tools": "tools", "json_object": "response_format", "json_schema": "response_format",
                  "logprobs": "logprobs", "n": "n", "reasoning": "reasoning_effort"}
ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                  "embeddings": "/v1/embeddings", "tokenize": "/tokenize and /detokenize",
                  "responses": "/v1/responses", "messages": "/v1/messages"}


@dataclass(frozen=True)
class Capabilities:
    """What one deployment serves. Unknown names are refused when it is built (`checked`)."""

    endpoints: frozenset[str] = frozenset({"chat", "completions"})
    features: frozenset[str] = frozenset({"logprobs", "n"})
    extras: frozenset[str] = frozenset()  # vendor request fields forwarded verbatim; "*": any

    def serves(self, needs: "Needs") -> bool:
        if needs.endpoint not in self.endpoints:
            return False
        if needs.features and not needs.features <= self.features:
            return False
        return not needs.extras or ANY_EXTRA in self.extras or needs.extras <= self.extras

    def checked(self, where: str = "capabilities") -> "Capabilities":
        """Itself, or ValueError naming the unknown endpoint or feature."""
        for kind, names, known in (("endpoints", self.endpoints, ENDPOINTS), ("features", self.features, FEATURES)):
            unknown = sorted(set(names) - set(known))
            if unknown:
                raise ValueError(f"{where}.{kind}: unknown {', '.join(map(repr, unknown))} "
                                 f"(known: {', '.join(known)})")
        return self


DEFAULT_CAPABILITIES = Capabilities()


@dataclass(frozen=True)
class Needs:
    """What one request needs from a backend. `params` names, per feature, the request
    parameter that asked for it (for the refusal's `param`); it does not take part in matching."""

    endpoint: str = "chat"
    features: frozenset[str] = frozenset()
    extras: frozenset[str] = frozenset()
    params: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    # The LoRA adapter the request's `model` named (None: the base model): only deployments that
    # hold it take the request (ModelPool.take), and the backend runs it with that adapter.
    adapter: str | None = None

    def param_of(self, feature: str) -> str:
        return dict(self.params).get(feature) or FEATURE_PARAMS.get(feature, feature)


PLAIN_CHAT = Needs("chat")
PLAIN_COMPLETIONS = Needs("completions")


def capabilities_of(backend) -> Capabilities:
    """The backend's declaration, checked (`Backend.capabilities`: the default unless it declares)."""
    return backend.capabilities().checked()


def unservable(model: str, needs: Needs, declared: list[tuple[str, Capabilities]]) -> InvalidRequestError | None:
    """None when some deployment of `model` (name, capabilities) serves `needs`; else the 400
    that names the first thing missing everywhere and the deployments lacking it."""
    if any(caps.serves(needs) for _, caps in declared):
        return None
    lacking = [name for name, caps in declared if needs.endpoint not in caps.endpoints]
    if lacking:
        return _refusal(f"Model '{model}' does not serve {ENDPOINT_PATHS.get(needs.endpoint, needs.endpoint)}",
                        "model", lacking, "unsupported_endpoint")
    for feature in sorted(needs.features):
        lacking = [name for name, caps in declared if feature not in caps.features]
        if lacking:
            param = needs.param_of(feature)
            return _refusal(f"'{param}' ({feature}) is not supported by model '{model}'", param, lacking,
                            "unsupported_parameter")
    for extra in sorted(needs.extras):
        lacking = [name for name, caps in declared if ANY_EXTRA not in caps.extras and extra not in caps.extras]
        if lacking:
            return _refusal(f"Unrecognized request argument supplied: {extra} (no deployment of model '{model}' "
                            "accepts it as a vendor field)", extra, lacking, "unknown_parameter")
    # Each need is met somewhere, but never all on one deployment.
    return _refusal(f"No single deployment of model '{model}' serves every feature this request uses",
                    None, [name for name, _ in declared], "unsupported_parameter")


def _refusal(what: str, param: str | None, lacking: list[str], code: str) -> InvalidRequestError:
    return InvalidRequestError(f"{what}; deployments lacking it: {', '.join(lacking)}.", param=param, code=code)
