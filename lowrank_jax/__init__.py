"""lowrank_jax: low-rank methods for LLMs as composable JAX / Flax NNX / optax pieces.

The names a new user needs first are importable from here; each is loaded on first use (PEP 562),
so ``import lowrank_jax`` stays cheap. Everything else lives in its subpackage
(``lowrank_jax.nn``, ``lowrank_jax.optim``, ...).

Example::

    >>> import lowrank_jax
    >>> lowrank_jax.apply_lora is __import__("lowrank_jax.nn").nn.apply_lora
    True
"""

import importlib

#: The package version (also in pyproject.toml).
__version__ = "0.1.0"

#: public name -> the module that defines it (the face; loaded lazily)
_FACE = {
    "load_model": "lowrank_jax.hub",
    "save_model": "lowrank_jax.hub",
    "apply_lora": "lowrank_jax.nn",
    "merge_adapters": "lowrank_jax.nn",
    "export_peft": "lowrank_jax.io",
    "import_peft": "lowrank_jax.io",
    "spectron": "lowrank_jax.optim",
    "balora": "lowrank_jax.optim",
    "janus": "lowrank_jax.optim",
    "finetune": "lowrank_jax.train.finetune",
    "FinetuneJob": "lowrank_jax.train",
    "quantize_model": "lowrank_jax.quantize",
}

__all__ = ["__version__", *_FACE]


def __getattr__(name: str):
    if name in _FACE:
        value = getattr(importlib.import_module(_FACE[name]), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'lowrank_jax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FACE))
