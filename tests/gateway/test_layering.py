"""The tree's import rules, read from the code with `ast` (every import, lazy ones included):

- gateway/ knows engines only through the Backend protocol: it never imports torch or the engine;
- the engine never imports the gateway;
- no module of the tree imports itself through others (no import circles);
- the engine's layers import only the layers below them (ENGINE_LAYERS), and every package of the
  engine has its place there;
- the gateway's rooms (its packages by concern, and the modules at its root) import only the rooms
  below them (GATEWAY_ROOMS), every module of the gateway stands in one, and plugins import only
  the gateway's plugin-facing seam.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATEWAY = ROOT / "gateway"
ENGINE = ROOT / "native_backend"
FORBIDDEN = {"torch", "native_backend", "triton", "transformers"}

# Each layer of native_backend/ and the layers it may import; the picture, top to bottom:
#
#     tools       process
#         \      /
#         execution
#          /     \
#       core     model ── kernels
#          \     /   \
#           text      \
#             \        \
#              config ──┘
ENGINE_LAYERS = {
    "config": set(),
    "kernels": {"config"},
    "text": {"config"},
    "core": {"config", "text"},
    "model": {"config", "kernels", "text"},
    "execution": {"config", "kernels", "text", "core", "model"},
    "process": {"config", "kernels", "text", "core", "model", "execution"},
    "tools": {"config", "kernels", "text", "core", "model", "execution"},
}
TORCH_FREE_LAYERS = ("config", "core", "text")  # the gateway's side and the planner read these
# Text a client reads has one owner in the engine process, its output processor (and the factory
# that loads the tokenizer for it): the core steps in token ids (it reads text/ for grammars only).
CLIENT_TEXT_MODULES = {"native_backend.text.tokenizer", "native_backend.text.detokenizer", "native_backend.text.stop"}


# The gateway's plugin-facing seam: the modules at its root that plugins import (and every room may).
GATEWAY_SEAM = {"gateway", "backend", "capabilities", "config", "errors", "fastjson", "hookspecs", "idle", "plugins",
                "policy", "redis_health"}
# Each room of gateway/ and the rooms it may import, bottom to top (docs/design/architecture.md
# draws it). A room is a package, the seam, or one of the modules on top of the root (state, app, cli).
GATEWAY_ROOMS = {
    "seam": set(),
    "protocol": {"seam"},
    "translate": {"seam", "protocol"},
    "kv_index": {"seam"},
    "pools": {"seam"},
    "routing": {"seam", "kv_index", "pools"},
    "keys": {"seam"},
    "budgets": {"seam"},
    "cache": {"seam"},
    "observability": {"seam", "pools", "keys"},
    "state": {"seam", "pools", "keys", "budgets", "cache", "observability"},
    "dispatch": {"seam", "protocol", "pools", "routing", "observability", "state"},
    "lifecycle": {"seam", "pools", "keys", "state"},
    "http": {"seam", "translate", "keys", "state"},
    "api": {"seam", "protocol", "translate", "kv_index", "pools", "routing", "keys", "budgets", "cache", "observability",
            "state",
            "dispatch", "lifecycle", "http"},
    "app": {"seam", "state", "lifecycle", "http", "api"},
    "cli": {"seam", "state", "http", "app"},
}

def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_gateway_imports_neither_torch_nor_the_engine():
    offenders = {
        str(path.relative_to(GATEWAY)): sorted(imported_modules(path) & FORBIDDEN)
        for path in GATEWAY.rglob("*.py")
        if imported_modules(path) & FORBIDDEN
    }
    assert offenders == {}


def test_the_check_sees_imports(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text("import torch.nn\nfrom native_backend.core.engine import X\n")
    assert imported_modules(sample) & FORBIDDEN == {"torch", "native_backend"}


def test_engine_does_not_import_the_gateway():
    offenders = [str(p) for p in ENGINE.rglob("*.py") if "gateway" in imported_modules(p)]
    assert offenders == []


# ------------------------------------------------------------------ the module graph


def source_roots(root: Path) -> dict[Path, str]:
    """Folder -> the package name it holds: the gateway, the engine, each plugin's package."""
    roots = {root / "gateway": "gateway", root / "native_backend": "native_backend"}
    for package in sorted(root.glob("plugins/*/kvgate_*")):
        roots[package] = package.name
    return {folder: name for folder, name in roots.items() if folder.is_dir()}


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the tree's packages (tests excluded)."""
    modules = {}
    for folder, package in source_roots(root).items():
        for path in folder.rglob("*.py"):
            parts = (package, *path.relative_to(folder).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The tree's modules that `module` imports: `from P import name` counts P.name when that is a
    module, else P; relative imports are resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {name for name in found if name in known and name != module}


def import_graph(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    return {module: imports_of(module, path, set(files)) for module, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports between the engine's layers that ENGINE_LAYERS does not allow."""
    def layer(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if parts[0] == "native_backend" and len(parts) > 1 else None

    return sorted(f"{module} -> {target}" for module, targets in graph.items() if layer(module)
                  for target in targets
                  if layer(target) and layer(target) != layer(module)
                  and layer(target) not in ENGINE_LAYERS.get(layer(module), set()))


def gateway_room(module: str) -> str | None:
    """The room of a gateway module: `gateway.pools.registry` -> pools, `gateway.errors` -> seam."""
    parts = module.split(".")
    if parts[0] != "gateway":
        return None
    if len(parts) == 1 or parts[1] in GATEWAY_SEAM:
        return "seam"
    return parts[1]


def gateway_upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports between the gateway's rooms that GATEWAY_ROOMS does not allow."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() if gateway_room(module)
                  for target in targets
                  if gateway_room(target) and gateway_room(target) != gateway_room(module)
                  and gateway_room(target) not in GATEWAY_ROOMS.get(gateway_room(module), set()))


def bench_graph(root: Path) -> dict[str, set[str]]:
    """The benchmarks as modules: each imports the others by file name (bench/ on sys.path) or
    as bench.NAME, at the top or inside a function."""
    names = {path.stem for path in (root / "bench").glob("*.py")}
    graph = {}
    for name in names:
        found = set()
        for node in ast.walk(ast.parse((root / "bench" / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
        graph[name] = {n.removeprefix("bench.") for n in found} & names - {name}
    return graph


def test_no_import_circles_in_the_tree():
    assert circles(import_graph(ROOT)) == []
    assert circles(bench_graph(ROOT)) == []


def test_engine_layers_import_only_downward():
    assert upward_imports(import_graph(ROOT)) == []


def test_every_engine_module_stands_in_a_layer():
    """No flat modules at the engine's root: each file lives in a layer's package."""
    outside = [str(p.relative_to(ENGINE)) for p in ENGINE.rglob("*.py")
               if p.relative_to(ENGINE).parts[0] not in ENGINE_LAYERS and p.name != "__init__.py"
               or len(p.relative_to(ENGINE).parts) == 1 and p.name != "__init__.py"]
    assert outside == []
    assert sorted(p.name for p in ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").exists()) == sorted(ENGINE_LAYERS)


def test_engine_layers_say_what_they_own():
    for layer in ENGINE_LAYERS:
        assert ast.get_docstring(ast.parse((ENGINE / layer / "__init__.py").read_text())), layer


def test_the_core_steps_in_token_ids_and_never_makes_text():
    graph = import_graph(ROOT)
    offenders = sorted(f"{module} -> {target}" for module, targets in graph.items()
                       if module.startswith("native_backend.core") for target in targets & CLIENT_TEXT_MODULES)
    assert offenders == []
    assert "native_backend.text.detokenizer" in graph["native_backend.process.output_processor"]  # the check sees


def test_torch_free_layers_never_import_torch():
    offenders = [str(p.relative_to(ENGINE)) for layer in TORCH_FREE_LAYERS for p in (ENGINE / layer).rglob("*.py")
                 if imported_modules(p) & {"torch", "triton"}]
    assert offenders == []


def test_the_checks_see_circles_and_upward_imports(tmp_path):
    engine = tmp_path / "native_backend"
    for layer in ("core", "model", "text"):
        (engine / layer).mkdir(parents=True)
        (engine / layer / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("")
    (engine / "core" / "a.py").write_text("def f():\n    from native_backend.core import b\n")
    (engine / "core" / "b.py").write_text("from .a import f\nfrom native_backend.model.m import X\n")
    (engine / "model" / "m.py").write_text("from native_backend.text import t\n")
    (engine / "text" / "t.py").write_text("")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["native_backend.core.a", "native_backend.core.b"]]
    assert upward_imports(graph) == ["native_backend.core.b -> native_backend.model.m"]


# ------------------------------------------------------------------ the gateway's rooms


def test_gateway_rooms_import_only_downward():
    assert gateway_upward_imports(import_graph(ROOT)) == []


def test_the_gateway_room_table_is_a_ladder():
    """The table itself has no circle, so its rooms stand on floors."""
    assert circles(GATEWAY_ROOMS) == []
    assert all(allowed <= set(GATEWAY_ROOMS) for allowed in GATEWAY_ROOMS.values())


def test_every_gateway_module_stands_in_a_room():
    modules = [m for m in module_files(ROOT) if m.startswith("gateway")]
    assert sorted(m for m in modules if gateway_room(m) not in GATEWAY_ROOMS) == []
    packages = sorted(p.name for p in GATEWAY.iterdir() if (p / "__init__.py").exists())
    assert packages == sorted(set(GATEWAY_ROOMS) - {"seam", "state", "app", "cli"})


def test_gateway_packages_say_what_they_own():
    for package in GATEWAY.iterdir():
        if (package / "__init__.py").exists():
            assert ast.get_docstring(ast.parse((package / "__init__.py").read_text())), package.name


def test_plugins_import_only_the_gateways_seam():
    graph = import_graph(ROOT)
    offenders = sorted(f"{module} -> {target}" for module, targets in graph.items() if module.startswith("kvgate_")
                       for target in targets if gateway_room(target) not in (None, "seam"))
    assert offenders == []
    assert "gateway.backend" in graph["kvgate_echo"]  # the check sees the plugins' imports


def test_the_checks_see_upward_imports_in_the_gateway(tmp_path):
    gateway = tmp_path / "gateway"
    for package in ("pools", "api"):
        (gateway / package).mkdir(parents=True)
        (gateway / package / "__init__.py").write_text("")
    (gateway / "__init__.py").write_text("")
    (gateway / "errors.py").write_text("")
    (gateway / "pools" / "registry.py").write_text("from gateway.errors import E\nfrom gateway.api import generate\n")
    (gateway / "api" / "generate.py").write_text("from gateway.pools.registry import ModelRegistry\n")
    graph = import_graph(tmp_path)
    assert gateway_upward_imports(graph) == ["gateway.pools.registry -> gateway.api.generate"]
    assert circles(graph) == [["gateway.api.generate", "gateway.pools.registry"]]
