"""The model architectures this engine runs, and the architecture a model on disk declares.

One list (`ARCHITECTURES`): the model registry (model/models) builds its classes from it, and the
native plugin's settings check (`kvgate check-config`) refuses a model file outside it without
loading the engine. Standard library only: reading a GGUF's architecture takes its first metadata
entries, not the whole file (gguf's reader parses the tokenizer too, seconds for SmolLM2).
"""

from __future__ import annotations

import json
import os
import struct

# GGUF `general.architecture` / HF config.json `model_type` -> the implementation that runs it
# (model/models' registry maps each implementation to its class). Qwen2 needs q/k/v biases only
# (`ModelConfig.attention_bias`), which the Llama class would have to grow first.
ARCHITECTURES = {"llama": "llama", "mistral": "llama"}


def check_architecture(architecture: str) -> None:
    """ValueError naming `architecture` and the ones this engine runs when it is not one of them."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model architecture {architecture or '(none named)'!r} is not supported; "
                         f"this engine runs {', '.join(ARCHITECTURES)}")


def architecture_on_disk(path: str) -> str:
    """What the model at `path` says it is: an HF directory's config.json `model_type`, a GGUF
    file's `general.architecture` ('' when it names none). OSError / ValueError: unreadable."""
    if os.path.isdir(path):
        with open(os.path.join(path, "config.json")) as f:
            return str(json.load(f).get("model_type") or "")
    with open(path, "rb") as f:
        return _gguf_architecture(f)


# GGUF metadata value types (llama.cpp's gguf.md): fixed sizes by type id; 8 string, 9 array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _gguf_architecture(f) -> str:
    """`general.architecture` from a GGUF header (writers put it first; later ones are scanned)."""
    magic, _version, _tensors, num_fields = struct.unpack("<4sIQQ", f.read(24))
    if magic != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    for _ in range(num_fields):
        key, kind = _gguf_string(f), _unpack(f, "<I")
        if key == "general.architecture" and kind == _STRING:
            return _gguf_string(f)
        _skip_value(f, kind)
    return ""


def _skip_value(f, kind: int) -> None:
    if kind == _STRING:
        f.seek(_unpack(f, "<Q"), os.SEEK_CUR)
    elif kind == _ARRAY:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(f, item)
    elif kind in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[kind], os.SEEK_CUR)
    else:
        raise ValueError(f"GGUF metadata of unknown type {kind}")


def _gguf_string(f) -> str:
    return f.read(_unpack(f, "<Q")).decode("utf-8", errors="replace")


def _unpack(f, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("GGUF header ends early")
    return struct.unpack(fmt, data)[0]
