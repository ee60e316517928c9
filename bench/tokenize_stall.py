"""How long tokenizing the largest allowed input would stall the event loop, inline vs on the
native plugin's tokenizing threads (issue 17, item 7).

The input: a completion prompt of `server.limits.max_body_bytes` (default 1 MiB) of English text
(`pydoc_data.topics`), and a chat of `max_messages` (256) messages filling the same bytes through
the model's chat template; the SmolLM2 tokenizer the native plugin uses. While each is tokenized,
a ticker on the event loop wakes every 1 ms; the table shows the longest gap it saw (the stall
every stream of the gateway would see), and the tokenizing time itself, medians of --repeats.

    .venv/bin/python bench/tokenize_stall.py [--repeats 5]
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.config import RequestLimits  # noqa: E402
from native_backend.config.default_model import default_gguf_path  # noqa: E402
from native_backend.text.tokenizer import Tokenizer  # noqa: E402


def inputs(limits: RequestLimits) -> dict:
    from pydoc_data.topics import topics

    text = "\n".join(topics.values())
    while len(text.encode()) < limits.max_body_bytes:
        text += text
    prompt = text.encode()[: limits.max_body_bytes - 200].decode(errors="ignore")  # room for the JSON around it
    per = len(prompt) // limits.max_messages
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": prompt[i * per:(i + 1) * per]}
                for i in range(limits.max_messages - 1)] + [{"role": "user", "content": "Sum it up."}]
    return {"prompt": prompt, "messages": messages}


async def longest_gap(work) -> tuple[float, float]:
    """(longest ticker gap, seconds `work` took), both in seconds."""
    gaps, stop = [], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    await work()
    took = time.perf_counter() - started
    stop.set()
    await task
    return max(gaps), took


async def measure(tokenizer: Tokenizer, data: dict, repeats: int) -> list[dict]:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    loop = asyncio.get_running_loop()
    jobs = {"prompt (encode)": lambda: tokenizer.encode(data["prompt"]),
            "chat (template + encode)": lambda: tokenizer.apply_chat_template(data["messages"])}
    rows = []
    for name, job in jobs.items():
        for where in ("inline", "thread"):
            async def work():
                if where == "inline":
                    job()
                else:
                    await loop.run_in_executor(pool, job)
            samples = [await longest_gap(work) for _ in range(repeats)]
            rows.append({"input": name, "where": where, "tokens": len(job()),
                         "loop_stall_ms": 1000 * statistics.median(g for g, _ in samples),
                         "tokenize_ms": 1000 * statistics.median(t for _, t in samples)})
    pool.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "tokenize_stall.json"))
    args = parser.parse_args()
    limits = RequestLimits()
    tokenizer = Tokenizer.from_pretrained(default_gguf_path())
    rows = asyncio.run(measure(tokenizer, inputs(limits), args.repeats))
    print(f"{'input':26} {'where':7} {'tokens':>8} {'loop stall ms':>14} {'tokenize ms':>12}")
    for r in rows:
        print(f"{r['input']:26} {r['where']:7} {r['tokens']:8d} {r['loop_stall_ms']:14.1f} {r['tokenize_ms']:12.1f}")
    Path(args.out).write_text(json.dumps({"max_body_bytes": limits.max_body_bytes, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
