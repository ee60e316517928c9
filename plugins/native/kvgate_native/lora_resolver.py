"""vLLM's filesystem LoRA resolver for a native deployment: `<lora_resolver_dir>/<name>/` holding
an adapter_config.json is adapter `<name>`, served from its first request on (the backend loads
it then, as POST /v1/load_lora_adapter would). The directory is listed at most once a second:
the listing feeds `load()`, which runs on every routing decision."""

from __future__ import annotations

import os
import time

REFRESH_S = 1.0


class DirectoryResolver:
    def __init__(self, directory: str, refresh_s: float = REFRESH_S):
        self.directory, self.refresh_s = directory, refresh_s
        self._found: dict[str, str] = {}
        self._listed_at = float("-inf")

    def adapters(self) -> dict[str, str]:
        """name -> adapter directory for every adapter in the directory now (a second old at most)."""
        now = time.monotonic()
        if now - self._listed_at >= self.refresh_s:
            self._listed_at, self._found = now, self._list()
        return self._found

    def _list(self) -> dict[str, str]:
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return {}  # not there (yet): nothing to serve from it
        return {e.name: e.path for e in entries
                if e.is_dir() and os.path.isfile(os.path.join(e.path, "adapter_config.json"))}
