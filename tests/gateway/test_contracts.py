"""The plugin-facing contracts (gateway/backend.py's Backend, gateway/policy.py's RoutingPolicy):
every member the gateway calls is declared, an optional one with its default, and the gateway
never finds one by name; a plugin object that does not subclass its contract is refused."""

import ast
from pathlib import Path

import httpx
import openai
import pytest

from gateway.backend import Backend, LoadSnapshot, TokenEvent, Usage
from gateway.config import parse_config
from gateway.hookspecs import hookimpl
from gateway.plugins import make_plugin_manager
from gateway.policy import RoutingPolicy
from gateway.state import build_state
from tests.support.servers.loopback import GatewayServer

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


class Minimal(Backend):
    """A backend with the five members every backend defines, and nothing else."""

    async def start(self):
        pass

    async def stop(self):
        pass

    async def abort(self, request_id):
        pass

    def load(self):
        return LoadSnapshot()

    async def generate(self, request):
        yield TokenEvent(text="hi", finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1))


class NotSubclassed:
    """The same five members, without the contract's defaults."""

    start, stop, abort, load, generate = Minimal.start, Minimal.stop, Minimal.abort, Minimal.load, Minimal.generate


class FirstOne(RoutingPolicy):
    def __init__(self, options):
        pass

    def choose(self, request, candidates):
        return candidates[0]


class ChoosesOnly:
    def __init__(self, options):
        pass

    def choose(self, request, candidates):
        return candidates[0]


class Kinds:
    @hookimpl
    def register_backends(self, register, config):
        register("minimal", lambda settings, name: Minimal())
        register("not_subclassed", lambda settings, name: NotSubclassed())

    @hookimpl
    def register_routing_policies(self, register):
        register("first_one", FirstOne)
        register("chooses_only", ChoosesOnly)


def config(backend: str = "minimal", policy: str = "first_one", auth: str = "") -> str:
    return f"""{auth}
models:
  - name: m
    policy: {policy}
    deployments: [{{name: d, backend: {backend}}}]
"""


def test_a_backend_with_only_the_required_members_serves_with_every_default(monkeypatch):
    monkeypatch.setenv("KVGATE_TEST_CONTRACT_ADMIN", "admin-key-for-the-contract-test")
    yaml = config(auth="auth: {admin_key_env: KVGATE_TEST_CONTRACT_ADMIN}")
    with GatewayServer(yaml, extra_plugins={"kinds": Kinds()}) as gw:
        client = gw.openai()  # keys: only the admin key, which guards /admin/* alone
        # Default capabilities: chat and completions (docs/guide/plugins.md), nothing else.
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert chat.choices[0].message.content == "hi"
        assert client.completions.create(model="m", prompt="x").choices[0].text == "hi"
        with pytest.raises(openai.BadRequestError, match="does not serve /v1/embeddings"):
            client.embeddings.create(model="m", input="x")
        reset = httpx.post(gw.base_url + "/admin/reset_prefix_cache",
                           headers={"authorization": "Bearer admin-key-for-the-contract-test"})
        assert reset.json() == {"reset": [], "unavailable": [], "not_supported": ["d"]}


def test_a_backend_that_does_not_subclass_backend_is_refused_at_build():
    with pytest.raises(ValueError, match=r"models\[0\].deployments\[0\].backend: kind 'not_subclassed' made a "
                                         r"NotSubclassed, which does not subclass gateway.backend.Backend"):
        build_state(parse_config(config(backend="not_subclassed")), make_plugin_manager({"kinds": Kinds()}))


def test_a_policy_that_does_not_subclass_routing_policy_is_refused_at_build():
    with pytest.raises(ValueError, match=r"models\[0\].policy: 'chooses_only' made a ChoosesOnly, which does not "
                                         r"subclass gateway.policy.RoutingPolicy"):
        build_state(parse_config(config(policy="chooses_only")), make_plugin_manager({"kinds": Kinds()}))


def contract_members() -> set[str]:
    return {name for contract in (Backend, RoutingPolicy) for name in vars(contract)
            if not name.startswith("_")}


BY_NAME = ("getattr", "hasattr")


def members_found_by_name(root: Path) -> list[str]:
    """getattr/hasattr calls in `root` that name a contract member."""
    members, found = contract_members(), []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            by_name = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in BY_NAME
            if by_name and len(node.args) >= 2 and getattr(node.args[1], "value", None) in members:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.args[1].value}")
    return found


def test_the_gateway_finds_no_contract_member_by_name(tmp_path):
    assert {"capabilities", "generate_batches", "use_limits", "kv_events_source", "prompt_token_ids", "release_kv",
            "reset_prefix_cache", "embed", "tokenize", "detokenize", "choose", "prepare", "sibling", "kv_feed",
            "matched_tokens"} <= contract_members()  # the list: all declared
    assert members_found_by_name(GATEWAY) == []
    (tmp_path / "m.py").write_text('release = getattr(backend, "release_kv", None)\n')
    assert members_found_by_name(tmp_path) == ["m.py:1 release_kv"]  # the check sees one
