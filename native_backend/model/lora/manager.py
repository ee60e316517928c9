"""Adapters in RAM and in slots, and the additive path beside every target linear.

    max_cpu_loras   adapters kept loaded (LRU; the least recently used idle one is dropped)
    max_loras       slots: adapters that may run in one step; a request whose adapter has no free
                    slot waits (the scheduler asks `can_schedule`)
    per step        `with manager.step(chunks, token_counts)`: each token's slot index (-1: base)

Each target linear gets a forward hook: y += (x[rows] @ A.T) @ (scale*B).T for the rows of each
adapter present in the step (vLLM's SGMV idea: one product pair per adapter segment rather than
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
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # LRU, most recent last
        self.slots: list[str | None] = [None] * options.max_loras
        self._device_weights: list[dict | None] = [None] * options.max_loras  # slot -> (layer, module) -> (A, B)
        self._segments: list[tuple[int, torch.Tensor]] = []  # this step: (slot, token rows)
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
        """Load (or reload) an adapter into RAM; LoRAError names what is wrong, nothing changes then.
        `in_use`: adapters of unfinished requests, never dropped to make room."""
        adapter = load_adapter(name, path, self.model, self.options.max_lora_rank)
        busy = set(self.slots) | set(in_use)
        if name in busy:
            raise LoRAError(f"LoRA adapter '{name}' is in use and cannot be replaced now")
        self.adapters.pop(name, None)
        while len(self.adapters) >= self.options.cpu_loras:
            idle = next((n for n in self.adapters if n not in busy), None)
            if idle is None:
                raise LoRAError(f"LoRA adapter '{name}': all {self.options.cpu_loras} max_cpu_loras are in use")
            del self.adapters[idle]
        self.adapters[name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        if name in self.slots:
            raise LoRAError(f"LoRA adapter '{name}' is running and cannot be unloaded now")
        if self.adapters.pop(name, None) is None:
            raise LoRAError(f"LoRA adapter '{name}' is not loaded")

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

    def _place(self, names, token_counts) -> list[tuple[int, torch.Tensor]]:
        wanted = {n for n in names if n is not None}
        if len(wanted) > len(self.slots):
            raise ValueError(f"lora: {len(wanted)} adapters in one step, max_loras is {len(self.slots)}")
        for i, held in enumerate(self.slots):  # free the slots nobody in this step uses
            if held is not None and held not in wanted:
                self.slots[i], self._device_weights[i] = None, None
        for name in wanted - set(self.slots):
            adapter = self.adapters.get(name)
            if adapter is None:
                raise LoRAError(f"LoRA adapter '{name}' is not loaded")
            slot = self.slots.index(None)
            self.slots[slot] = name
            self._device_weights[slot] = {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in
                                          adapter.weights.items()}
        for name in wanted:
            self.adapters.move_to_end(name)
        rows: dict[int, list[int]] = {}
        start = 0
        for name, n in zip(names, token_counts):
            if name is not None:
                rows.setdefault(self.slots.index(name), []).extend(range(start, start + n))
            start += n
        return [(slot, torch.tensor(r, dtype=torch.long, device=self.device)) for slot, r in sorted(rows.items())]

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
            x = inputs[0]
            for slot, rows in self._segments:
                ab = self._device_weights[slot].get(key)
                if ab is not None:
                    a, b = ab
                    output.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
            return output

        return linear.register_forward_hook(add_lora)
