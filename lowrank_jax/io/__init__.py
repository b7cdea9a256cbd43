"""Adapter import/export in the HuggingFace PEFT format (safetensors + adapter_config.json)."""

from lowrank_jax.io.peft import (
    export_peft,
    hf_module_name,
    import_peft,
    our_module_path,
)

__all__ = ["export_peft", "hf_module_name", "import_peft", "our_module_path"]
