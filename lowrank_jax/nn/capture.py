"""Capture the inputs and outputs of submodules during an ordinary forward pass.

The one capture mechanism of the package (extension point (c) of the model core): K-FAC
(``curvature.kfac``), quantization calibration (``quant.pipeline``), LoRA initialisation
(``nn.init``) and probes all use it.

How it works (DERIVED): for the duration of :func:`tapped`, each targeted module's class is
swapped for a cached subclass whose ``__call__`` runs the original and then hands
``(path, input, output)`` to the active :class:`Recorder` (set with :func:`recording`). Nothing
else changes: variables, their paths and values stay those of the original module, so
``nnx.split`` inside the context gives a graph that traces under ``jax.jit`` and ``jax.grad``;
outside a :func:`recording` a tapped module behaves exactly like the original. A recorder may
also add a *probe* to a module's output (``y + probe``): the gradient of a loss with respect to
a zero probe is ``∂ℓ/∂y``, which is how K-FAC gets its output gradients.

Example::

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> class Net(nnx.Module):
    ...     def __init__(self):
    ...         self.up = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    ...     def __call__(self, x):
    ...         return self.up(x) * 2
    >>> net = Net()
    >>> with capture(net, ["up"]) as rec:
    ...     _ = net(jnp.ones((5, 3)))
    >>> rec.inputs["up"][0].shape
    (5, 3)
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Mapping, Sequence

from flax import nnx

from lowrank_jax.nn.projection import module_path  # noqa: F401  (one path format)

_PATH_ATTRIBUTE = "capture_path"


class Recorder:
    """Receives ``(path, x, y)`` from every tapped module called while it is active.

    Args:
        keep_inputs: store each call's input under ``inputs[path]`` (a list, one per call).
        keep_outputs: store each call's output under ``outputs[path]``.
        probes: ``{path: array}`` added to the module's output (broadcast, cast to its dtype).
        sink: called as ``sink(path, x, y)`` for every call (e.g. to accumulate ``Σ x xᵀ``
            without keeping the activations).
    """

    def __init__(self, *, keep_inputs: bool = True, keep_outputs: bool = False,
                 probes: Mapping[str, Any] | None = None,
                 sink: Callable[[str, Any, Any], None] | None = None):
        self.keep_inputs, self.keep_outputs = keep_inputs, keep_outputs
        self.probes = dict(probes or {})
        self.sink = sink
        self.inputs: dict[str, list] = {}
        self.outputs: dict[str, list] = {}

    def __call__(self, path: str, x, y):
        if self.sink is not None:
            self.sink(path, x, y)
        if self.keep_inputs:
            self.inputs.setdefault(path, []).append(x)
        if self.keep_outputs:
            self.outputs.setdefault(path, []).append(y)
        if path in self.probes:
            y = y + self.probes[path].astype(y.dtype)
        return y


_ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "lowrank_jax_capture_recorder", default=None)
_TAPPED: dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    if cls in _TAPPED.values():
        return cls
    if cls not in _TAPPED:
        def __call__(self, x, *args, **kwargs):
            y = cls.__call__(self, x, *args, **kwargs)
            recorder = _ACTIVE.get()
            path = getattr(self, _PATH_ATTRIBUTE, None)
            if recorder is None or path is None:
                return y
            return recorder(path, x, y)

        _TAPPED[cls] = type(cls)(f"Tapped{cls.__name__}", (cls,),
                                 {"__call__": __call__, "__module__": __name__})
    return _TAPPED[cls]


def named_modules(model: nnx.Module) -> dict[str, nnx.Module]:
    """``{path: module}`` of every submodule (paths as in :func:`module_path`)."""
    return {module_path(p): m for p, m in nnx.iter_modules(model) if p}


@contextlib.contextmanager
def tapped(model: nnx.Module, paths: Sequence[str]):
    """Make the submodules at ``paths`` report to the active :class:`Recorder` (in place).

    Restored on exit. Raises ``ValueError`` naming the available paths when one is unknown.
    """
    modules = named_modules(model)
    unknown = [p for p in paths if p not in modules]
    if unknown:
        shown = ", ".join(list(modules)[:16]) + (" ..." if len(modules) > 16 else "")
        raise ValueError(f"paths {unknown[:4]} name no submodule of the model; available: "
                         f"{shown or '(none)'}")
    swapped = []
    try:
        for path in paths:
            module = modules[path]
            original = type(module)
            module.__class__ = _tapped_class(original)
            setattr(module, _PATH_ATTRIBUTE, path)
            swapped.append((module, original))
        yield model
    finally:
        for module, original in swapped:
            delattr(module, _PATH_ATTRIBUTE)
            module.__class__ = original


@contextlib.contextmanager
def recording(recorder: Recorder):
    """Make ``recorder`` the one tapped modules report to (inside traced code too)."""
    token = _ACTIVE.set(recorder)
    try:
        yield recorder
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def capture(model: nnx.Module, paths: Sequence[str], **recorder_options):
    """:func:`tapped` and :func:`recording` together; yields the :class:`Recorder`."""
    with tapped(model, paths), recording(Recorder(**recorder_options)) as recorder:
        yield recorder


__all__ = ["Recorder", "capture", "module_path", "named_modules", "recording", "tapped"]
