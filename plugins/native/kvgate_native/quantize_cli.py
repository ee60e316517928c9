"""`kvgate quantize MODEL --method awq|rtn --bits 4 --group-size 64 --out DIR`: a float model (GGUF
file or HF directory; `default` is SmolLM2-135M-Instruct) in, an AutoAWQ GEMM int4 checkpoint
out, which a native deployment serves (`model: DIR`) and vLLM / transformers read.

Contributed to the `kvgate` command through the `register_commands` hook, like `kvgate plan`; the
engine (torch) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
import time


class QuantizeCommand:
    help = "int4 weights: quantize a model (AWQ or round-to-nearest) into an AutoAWQ GEMM checkpoint"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("model", help="GGUF file or HF directory (config.json + safetensors); "
                                          "'default': SmolLM2-135M-Instruct")
        parser.add_argument("--out", required=True, help="directory to write the checkpoint to")
        parser.add_argument("--method", choices=("awq", "rtn"), default="awq",
                            help="awq: activation-aware scales and clipping from calibration text, then "
                                 "rounding; rtn: rounding alone")
        parser.add_argument("--bits", type=int, default=4, help="bits per weight (4)")
        parser.add_argument("--group-size", type=int, default=64, help="weights per scale and zero point")
        parser.add_argument("--calib-samples", type=int, default=16, help="awq: calibration sequences")
        parser.add_argument("--calib-seq-len", type=int, default=256, help="awq: tokens per calibration sequence")
        parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        import torch

        from native_backend.config.default_model import default_gguf_path
        from native_backend.tools.quantize import QuantizeOptions, quantize_model

        if args.threads:
            torch.set_num_threads(args.threads)
        source = default_gguf_path() if args.model == "default" else args.model
        options = QuantizeOptions(method=args.method, bits=args.bits, group_size=args.group_size,
                                  calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len)
        try:
            quantize_model(source, args.out, options, Progress())
        except (ValueError, FileNotFoundError, NotImplementedError) as exc:
            print(f"\nkvgate quantize: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {args.out} ({args.method} int4, group {args.group_size})", file=sys.stderr)
        return 0


class Progress:
    """One line per stage on stderr, rewritten after each layer: `awq search [#####.....] 15/30 42s`."""

    def __init__(self, width: int = 30):
        self.width, self.start, self.stage = width, time.monotonic(), None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if stage != self.stage and self.stage is not None:
            sys.stderr.write("\n")
        self.stage = stage
        filled = self.width * done // total
        sys.stderr.write(f"\r{stage:<12} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} "
                         f"{time.monotonic() - self.start:.0f}s")
        if done == total:
            sys.stderr.write("\n")
            self.stage = None
        sys.stderr.flush()
