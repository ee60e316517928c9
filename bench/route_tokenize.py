"""What tokenizing a prompt for precise_prefix routing costs the event loop (issue 31, item 2).

Routing turns a native pool's prompts into token ids in the gateway process
(gateway.routing.prompt_tokens): inline up to INLINE_CHARS characters, on a tokenizing thread past that. For
chat prompts of several sizes (English text, `pydoc_data.topics`, through SmolLM2's chat template)
the table shows the tokenizing time inline, the latency of PromptTokens.prepare (inline or thread,
as it decides), and the longest gap a 1 ms ticker on the loop saw meanwhile (the stall every stream
would see), medians of --repeats; plus the cost of a bare hop to a thread and back, what a short
prompt would pay on top if it were sent to a thread too.

    .venv/bin/python bench/route_tokenize.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.tokenize_stall import longest_gap  # noqa: E402
from gateway.routing.prompt_tokens import INLINE_CHARS, PromptTokens  # noqa: E402
from native_backend.config.default_model import default_gguf_path  # noqa: E402
from native_backend.text.tokenizer import Tokenizer  # noqa: E402

SIZES = (256, INLINE_CHARS, 4096, 32768)  # 32768: precise_prefix's default max_prompt_chars


def chat_of(chars: int) -> list[dict]:
    from pydoc_data.topics import topics

    text = "\n".join(topics.values())[:chars]
    return [{"role": "system", "content": text[: chars // 2]}, {"role": "user", "content": text[chars // 2:]}]


async def measure(tokenizer: Tokenizer, repeats: int) -> dict:
    backend = SimpleNamespace(prompt_token_ids=lambda r: tokenizer.apply_chat_template(r.messages))
    deployments = [SimpleNamespace(name="native-0", backend=backend)]
    rows = []
    for chars in SIZES:
        messages = chat_of(chars)
        inline = []
        for _ in range(repeats):
            started = time.perf_counter()
            tokenizer.apply_chat_template(messages)
            inline.append(time.perf_counter() - started)
        took, stalls = [], []
        for i in range(repeats):
            took.append(await timed_prepare(messages, deployments, watched=False))
            stalls.append(await timed_prepare(messages, deployments, watched=True))
        rows.append({"chars": chars, "tokens": len(tokenizer.apply_chat_template(messages)),
                     "where": "inline" if chars <= INLINE_CHARS else "thread",
                     "tokenize_inline_us": 1e6 * statistics.median(inline),
                     "prepare_us": 1e6 * statistics.median(took),
                     "loop_stall_ms": 1e3 * statistics.median(stalls)})
    idle = [(await longest_gap(lambda: asyncio.sleep(0)))[0] for _ in range(repeats)]  # the ticker's own gap, no work
    return {"rows": rows, "thread_hop_us": await thread_hop_us(repeats * 10),
            "idle_gap_ms": 1e3 * statistics.median(idle)}


async def timed_prepare(messages, deployments, watched: bool) -> float:
    """Seconds PromptTokens.prepare took, or (watched) the longest loop gap meanwhile."""
    tokens = PromptTokens(max_chars=10**9, timeout_s=1.0, kept=8)
    request = SimpleNamespace(request_id="r", messages=messages, prompt=None, tools=None, tool_choice=None)
    try:
        if watched:
            return (await longest_gap(lambda: tokens.prepare(request, deployments)))[0]
        started = time.perf_counter()
        await tokens.prepare(request, deployments)
        return time.perf_counter() - started
    finally:
        tokens.close()


async def thread_hop_us(repeats: int) -> float:
    loop = asyncio.get_running_loop()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hops = []
        for _ in range(repeats):
            started = time.perf_counter()
            await loop.run_in_executor(pool, int)
            hops.append(time.perf_counter() - started)
    return 1e6 * statistics.median(hops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "route_tokenize.json"))
    args = parser.parse_args()
    result = asyncio.run(measure(Tokenizer.from_pretrained(default_gguf_path()), args.repeats))
    print(f"{'chars':>6} {'tokens':>7} {'where':7} {'inline us':>10} {'prepare us':>11} {'loop stall ms':>14}")
    for r in result["rows"]:
        print(f"{r['chars']:6d} {r['tokens']:7d} {r['where']:7} {r['tokenize_inline_us']:10.0f} "
              f"{r['prepare_us']:11.0f} {r['loop_stall_ms']:14.2f}")
    print(f"a bare hop to a thread and back: {result['thread_hop_us']:.0f} us; "
          f"the ticker's gap with no work: {result['idle_gap_ms']:.2f} ms")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
