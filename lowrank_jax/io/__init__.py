"""Adapter import/export in the HuggingFace PEFT format (safetensors + adapter_config.json)."""

from lowrank_jax.io.peft import (
    export_peft,
    hf_module_name,
    import_peft,
    our_module_path,
)
from lowrank_jax.io.peft_names import Fused, name_mapper

__all__ = ["Fused", "export_peft", "hf_module_name", "import_peft", "name_mapper",
           "our_module_path"]
