"""Calibration text for AWQ: English prose that ships with the project, held apart from the text
we evaluate on.

`calibration.txt` holds the docstrings of a fixed list of standard-library modules (their classes
and functions), made by `make_calibration_text()` below. Perplexity is measured on
`pydoc_data.topics` (the language reference's topics), which shares no paragraph with it
(tests/native_backend/test_awq_search.py checks). AutoAWQ calibrates on 128 x 512 tokens of the
Pile; AWQ needs few samples (the paper: the result barely moves from 16 samples up), and on two
CPU cores every token costs 20 forward passes of each layer, so the default here is 16 x 256.
"""

from __future__ import annotations

from pathlib import Path

import torch

CALIBRATION_FILE = Path(__file__).with_name("calibration.txt")
CALIBRATION_MODULES = (
    "argparse", "collections", "csv", "datetime", "decimal", "fractions", "functools", "heapq", "http.client",
    "http.server", "inspect", "itertools", "json", "logging", "pathlib", "pickle", "queue", "random", "shutil",
    "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "unittest", "urllib.parse", "urllib.request", "uuid", "zipfile", "email.message", "difflib", "calendar",
    "configparser", "contextlib", "dataclasses", "enum", "fnmatch", "gzip", "hashlib", "ipaddress", "locale",
    "mailbox", "numbers", "operator", "optparse", "pprint", "sched", "selectors", "smtplib", "ssl", "struct",
    "timeit", "typing", "warnings", "weakref", "zoneinfo", "asyncio.tasks", "asyncio.streams",
)
MAX_CHARS = 200_000


def make_calibration_text() -> str:
    """Docstrings longer than 200 characters, module by module (how calibration.txt was made)."""
    import importlib
    import inspect

    seen, parts = set(), []
    for module_name in CALIBRATION_MODULES:
        module = importlib.import_module(module_name)
        objects = [obj for name, obj in sorted(vars(module).items()) if not name.startswith("_")
                   and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__]
        for doc in [inspect.getdoc(module)] + [inspect.getdoc(obj) for obj in objects]:
            if doc and len(doc) > 200 and doc not in seen:
                seen.add(doc)
                parts.append(doc)
    return "\n\n".join(parts)[:MAX_CHARS]


def calibration_text() -> str:
    return CALIBRATION_FILE.read_text(encoding="utf-8")


def calibration_tokens(token_ids: list[int], samples: int, seq_len: int) -> torch.Tensor:
    """(samples, seq_len) int64: blocks of seq_len consecutive tokens spread evenly over the text."""
    blocks = len(token_ids) // seq_len
    if blocks < samples:
        raise ValueError(f"calibration text has {len(token_ids)} tokens: not {samples} samples of {seq_len}")
    picks = [i * blocks // samples for i in range(samples)]
    return torch.tensor([token_ids[b * seq_len:(b + 1) * seq_len] for b in picks], dtype=torch.int64)


def calibration_batch(source: str, samples: int, seq_len: int) -> torch.Tensor:
    """The calibration text in the source model's tokens, (samples, seq_len)."""
    from native_backend.config.cache_dir import tokenizer_cache_dir
    from native_backend.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(source, cache_dir=tokenizer_cache_dir())
    return calibration_tokens(tokenizer.encode(calibration_text(), add_special_tokens=False), samples, seq_len)


if __name__ == "__main__":  # regenerate calibration.txt
    CALIBRATION_FILE.write_text(make_calibration_text() + "\n", encoding="utf-8")
