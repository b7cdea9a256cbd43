"""What every kernel's ``api.py`` shares: the one meaning of ``implementation=`` / ``interpret=``,
the one tiling policy (``BlockSizes``), and the guard of inference-only kernels.

``implementation`` (the same in every op):

* ``"xla"`` — the op's pure-jnp ``reference.py`` twin (differentiable by JAX, runs anywhere);
* ``"pallas"`` — the Pallas kernel; without a GPU/TPU it runs in interpret mode;
* ``"auto"`` (default) — the Pallas kernel on GPU/TPU, the XLA reference elsewhere, unless
  ``interpret=True`` asks for the kernel explicitly (CPU tests of the kernel body).

``interpret`` (the same in every op):

* ``None`` (default) — interpret exactly when there is no GPU/TPU backend;
* ``True`` — Pallas interpret mode (any backend; makes ``"auto"`` choose the kernel);
* ``False`` — compile the kernel for the device; an error on a CPU-only backend.

Tiling (the same in every op): each op's ``api.py`` defines a frozen ``BlockSizes`` dataclass
(a :class:`TileSizes`) that its functions take as ``block_sizes=`` (``None``: the op's defaults).

1. **Validated once**, when the ``BlockSizes`` is built: every tile is a power of two ``>= 8``
   (Triton needs power-of-two tiles, TPU row blocks divisible by 8); a ``ValueError`` names the
   field and a valid value. A field whose default is ``None`` is derived from the shape.
2. **One fit rule** (:func:`fit_tile`), applied by the op to tiles that do not change the result:
   a tile longer than the axis it tiles shrinks to the smallest power of two ``>= 16`` covering
   the axis (a 40-token prompt is not padded to 128); a tile that fits the axis is used as
   given. Padded axes (tokens, sequence rows, output rows) are then padded to a multiple of the
   tile. An axis the kernel cannot pad (a contraction or rank the kernel reads whole) uses
   :func:`fit_dividing_tile`: a tile longer than the axis becomes the axis, a shorter one must
   divide it, else a ``ValueError`` (never a silent other tile).
3. **Tiles that are part of the result** — the blocks a sparsity mask is defined on (subspace
   attention's near mask, SALE's block selection) — are never fitted: another tile would be
   another mask.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

#: ``implementation=`` values: ``auto`` (Pallas on GPU/TPU, else XLA), ``pallas``, ``xla``.
IMPLEMENTATIONS = ("auto", "pallas", "xla")


def target_backend() -> str:
    """The backend the current trace compiles for.

    Under an abstract mesh that names a device (``jax.sharding.use_abstract_mesh`` with an
    ``AbstractDevice``, as :mod:`pallas_kernels.aot` sets when it compiles for a TPU topology or
    lowers for a GPU from a CPU host) its platform; otherwise ``jax.default_backend()``.
    """
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform if platform else jax.default_backend()


def has_accelerator() -> bool:
    """Whether the target backend is a GPU or TPU (a Pallas kernel can be compiled for it)."""
    return target_backend() in ("gpu", "cuda", "rocm", "tpu")


def backend_platform() -> str:
    """The Pallas lowering of the target backend: ``"gpu"`` (Triton), ``"tpu"`` (Mosaic) or
    ``"interpret"`` (no accelerator), the default of every op's ``platform=``."""
    backend = target_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "interpret"


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
            f"{target_backend()!r}; pass interpret=True (or None) or implementation='xla'."
        )
    return "pallas", bool(interpret)


def implementation_of(implementation: str, interpret: bool | None = None) -> str:
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


#: The smallest tile :func:`fit_tile` shrinks to (Triton's smallest ``dot`` operand).
MIN_FITTED_TILE = 16


def fit_tile(block: int, length: int) -> int:
    """The one fit rule for a padded axis: ``block``, or the smallest power of two ``>= 16``
    covering ``length`` when that is shorter (the axis is then padded to a multiple of it).

    Example::

        >>> fit_tile(128, 40), fit_tile(128, 5), fit_tile(128, 1000), fit_tile(8, 5)
        (64, 16, 128, 8)
    """
    return min(block, max(MIN_FITTED_TILE, next_pow2(length)))


