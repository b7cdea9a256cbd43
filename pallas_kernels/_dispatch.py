"""What every kernel's ``api.py`` shares: the one meaning of ``implementation=`` / ``interpret=``,
block-size checks, and the guard of inference-only kernels.

``implementation`` (the same in every op):

* ``"xla"`` — the op's pure-jnp ``reference.py`` twin (differentiable by JAX, runs anywhere);
* ``"pallas"`` — the Pallas kernel; without a GPU/TPU it runs in interpret mode;
* ``"auto"`` (default) — the Pallas kernel on GPU/TPU, the XLA reference elsewhere, unless
  ``interpret=True`` asks for the kernel explicitly (CPU tests of the kernel body).

``interpret`` (the same in every op):

* ``None`` (default) — interpret exactly when there is no GPU/TPU backend;
* ``True`` — Pallas interpret mode (any backend; makes ``"auto"`` choose the kernel);
* ``False`` — compile the kernel for the device; an error on a CPU-only backend.
"""

from __future__ import annotations

from typing import Callable

import jax

#: ``implementation=`` values: ``auto`` (Pallas on GPU/TPU, else XLA), ``pallas``, ``xla``.
IMPLEMENTATIONS = ("auto", "pallas", "xla")


def has_accelerator() -> bool:
    """Whether the default backend is a GPU or TPU (a Pallas kernel can be compiled for it)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")


def resolve(implementation: str, interpret: bool | None, *, op: str = "op") -> tuple[str, bool]:
    """``(implementation, interpret)`` resolved to ``("pallas" | "xla", bool)`` (module doc).

    Example::

        >>> resolve("xla", None)
        ('xla', False)
        >>> resolve("auto", True)
        ('pallas', True)
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{op}: implementation={implementation!r} is unknown; use one of {IMPLEMENTATIONS}."
        )
    if interpret not in (None, True, False):
        raise ValueError(f"{op}: interpret={interpret!r} must be None, True or False.")
    accelerator = has_accelerator()
    if implementation == "auto":
        implementation = "pallas" if (accelerator or interpret) else "xla"
    if implementation == "xla":
        return "xla", False
    if interpret is None:
        interpret = not accelerator
    if not interpret and not accelerator:
        raise ValueError(
            f"{op}: interpret=False asks to compile the Pallas kernel, but the backend is "
            f"{jax.default_backend()!r}; pass interpret=True (or None) or implementation='xla'."
        )
    return "pallas", bool(interpret)


def resolve_implementation(implementation: str, interpret: bool | None = None) -> str:
    """Only the implementation half of :func:`resolve`."""
    return resolve(implementation, interpret)[0]


def check_tile(name: str, value, example: str) -> None:
    """Raise a clear ``ValueError`` unless ``value`` is a power of two >= 8 (a tile size every
    backend accepts: Triton needs powers of two, TPU multiples of 8)."""
    if not (isinstance(value, int) and value >= 8 and value & (value - 1) == 0):
        raise ValueError(
            f"BlockSizes.{name}={value!r} must be a power of two >= 8 "
            f"(Triton needs power-of-two tiles, TPU needs multiples of 8); e.g. {example}."
        )


def check_block(op: str, name: str, block: int, dim: int, dim_name: str) -> None:
    """Raise a clear ``ValueError`` unless ``block`` is a positive divisor of ``dim``."""
    if not isinstance(block, int) or block < 1 or dim % block:
        raise ValueError(
            f"{op}: BlockSizes.{name}={block!r} does not tile {dim_name}={dim} (it must divide "
            f"it); pick a divisor of {dim} or pad {dim_name}."
        )


def inference_only(op: str, fn: Callable, *args):
    """``fn(*args)``, raising a clear error if anyone differentiates through it.

    For kernels that define no VJP: ``jax.grad`` then fails at trace time with a message that
    names the op and the differentiable alternative, instead of deep inside ``pallas_call``.
    """

    @jax.custom_vjp
    def call(*xs):
        return fn(*xs)

    def fwd(*xs):
        return fn(*xs), None

    def bwd(_, grads):
        raise ValueError(
            f"{op}: the Pallas kernel is inference-only (it has no VJP); differentiate "
            "implementation='xla' (the jnp reference) instead."
        )

    call.defvjp(fwd, bwd)
    return call(*args)


def next_pow2(value: int) -> int:
    """The smallest power of two ``>= value`` (Triton block sizes must be powers of two)."""
    out = 1
    while out < value:
        out *= 2
    return out
