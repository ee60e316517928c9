"""The Triton int4 kernel against the reference under TRITON_INTERPRET=1 (in a subprocess, so the
interpreter setting never leaks into other tests): ragged rows, edge columns, group sizes,
zero-point extremes, a bias."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASES = [  # (M, K, N, group)
    (1, 64, 40, 16), (5, 128, 64, 32), (17, 128, 48, 64), (33, 256, 96, 128), (3, 64, 8, 32),
]


def run_checks() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from native_backend.quantization.format import pack_int4
    from native_backend.quantization.reference import int4_linear as reference
    from native_backend.quantization.triton_int4 import int4_linear

    g = torch.Generator().manual_seed(0)
    for m, k, n, group in CASES:
        q = torch.randint(0, 16, (k, n), generator=g)
        z = torch.randint(0, 16, (k // group, n), generator=g)
        z[0] = 15  # zero-point extremes in the first group
        q[:group, :8] = 0
        s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
        x, bias = torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        args = (x, pack_int4(q), pack_int4(z), s, bias)
        expected, got = reference(*args), int4_linear(*args)
        err = float((got - expected).abs().max() / expected.abs().max())
        assert err < 1e-5, f"{(m, k, n, group)}: relative error {err}"
        print(f"{(m, k, n, group)}: ok ({err:.1e})")


def test_triton_int4_matches_the_reference_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO_ROOT}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == len(CASES), proc.stdout


if __name__ == "__main__":
    run_checks()
