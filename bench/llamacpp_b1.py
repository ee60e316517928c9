"""llama.cpp's own batch-1 decode, for bench/awq_speed.py's anchor row; runs in the venv that
`bash bench/llamacpp_server.sh install` builds (it imports only llama_cpp and the standard library).

    $(bash bench/llamacpp_server.sh python) bench/llamacpp_b1.py MODEL.gguf THREADS

Reads one JSON command per line on stdin, answers one JSON line on stdout:
  {"cmd": "b1", "prompt": [token ids], "new": N} -> {"new_tokens": N, "decode_tok_s": rate}
  {"cmd": "ttft", "prompt": [token ids]}          -> {"ttft_s": seconds to the first token, "prompt_tokens": n}
  {"cmd": "c2", "prompts": [[ids]...], "new": [N...]} -> {"out_tokens", "wall_s", "out_tok_s"}: the requests
                                                    one after another (llama-cpp-python has no batching)
  {"cmd": "stop"}                                 -> exits
The prompt's token ids are the same ones the engines get (the model's own tokenizer, read from the
GGUF by both). Greedy (top_k 1), EOS not honoured: N tokens are generated. The rate is taken as the
engines' is: (N - 1) / (time of the last token - time of the first).
"""

import json
import sys
import time

from llama_cpp import Llama


def decode_rate(llm: Llama, prompt: list[int], new: int) -> dict:
    times = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # EOS is not checked by generate()
        times.append(time.perf_counter())
        if len(times) == new:
            break
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return {"new_tokens": len(times), "decode_tok_s": rate}


def ttft(llm: Llama, prompt: list[int]) -> dict:
    started = time.perf_counter()
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # the prompt's evaluation, then one token
        break
    return {"ttft_s": time.perf_counter() - started, "prompt_tokens": len(prompt)}


def sequential(llm: Llama, prompts: list[list[int]], news: list[int]) -> dict:
    started, out = time.perf_counter(), 0
    for prompt, new in zip(prompts, news):
        for n, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 1):
            if n == new:
                break
        out += n
    wall = time.perf_counter() - started
    return {"out_tokens": out, "wall_s": wall, "out_tok_s": out / wall}


def answer(llm: Llama, cmd: dict) -> dict:
    if cmd["cmd"] == "ttft":
        return ttft(llm, cmd["prompt"])
    if cmd["cmd"] == "c2":
        return sequential(llm, cmd["prompts"], cmd["new"])
    return decode_rate(llm, cmd["prompt"], cmd["new"])


def main() -> None:
    path, threads = sys.argv[1], int(sys.argv[2])
    # n_ctx: a 4,096-token TTFT prompt and its first token
    llm = Llama(model_path=path, n_ctx=8192, n_threads=threads, n_threads_batch=threads, verbose=False)
    print(json.dumps({"ready": True, "threads": threads}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "stop":
            return
        print(json.dumps(answer(llm, cmd)), flush=True)


if __name__ == "__main__":
    main()
