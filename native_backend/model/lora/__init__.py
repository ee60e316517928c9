"""Multi-LoRA: PEFT adapters loaded beside the base linears, mixed per token in one batch (issue 43).

    adapter.py   read and validate one PEFT adapter directory (LoRAError names what is wrong)
    manager.py   max_cpu_loras adapters kept in RAM (LRU), max_loras of them in slots; the
                 per-token slot index of a step; y = base(x) + scale * B(A(x)) as forward hooks
"""

from native_backend.model.lora.adapter import TARGET_MODULES, LoRAAdapter, LoRAError, load_adapter
from native_backend.model.lora.manager import LoRAManager, LoRAOptions

__all__ = ["TARGET_MODULES", "LoRAAdapter", "LoRAError", "LoRAManager", "LoRAOptions", "load_adapter"]
