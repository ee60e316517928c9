"""Adapters in RAM and in slots, and the additive path beside every target linear.

    max_cpu_loras   adapters kept in RAM (LRU; the least recently used idle one is dropped, and
                    read again from its directory when a step needs it)
    max_loras       slots: adapters that may run in one step; a request whose adapter has no free
                    slot waits (the scheduler asks `can_schedule`)
    per step        `with manager.step(chunks, token_counts)`: each token's slot index (-1: base)

Each target linear gets a forward hook: y[s:e] += (x[s:e] @ A.T) @ (scale*B).T for each run of
consecutive token rows on one adapter (vLLM's SGMV idea: one product pair per segment rather than
a per-token gather of A and B, which costs rows * r * in memory). The base linear is untouched,
so every linear method (dense, C kernel, int4) keeps its own path; a step with adapter rows runs
the layer-by-layer forward (the fused C decode does not know the hooks).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
import torch

from native_backend.config.engine import LoRAOptions
from native_backend.model.lora.adapter import TARGET_MODULES, LoRAAdapter, LoRAError, load_adapter


class LoRAManager:
    def __init__(self, model: torch.nn.Module, options: LoRAOptions):
        if model.ctx.shard.size > 1:
            raise ValueError("lora: LoRA adapters under tensor parallelism are not supported yet")
        self.model, self.options = model, options
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # in RAM: LRU, most recent last
        self.paths: dict[str, str] = {}  # every adapter served, name -> directory (max_cpu_loras of them in RAM)
        self.slots: list[str | None] = [None] * options.max_loras
        self._device_weights: list[dict | None] = [None] * options.max_loras  # slot -> (layer, module) -> (A, B)
        self._segments: list[tuple[int, int, int]] = []  # this step: (slot, first token row, end row)
        self._hooks = [self._hook(i, module, linear) for i, module, linear in self._targets()]
        self.device = next(model.parameters()).device

    # ------------------------------------------------------------------ adapters

    @classmethod
    def build(cls, model: torch.nn.Module, options: LoRAOptions) -> LoRAManager:
        """A manager with `options.lora_modules` loaded (a bad one fails the start, by name)."""
        manager = cls(model, options)
        for name, path in options.lora_modules.items():
            manager.add(name, path)
        return manager

    def add(self, name: str, path: str, in_use: frozenset | set = frozenset()) -> LoRAAdapter:
        """Load (or reload) an adapter into RAM and serve it by name; LoRAError names what is wrong,
        nothing changes then. To make room, an adapter no unfinished request uses (`in_use`) is
        dropped first, else any not in a slot: a step reads a dropped one again (`_place`)."""
        adapter = load_adapter(name, path, self.model, self.options.max_lora_rank)
        if name in set(self.slots) | set(in_use):
            raise LoRAError(f"LoRA adapter '{name}' is in use and cannot be replaced now")
        self.adapters.pop(name, None)
        self._make_room(set(in_use))
        self.adapters[name] = adapter
        self.paths[name] = path
        return adapter

    def _make_room(self, in_use: set) -> None:
        while len(self.adapters) >= self.options.cpu_loras:
            idle = [n for n in self.adapters if n not in self.slots]
            if not idle:
                raise LoRAError(f"all {self.options.cpu_loras} max_cpu_loras adapters are in the running batch")
            del self.adapters[next((n for n in idle if n not in in_use), idle[0])]

    def remove(self, name: str) -> None:
        """Stop serving an adapter. The caller checks that no unfinished request uses it; the slot
        it may still hold since its last step is freed."""
        if self.paths.pop(name, None) is None:
            raise LoRAError(f"LoRA adapter '{name}' is not loaded")
        self.adapters.pop(name, None)
        if name in self.slots:
            slot = self.slots.index(name)
            self.slots[slot], self._device_weights[slot] = None, None

    def can_schedule(self, name: str | None, running: set[str]) -> bool:
        """Whether a request for `name` may run beside requests for the adapters in `running`."""
        return name is None or name in running or len(running - {None}) < self.options.max_loras

    # ------------------------------------------------------------------ one step

    @contextmanager
    def step(self, names: list[str | None], token_counts: list[int]):
        """Chunks' adapter names and token counts, in batch order; the hooks see each adapter's rows."""
        segments = self._place(names, token_counts)
        fused, self._segments = self.model.fused_decode, segments
        if segments:
            self.model.fused_decode = None  # the fused C decode runs no hooks
        try:
            yield
        finally:
            self._segments, self.model.fused_decode = [], fused

    def _place(self, names, token_counts) -> list[tuple[int, int, int]]:
        wanted = {n for n in names if n is not None}
        if len(wanted) > len(self.slots):
            raise ValueError(f"lora: {len(wanted)} adapters in one step, max_loras is {len(self.slots)}")
        for i, held in enumerate(self.slots):  # free the slots nobody in this step uses
            if held is not None and held not in wanted:
                self.slots[i], self._device_weights[i] = None, None
        for name in wanted - set(self.slots):
            adapter = self.adapters.get(name) or self._read_again(name)
            slot = self.slots.index(None)
            self.slots[slot] = name
            self._device_weights[slot] = {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in
                                          adapter.weights.items()}
        for name in wanted:
            self.adapters.move_to_end(name)
        return _runs([None if n is None else self.slots.index(n) for n in names], token_counts)

    def _read_again(self, name: str) -> LoRAAdapter:
        """An adapter dropped from RAM for room while a request for it waited."""
        if name not in self.paths:
            raise LoRAError(f"LoRA adapter '{name}' is not loaded")
        self._make_room(set())
        self.adapters[name] = load_adapter(name, self.paths[name], self.model, self.options.max_lora_rank)
        return self.adapters[name]

    # ------------------------------------------------------------------ the additive path

    def _targets(self):
        for i, layer in enumerate(self.model.model.layers):
            for module, parent in TARGET_MODULES.items():
                yield i, module, getattr(getattr(layer, parent), module)

    def _hook(self, layer: int, module: str, linear: torch.nn.Module):
        key = (layer, module)

        def add_lora(_mod, inputs, output):
            if not self._segments:
                return output
            x = inputs[0]  # (num_tokens, in); output (num_tokens, out)
            for slot, start, end in self._segments:
                ab = self._device_weights[slot].get(key)
                if ab is not None:
                    a, b = ab
                    output[start:end].addmm_(x[start:end] @ a.t(), b.t())
            return output

        return linear.register_forward_hook(add_lora)


def _runs(slots: list[int | None], token_counts: list[int]) -> list[tuple[int, int, int]]:
    """(slot, start, end) for each run of consecutive token rows on one adapter (chunks in batch
    order; neighbours on the same adapter merged). Rows as slices, not index lists: a slice's
    in-place addmm stays on the calling thread, where index_add_ / index_select went through
    torch's parallel loops and cost ms per call in a loaded engine process (bench/lora.py)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for slot, n in zip(slots, token_counts):
        if slot is not None and n:
            if runs and runs[-1][0] == slot and runs[-1][2] == start:
                runs[-1] = (slot, runs[-1][1], start + n)
            else:
                runs.append((slot, start, start + n))
        start += n
    return runs
