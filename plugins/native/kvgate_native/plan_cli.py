"""`kvgate plan`: will a model fit, and how many sequences will its KV cache hold?

The arithmetic lives in `native_backend.tools.memory_plan` (pure Python); this module is the command
line around it: arguments, the text table and `--json`. It is contributed to the `kvgate` command
through the `register_commands` hook, so the gateway never imports the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from native_backend.config.formats import KV_FORMATS, WEIGHT_FORMATS
from native_backend.tools import memory_plan as mp


class PlanCommand:
    """`kvgate plan` in the shape the `register_commands` hook asks for."""

    help = "memory plan: weights, KV bytes per token, blocks and sequences that fit on a GPU"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_arguments(parser)

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        return run(args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"GGUF file, HF directory (config.json), or one of: {', '.join(mp.KNOWN_MODELS)}")
    parser.add_argument("--gpu", help=f"one of: {', '.join(mp.GPUS)}")
    parser.add_argument("--memory-gib", type=float, help="memory of one GPU in GiB (instead of --gpu)")
    parser.add_argument("--kv-cache-gib", type=float,
                        help="an explicit KV budget per GPU in GiB (instead of --gpu: no weights subtracted)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs one stage spans)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (stages of --tp GPUs each)")
    parser.add_argument("--gpus", type=int, help="propose every tp x pp for this many GPUs (instead of --tp/--pp)")
    parser.add_argument("--weights", default="fp16", help=f"one of: {', '.join(WEIGHT_FORMATS)}")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help=f"auto (the model's compute dtype) or one of: {', '.join(KV_FORMATS)}")
    parser.add_argument("--max-model-len", type=int, help="full context in tokens; default: the model's")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of GPU memory the engine may use")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens one step computes")
    parser.add_argument("--max-num-seqs", type=int, default=32, help="sequences one step samples")
    parser.add_argument("--prefill-matmul", default="fp32", choices=mp.PREFILL_MATMULS,
                        help="the engine's prefill_matmul: bf16 (or auto with int4 weights) counts its bf16 copy "
                             "of the decoder's linears in the weights")
    parser.add_argument("--no-gqa", action="store_true",
                        help="the textbook 2 x layers x hidden x bytes per token: every query head its own K/V")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        if args.gpus is not None:
            layouts = mp.propose_layouts(_inputs(args), mp.model_shape(args.model), args.gpus)
        else:
            plan = mp.make_plan(_inputs(args), mp.model_shape(args.model))
    except mp.PlanError as exc:
        print(f"kvgate plan: {exc}", file=sys.stderr)
        return 1
    if args.gpus is not None:
        print(json.dumps([dataclasses.asdict(x) for x in layouts], indent=2) if args.json
              else "\n".join(render_layouts(args, layouts)))
        return 0
    print(json.dumps(plan.to_dict(), indent=2) if args.json else "\n".join(render(plan)))
    return 0


def render_layouts(args: argparse.Namespace, layouts: list[mp.Layout]) -> list[str]:
    """One row per tp x pp: memory per rank and the KV tokens the group holds."""
    where = args.gpu or (f"{args.memory_gib:g} GiB" if args.memory_gib else f"{args.kv_cache_gib:g} GiB of KV")
    lines = [f"{args.model} ({args.weights}) on {args.gpus} x {where}: tensor x pipeline parallel layouts",
             f"{'layout':<14}{'layers/rank':>12}{'weights/rank':>14}{'KV/token/rank':>15}{'KV tokens':>12}"
             f"{'full-context seqs':>19}"]
    for x in layouts:
        name = f"tp {x.tp} x pp {x.pp}" if x.pp > 1 else f"tp {x.tp}"
        if x.plan is None:
            lines.append(f"{name:<14}does not fit: {x.problem}")
            continue
        p = x.plan
        lines.append(f"{name:<14}{p.stage_layers:>12}{B(p.weights_bytes):>14}{B(p.kv_bytes_per_token):>15}"
                     f"{p.num_blocks * p.block_size:>12}{p.fits[0].sequences:>19}")
    if not layouts:
        lines.append("no tp x pp splits this model over these GPUs")
    lines.append("TP belongs inside a node (NVLink: two all-reduces per layer per token); across nodes use PP "
                 "(one hand-off of the hidden states per stage per step), e.g. tp 4 x pp 2 on two 4-GPU nodes.")
    return lines


def _inputs(args: argparse.Namespace) -> mp.PlanInputs:
    return mp.PlanInputs(
        model=args.model, weights=args.weights, kv_cache_dtype=args.kv_cache_dtype, gpu=args.gpu,
        memory_gib=args.memory_gib, kv_cache_gib=args.kv_cache_gib, tp=args.tp, pp=args.pp,
        max_model_len=args.max_model_len, block_size=args.block_size, memory_fraction=args.memory_fraction,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs, gqa=not args.no_gqa,
        prefill_matmul=args.prefill_matmul)


# ------------------------------------------------------------------------------ the text table

B = mp.fmt_bytes


def render(plan: mp.MemoryPlan) -> list[str]:
    return [_model_line(plan), *_budget_lines(plan), *_sequence_lines(plan), *_gqa_lines(plan), *_tp_lines(plan)]


def _model_line(plan: mp.MemoryPlan) -> str:
    c = plan.model
    return (f"{plan.inputs.model}: {c.num_layers} layers, {c.num_heads} query heads, {c.num_kv_heads} KV heads "
            f"x {c.head_dim}, hidden {c.hidden_size}, intermediate {c.intermediate_size}, vocab {c.vocab_size}, "
            f"context {c.max_position_embeddings}")


def _budget_lines(plan: mp.MemoryPlan) -> list[str]:
    p, rank = plan, " per rank" if plan.inputs.tp * plan.inputs.pp > 1 else ""
    stage = f", pp {p.inputs.pp} (the tightest stage: {p.stage_layers} layers)" if p.inputs.pp > 1 else ""
    copy = f", of which the bf16 prefill copy {B(p.prefill_copy_bytes)}" if p.prefill_copy_bytes else ""
    lines = [_row("weights", p.weights_format, f"{B(p.weights_bytes)} ({p.weights_bytes / 1e9:.1f} GB){rank}"
                  + (f", tp {p.inputs.tp}" if rank else "") + stage + copy),
             _row("KV cache", p.kv_cache_dtype, f"{B(p.kv_bytes_per_token)}/token{rank} = {_kv_formula(p)}")]
    if p.usable_bytes is not None:
        gpu = p.inputs.gpu or f"{p.inputs.memory_gib:g} GiB"
        lines += [_row("memory", gpu, f"{B(p.gpu_memory_bytes)} x {p.inputs.memory_fraction:.2f} = "
                                      f"{B(p.usable_bytes)} usable"),
                  _row("activations", "", f"{B(p.activation_bytes)} ({p.inputs.max_num_batched_tokens} tokens "
                                          f"a step, {p.inputs.max_num_seqs} sampled rows)"),
                  _row("reserve", "", f"{B(p.reserve_bytes)} (CUDA context, allocator slack)")]
    given = " (--kv-cache-gib)" if p.usable_bytes is None else ""
    lines += [_row("KV budget", "", f"{B(p.kv_budget_bytes)}{rank}{given}"),
              _row("blocks", "", f"{p.num_blocks} x {p.block_size} tokens ({B(p.bytes_per_block)} each)")]
    return lines


def _kv_formula(plan: mp.MemoryPlan) -> str:
    kv = KV_FORMATS[plan.kv_cache_dtype]
    element = f"{plan.model.head_dim} x {kv.bytes_per_element} B"
    if kv.scale_bytes_per_head:
        element = f"({element} + {kv.scale_bytes_per_head} B scale)"
    return f"2 x {plan.stage_layers or plan.model.num_layers} layers x {plan.kv_heads_per_rank} KV heads x {element}"


def _sequence_lines(plan: mp.MemoryPlan) -> list[str]:
    lines = ["sequences that fit at once:"]
    for fit in plan.fits:
        label = f"{fit.tokens} tokens" + (" (full context)" if fit.tokens == plan.max_model_len else "")
        lines.append(f"  {label:<28}{fit.sequences:>8}   ({B(fit.bytes_per_sequence)} of KV each)")
    return lines


def _gqa_lines(plan: mp.MemoryPlan) -> list[str]:
    """Say how far GQA moves the figure: the textbook one is 8x too big for a 70B Llama."""
    c, p = plan.model, plan
    if c.num_kv_heads == c.num_heads:
        return []
    ratio = p.textbook_kv_bytes_per_token / p.real_kv_bytes_per_token
    if not p.inputs.gqa:
        real, textbook = p.real_fits[0], p.fits[0]
        return [f"textbook figure (GQA ignored: as if each of the {c.num_heads} query heads had its own K and V).",
                f"With its real {c.num_kv_heads} KV heads of {c.head_dim}: {B(p.real_kv_bytes_per_token)}/token, "
                f"{ratio:g}x less, and {real.sequences} sequences of {real.tokens} tokens fit instead of "
                f"{textbook.sequences}."]
    return [f"GQA counted: {c.num_kv_heads} KV heads serve {c.num_heads} query heads; the textbook 2 x layers "
            f"x hidden x bytes (--no-gqa) would say {B(p.textbook_kv_bytes_per_token)}/token, {ratio:g}x more."]


def _tp_lines(plan: mp.MemoryPlan) -> list[str]:
    kv, tp = plan.model.num_kv_heads if plan.inputs.gqa else plan.model.num_heads, plan.inputs.tp
    if kv >= tp:
        return []
    return [f"tp {tp} > {kv} KV heads: each rank keeps a copy of one KV head ({tp // kv} copies of each), "
            f"so the group stores {tp // kv}x the KV of one copy."]


def _row(name: str, what: str, value: str) -> str:
    return f"{name:<13}{what:<12}{value}"
