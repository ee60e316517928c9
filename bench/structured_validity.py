"""Validity of structured outputs and tool calls on the native engine, the whole battery through
HTTP (issue 28 item 5): `kvgate serve` in its own process (SmolLM2-135M-Instruct, CPU), the openai
client, `--concurrency` requests at a time, sampled at temperature 0.7 with a seed per case.

1. Every schema, regex and choice of bench/structured_battery.py with its constraint, and the same
   prompts (which show the schema or pattern, so the model knows what is wanted) without it, for
   contrast: how many outputs are complete (finish_reason stop) and how many of those parse and
   validate (`jsonschema` with format checks, `re.fullmatch`, membership). The cases and their
   checks are bench/structured.py's (`battery_cases`, `run_case`).
2. Tool calls: every TOOL_CASES request with all six TOOLS on offer, under `tool_choice`
   "required" (parallel_tool_calls false), a named function (the tool that fits) and "auto" for
   contrast: how many requests end in calls, how many calls are valid (a tool on offer, or the
   named one; arguments that parse as a JSON object and validate against its parameters), and
   how often the fitting tool was chosen.

    .venv/bin/python bench/structured_validity.py                # both, into bench/results/structured_validity.json
    .venv/bin/python bench/structured_validity.py --only tools   # one part; the file keeps the other's figures
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from structured import battery_cases, run_case, summary  # noqa: E402
from structured_battery import TOOL_CASES, TOOLS  # noqa: E402

TOOL_MODES = ("required", "named", "auto")
# On a shared CPU a batch of 8 prefills (the six tools' prompt is ~700 tokens each) can take
# minutes before a first token: the gateway must wait, and not open the breaker over it.
SERVE_CONFIG = """
models:
  - name: smollm2
    timeouts: {{first_token_s: 900, idle_s: 900}}
    breaker: {{failures: 1000, cooldown_s: 1}}
    deployments:
      - name: native-0
        backend: native
        settings: {{max_num_seqs: {seqs}, max_num_batched_tokens: 256, kv_cache_bytes: 268435456, num_threads: {threads}}}
"""
PARAMETERS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}


@contextlib.contextmanager
def served_gateway(threads: int, seqs: int):
    """The openai client of a `kvgate serve` process (a native SmolLM2 deployment), until the end."""
    import openai
    from tests.support.servers.loopback import free_port
    from upstream_overhead import spawn

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "structured.yaml"
        config.write_text(SERVE_CONFIG.format(threads=threads, seqs=seqs))
        server = spawn([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)],
                       base + "/health/ready", env={"PYTHONPATH": str(ROOT)}, timeout=900)
        try:
            yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=900)
        finally:
            server.terminate()
            server.wait(60)


# ------------------------------------------------------------------------------ tool calls


def call_is_valid(call, allowed: set[str]) -> bool:
    """A call of an allowed tool whose arguments are a JSON object valid against its parameters
    (a tool without parameters takes `{}`)."""
    import jsonschema

    if call.function.name not in allowed:
        return False
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        return False
    schema = PARAMETERS[call.function.name] or {"type": "object", "maxProperties": 0}
    try:
        jsonschema.validate(arguments, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return False
    return isinstance(arguments, dict)


def run_tool_case(client, case: tuple[str, str, str], mode: str, seed: int, max_tokens: int) -> dict:
    name, fits, prompt = case
    kw = dict(model="smollm2", messages=[{"role": "user", "content": prompt}], tools=TOOLS, max_tokens=max_tokens,
              temperature=0.7, seed=seed)
    allowed = set(PARAMETERS)
    if mode == "required":
        kw.update(tool_choice="required", parallel_tool_calls=False)
    elif mode == "named":
        kw["tool_choice"] = {"type": "function", "function": {"name": fits}}
        allowed = {fits}
    else:
        kw["tool_choice"] = "auto"
    try:
        out = client.chat.completions.create(**kw)
    except Exception as exc:  # noqa: BLE001 - a refusal is a result too
        return {"name": name, "mode": mode, "status": "error", "error": f"{type(exc).__name__}: {exc}"[:300]}
    choice = out.choices[0]
    calls = choice.message.tool_calls or []
    valid = [call_is_valid(c, allowed) for c in calls]
    return {"name": name, "mode": mode, "status": choice.finish_reason, "calls": len(calls), "valid_calls": sum(valid),
            "fitting_tool": any(c.function.name == fits for c in calls), "tokens": out.usage.completion_tokens,
            "called": [f"{c.function.name}({c.function.arguments})"[:200] for c in calls],
            "text": (choice.message.content or "")[:200]}


def tool_summary(rows: list[dict]) -> dict:
    return {"cases": len(rows), "ended_in_calls": sum(r["status"] == "tool_calls" for r in rows),
            "cut_by_max_tokens": sum(r["status"] == "length" for r in rows),
            "errors": sum(r["status"] == "error" for r in rows),
            "calls": sum(r.get("calls", 0) for r in rows), "valid_calls": sum(r.get("valid_calls", 0) for r in rows),
            "fitting_tool": sum(r.get("fitting_tool", False) for r in rows)}


# ------------------------------------------------------------------------------ the run


def run_all(pool, jobs: list) -> list[dict]:
    return [f.result() for f in [pool.submit(*job) for job in jobs]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the engine")
    parser.add_argument("--concurrency", type=int, default=16, help="requests at a time (and the engine's max_num_seqs)")
    parser.add_argument("--tool-max-tokens", type=int, default=128)
    parser.add_argument("--only", choices=("tools", "schemas"), help="run one part")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "structured_validity.json"))
    args = parser.parse_args()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {}  # a part not run keeps its figures

    def record(part: str, mode: str, rows: list[dict], summarized: dict) -> None:
        result.setdefault(part, {})[mode] = {**summarized, "cases": rows}
        result[part]["args"] = {**vars(args), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        print(f"{part} {mode}: {json.dumps(summarized)}", flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    with served_gateway(args.threads, args.concurrency) as client, \
            concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        for mode in TOOL_MODES if args.only != "schemas" else ():
            rows = run_all(pool, [(run_tool_case, client, c, mode, i, args.tool_max_tokens)
                                  for i, c in enumerate(TOOL_CASES)])
            record("tools", mode, rows, {"summary": tool_summary(rows)})
        cases = battery_cases() if args.only != "tools" else []
        for mode in ("constrained", "unconstrained") if cases else ():
            rows = run_all(pool, [(run_case, client, c, mode == "constrained", i) for i, c in enumerate(cases)])
            record("schemas", mode, rows, {kind: summary([r for r in rows if r.get("kind") == kind])
                                           for kind in ("json_schema", "regex", "choice")} | {"all": summary(rows)})


if __name__ == "__main__":
    main()
