"""`kvgate engine --headless`: a node of a native engine that spans machines, holding its ranks and
serving no HTTP (vLLM's `--headless` workers, its `--nnodes / --node-rank / --master-addr /
--master-port` flags).

Node 0 is the engine itself: the native deployment of `kvgate serve` whose settings say `nnodes`,
`master_addr` and `master_port`; every other node runs

    KVGATE_RENDEZVOUS_SECRET=... kvgate engine --headless --nnodes 2 --node-rank 1 \\
        --master-addr 10.0.0.1 --master-port 29500

and gets the engine's config (model path, sizes) from node 0 once it has proved the shared secret
(native_backend.execution.parallel.nodes). It rejoins whenever node 0's engine restarts.
"""

from __future__ import annotations

import argparse
import logging
import sys


class EngineCommand:
    """`kvgate engine` in the shape the `register_commands` hook asks for."""

    help = "a headless node of a native engine across machines (holds its ranks, serves no HTTP)"

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--headless", action="store_true",
                            help="hold this node's ranks and serve no HTTP (every node but 0; implied)")
        parser.add_argument("--nnodes", type=int, required=True, help="nodes the engine spans")
        parser.add_argument("--node-rank", type=int, required=True,
                            help="this node's rank, 1..nnodes-1 (node 0 is `kvgate serve` with the native "
                                 "deployment's nnodes / master_addr / master_port settings)")
        parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's rendezvous address")
        parser.add_argument("--master-port", type=int, default=29500, help="node 0's rendezvous port")
        parser.add_argument("--rendezvous-secret-file",
                            help="file holding the secret the nodes share (default: $KVGATE_RENDEZVOUS_SECRET)")
        parser.add_argument("--log-level", default="info", help="debug, info, warning or error")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        return run(args)


def run(args: argparse.Namespace) -> int:
    from native_backend.execution.parallel.node_agent import run_node
    from native_backend.execution.parallel.nodes import load_secret

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.node_rank == 0:
        print("kvgate engine: node 0 is the engine itself: run `kvgate serve` with a native deployment whose "
              "settings say nnodes, master_addr and master_port (docs/engine/pipeline-parallel.md)", file=sys.stderr)
        return 2
    if not 0 < args.node_rank < args.nnodes:
        print(f"kvgate engine: --node-rank {args.node_rank} is not one of 1..{args.nnodes - 1}", file=sys.stderr)
        return 2
    try:
        secret = load_secret(args.rendezvous_secret_file)
    except ValueError as exc:
        print(f"kvgate engine: {exc}", file=sys.stderr)
        return 2
    try:
        return run_node(args.master_addr, args.master_port, args.node_rank, secret)
    except KeyboardInterrupt:
        return 0
