"""gateway/ knows engines only through the Backend protocol: it never imports torch or the engine."""

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
FORBIDDEN = {"torch", "native_backend", "triton", "transformers"}


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
    sample.write_text("import torch.nn\nfrom native_backend.engine import X\n")
    assert imported_modules(sample) & FORBIDDEN == {"torch", "native_backend"}


def test_engine_does_not_import_the_gateway():
    engine = GATEWAY.parent / "native_backend"
    offenders = [str(p) for p in engine.rglob("*.py") if "gateway" in imported_modules(p)]
    assert offenders == []
