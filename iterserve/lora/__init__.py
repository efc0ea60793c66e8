"""Multi-LoRA: PEFT adapters of the base model, many served in one batch (:mod:`.request` names one,
:mod:`.adapter` loads it onto the fused layers, :mod:`.manager` keeps the loaded ones, :mod:`.batch`
adds each adapter's low-rank product to its own rows of a step)."""

from iterserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
