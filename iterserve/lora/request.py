"""A request's LoRA adapter, as vLLM names one: ``LoRARequest(lora_name, lora_int_id, lora_path)``."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """One adapter: ``lora_int_id`` (>= 1) is its identity in the engine (its loaded weights, its prefix-cache
    blocks); ``lora_path`` the PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``) it loads from
    on first use. It travels with the request to the engine core (msgspec, like the request itself)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of ``lora_int_id``."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
