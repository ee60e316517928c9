"""The upstream's load, read from the Prometheus text it publishes.

Each engine names the same three signals differently; a preset lists the names (new ones first).
Counts are summed across label sets (several engines or models behind one server); the KV-cache
fraction takes the largest, since a sum of fractions means nothing and the fullest engine is the
one a new request may land on.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Names:
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_usage: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return self.waiting + self.running + self.kv_usage


VLLM = Names(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # the second: vLLM < 0.10
)
SGLANG = Names(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
)
TRTLLM = Names(  # trtllm-serve 1.2.x publishes them unprefixed, later versions with trtllm_
    waiting=("trtllm_num_requests_waiting", "num_requests_waiting"),
    running=("trtllm_num_requests_running", "num_requests_running"),
    kv_usage=("trtllm_kv_cache_utilization", "kv_cache_utilization"),
)
PRESETS = {"vllm": VLLM, "sglang": SGLANG, "trtllm": TRTLLM, "kvgate": VLLM}  # our engine exports vLLM's
AUTO_ORDER = ("vllm", "sglang", "trtllm")


@dataclass(frozen=True)
class Reading:
    preset: str
    waiting: int
    running: int
    kv_cache_usage: float


def parse(text: str, preset: str) -> Reading | None:
    """The reading in a /metrics page, or None when it has none of the preset's names.

    `preset` "auto" tries each engine's names in turn.
    """
    presets = AUTO_ORDER if preset == "auto" else (preset,)
    wanted = {name for p in presets for name in PRESETS[p].all}
    values = _samples(_only_lines_of(text, wanted), wanted)
    for p in presets:
        reading = _reading(p, PRESETS[p], values)
        if reading is not None:
            return reading
    return None


LORA_INFO = "vllm:lora_requests_info"


@dataclass(frozen=True)
class LoRAInfo:
    """vLLM's vllm:lora_requests_info: its newest series (the value is when it was set)."""

    max_loras: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]


def lora_info(text: str) -> LoRAInfo | None:
    """The newest vllm:lora_requests_info series of a /metrics page; None without one."""
    lines = "\n".join(line for line in text.splitlines() if line.startswith(LORA_INFO + "{")) + "\n"
    samples = [s for family in text_string_to_metric_families(lines) for s in family.samples]
    if not samples:
        return None
    newest = max(samples, key=lambda s: s.value).labels
    try:
        max_loras = int(newest.get("max_lora", "0"))
    except ValueError:
        max_loras = 0
    return LoRAInfo(max_loras, _names(newest.get("running_lora_adapters", "")),
                    _names(newest.get("waiting_lora_adapters", "")))


def _names(joined: str) -> tuple[str, ...]:
    return tuple(n for n in joined.split(",") if n)


def _only_lines_of(text: str, wanted: set[str]) -> str:
    """The sample lines of the wanted metrics only.

    A vLLM page is mostly histograms; parsing all of it in pure Python every poll would take the
    event loop away from requests for milliseconds. Without their # TYPE lines the samples parse
    as untyped metrics named exactly as written, which is all we read.
    """
    keep = []
    for line in text.splitlines():
        if line and line[0] != "#":
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                keep.append(line)
    return "\n".join(keep) + "\n"


def _samples(text: str, wanted: set[str]) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                values.setdefault(sample.name, []).append(sample.value)
    return values


def _reading(preset: str, names: Names, values: dict[str, list[float]]) -> Reading | None:
    waiting = _first(names.waiting, values)
    running = _first(names.running, values)
    usage = _first(names.kv_usage, values)
    if waiting is None and running is None and usage is None:
        return None
    return Reading(
        preset=preset,
        waiting=int(sum(waiting or ())),
        running=int(sum(running or ())),
        kv_cache_usage=_fraction(max(usage or (0.0,))),
    )


def _first(names: tuple[str, ...], values: dict[str, list[float]]) -> list[float] | None:
    for name in names:
        if name in values:
            return values[name]
    return None


def _fraction(value: float) -> float:
    # Every engine above reports 0..1 (vLLM's "_perc" too); accept a percentage all the same.
    if value > 1.0:
        value /= 100.0
    return min(1.0, max(0.0, value))
