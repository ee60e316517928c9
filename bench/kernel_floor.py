"""The AVX2 floor against itself before the AVX-512 work: the linear kernels of today's builds and of
an older commit's sources, side by side in one run (issue 29 item 2: "the AVX2 floor stays as fast
as today").

The C sources of `--before` (default 33aa1ed^, the last commit with one AVX2-only build) are taken
from git and compiled with that commit's flags (`-O3 -mavx2 -mfma`, as cpu_kernels.py built them
then) into a temporary library; today's `avx2` and `avx512` libraries are cpu_kernels' own. Each
library is called through ctypes on the same tensors (the linear kernels' C signatures have not
changed since), library after library within each repeat, the order rotated every repeat, fastest
of the repeats kept (the least disturbed on a shared box). A row is one SmolLM2 decoder layer's
seven products (q, k, v, o, gate, up, down: 10 MB of fp32 weights, more than L2, as in decode) at
a number of rows:

- `fp32 M`: kvgate_linear_f32 (the engine's float linears, up to 224 rows);
- `int4 M`: kvgate_int4_linear_off_f32 (the default GGUF's Q4_1 linears, groups of 32);
- `head`: kvgate_int8_rows_f32, the int4 model's LM head (49,152 x 576 int8), one row.

    .venv/bin/python bench/kernel_floor.py --threads 1       # ~1 minute
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CSRC = "native_backend/kernels/csrc"
BEFORE_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-fvisibility=hidden", "-std=c11"]
# SmolLM2-135M's decoder linears, (out, in): q, k, v, o, gate, up, down
LAYER = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
HEAD = (49152, 576)
GROUP = 32  # Q4_1


def build_before(commit: str, workdir: Path) -> Path:
    """The library of `commit`'s C sources, compiled as cpu_kernels.py compiled them then."""
    from native_backend.kernels import cpu_kernels

    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{commit}:{CSRC}"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{CSRC}/{name}"], check=True,
                              capture_output=True).stdout
        (workdir / name).write_bytes(blob)
    out = workdir / "kernels_before.so"
    # in cpu_kernels.SOURCES' order, as it linked them: the order places the code, and a loop's
    # placement alone moved the one-row product by ~10 % in these runs
    order = [p.name for p in cpu_kernels.SOURCES]
    sources = [str(workdir / n) for n in sorted((n for n in names if n.endswith(".c")),
                                                key=lambda n: order.index(n) if n in order else len(order))]
    subprocess.run([os.environ.get("CC", "gcc"), *BEFORE_FLAGS, *sources, "-o", str(out), "-lm"], check=True)
    return out


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, args in (("kvgate_linear_f32", [ptr] * 4 + [i64] * 3),
                       ("kvgate_int4_linear_off_f32", [ptr] * 6 + [i64] * 4),
                       ("kvgate_int8_rows_f32", [ptr] * 4 + [i64] * 3)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def layer_weights(torch):
    fp32 = [torch.randn(n, k) * 0.02 for n, k in LAYER]
    int4 = [(torch.randint(-2**31, 2**31 - 1, (k, n // 8), dtype=torch.int32),
             (torch.rand(k // GROUP, n) * 0.01).half().view(torch.int16),
             (torch.rand(k // GROUP, n) * 0.01).half().view(torch.int16)) for n, k in LAYER]
    head = (torch.randint(-127, 127, HEAD, dtype=torch.int8), torch.rand(HEAD[0]) * 0.01)
    return fp32, int4, head


def row_calls(torch, lib, rows: int, kind: str, weights):
    """A function running one layer's products (or the head) at `rows` rows on `lib`."""
    fp32, int4, head = weights
    if kind == "head":
        x, y = torch.randn(rows, HEAD[1]), torch.empty(rows, HEAD[0])
        return lambda: lib.kvgate_int8_rows_f32(y.data_ptr(), x.data_ptr(), head[0].data_ptr(), head[1].data_ptr(),
                                                rows, HEAD[1], HEAD[0])
    xs = {k: torch.randn(rows, k) for k in {k for _, k in LAYER}}
    ys = [torch.empty(rows, n) for n, _ in LAYER]

    def fp32_layer():
        for (n, k), w, y in zip(LAYER, fp32, ys):
            assert lib.kvgate_linear_f32(y.data_ptr(), xs[k].data_ptr(), w.data_ptr(), None, rows, k, n) == 0

    def int4_layer():
        for (n, k), (q, off, sc), y in zip(LAYER, int4, ys):
            assert lib.kvgate_int4_linear_off_f32(y.data_ptr(), xs[k].data_ptr(), q.data_ptr(), off.data_ptr(),
                                                  sc.data_ptr(), None, rows, k, n, GROUP) == 0

    return fp32_layer if kind == "fp32" else int4_layer


def fastest(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="33aa1ed^", help="the commit whose sources are the baseline")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", help="JSON path (default bench/results/kernel_floor.json)")
    args = parser.parse_args()

    import torch

    from native_backend.kernels import cpu_kernels

    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"avx2 before": bind(ctypes.CDLL(str(build_before(args.before, Path(tmp)))))}
        for name in ("avx2", "avx512"):
            os.environ["KVGATE_CPU_ISA"] = name
            cpu_kernels.reset_choice()
            if cpu_kernels.path() is not None and cpu_kernels.path().name == name:
                libs[name] = bind(cpu_kernels.load())
        weights = layer_weights(torch)
        rows = [("fp32", m) for m in (1, 2, 4, 8, 16, 32, 64)] + [("int4", m) for m in (1, 2, 4, 8, 32)] + \
               [("head", 1)]
        load_start = os.getloadavg()[0]
        table = {}
        for kind, m in rows:
            fns = {name: row_calls(torch, lib, m, kind, weights) for name, lib in libs.items()}
            for fn in fns.values():
                fn()  # warm: pages touched, OpenMP pool up
            best = {name: float("inf") for name in fns}
            names = list(fns)
            for rep in range(args.repeats):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    best[name] = min(best[name], fastest(fns[name], 3))
            base = best["avx2 before"]
            speedups = {f"{n} / before": round(base / t, 3) for n, t in best.items() if n != "avx2 before"}
            table[f"{kind} {m}"] = {**{n: round(t * 1e6, 1) for n, t in best.items()}, **speedups}
            print(f"{kind:5s} {m:4d} " + "  ".join(f"{n} {t * 1e6:8.1f} us" for n, t in best.items())
                  + "  " + "  ".join(f"{n}: {base / t:.2f}x" for n, t in best.items() if n != "avx2 before"),
                  flush=True)
    report = {"before": args.before, "threads": args.threads, "repeats": args.repeats,
              "load_average_start": load_start, "load_average_end": os.getloadavg()[0],
              "unit": "microseconds per layer (head: per call); x / before: speed-up over the old AVX2 build",
              "rows": table}
    out = Path(args.out or ROOT / "bench/results/kernel_floor.json")
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