def fit_dividing_tile(op: str, name: str, block: int, dim: int, dim_name: str) -> int:
    """The fit rule for an axis the kernel does not pad: ``dim`` itself when ``block >= dim``
    (one block), else ``block``, which must divide ``dim`` (a ``ValueError`` names the field,
    the axis and the fix).

    Example::

        >>> fit_dividing_tile("op", "block_r", 16, 12, "rank"), fit_dividing_tile(
        ...     "op", "block_k", 64, 576, "d_in")
        (12, 64)
    """
    if block >= dim:
        return dim
    check_block(op, name, block, dim, dim_name)
    return block


def dividing_tile(op: str, name: str, cap: int, dim: int, dim_name: str) -> int:
    """A derived tile (a ``BlockSizes`` field left ``None``) for an axis the kernel does not pad:
    the largest power of two ``<= cap`` (``>= 8``) dividing ``dim``, else ``dim`` itself when
    ``dim <= cap`` (one block); a ``ValueError`` when neither (pass the field or pad the axis).

    Example::

        >>> [dividing_tile("op", "block_k", 512, d, "d_in") for d in (576, 24, 20)]
        [64, 8, 20]
    """
    block = cap
    while block >= 8:
        if dim % block == 0:
            return block
        block //= 2
    if dim <= cap:
        return dim
    raise ValueError(
        f"{op}: {dim_name}={dim} has no power-of-two tile <= {cap}; pass "
        f"BlockSizes({name}=...) (a divisor of {dim}) or pad {dim_name} to a multiple of 8."
    )


def count_field(default: int):
    """A ``BlockSizes`` field that is a count (e.g. split-K partitions), not a tile: it is
    checked as a positive int instead of a power of two."""
    return dataclasses.field(default=default, metadata={"count": True})


@dataclasses.dataclass(frozen=True)
class TileSizes:
    """Base of every op's ``BlockSizes`` (a frozen dataclass of tile sizes; module doc).

    ``__post_init__`` checks every field once: a tile is a power of two ``>= 8``
    (:func:`check_tile`), a :func:`count_field` a positive int, and ``None`` is allowed only
    where the default is ``None`` (derived from the shape by the op).

    Example::

        >>> @dataclasses.dataclass(frozen=True)
        ... class BlockSizes(TileSizes):
        ...     block_q: int = 128
        >>> BlockSizes(64).block_q
        64
        >>> BlockSizes(48)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: BlockSizes.block_q=48 must be a power of two >= 8 ...(block_q=32) or 64.
    """

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and field.default is None:
                continue
            if field.metadata.get("count"):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(
                        f"BlockSizes.{field.name}={value!r} must be a positive int; e.g. "
                        f"BlockSizes({field.name}={field.default})."
                    )
                continue
            check_tile(field.name, value, _example(field.name, value, field.default))

    @classmethod
    def get_default(cls):
        """The op's default tiles (``cls()``)."""
        return cls()

    @classmethod
    def check(cls, op: str, block_sizes) -> "TileSizes":
        """``block_sizes``, or the defaults when it is ``None``; a ``ValueError`` naming ``op``
        when it is not this op's ``BlockSizes``."""
        if block_sizes is None:
            return cls()
        if not isinstance(block_sizes, cls):
            raise ValueError(
                f"{op}: block_sizes={block_sizes!r} must be a {cls.__module__}.{cls.__name__} "
                "(each op has its own BlockSizes)."
            )
        return block_sizes


def _example(name: str, value, default) -> str:
    """A valid value near ``value`` for the error message of :func:`check_tile`."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 8:
        below = 1 << (value.bit_length() - 1)
        return f"BlockSizes({name}={below}) or {below * 2}"
    return f"BlockSizes({name}={default if isinstance(default, int) else 16})"


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
