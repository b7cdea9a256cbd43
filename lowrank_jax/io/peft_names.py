"""Name maps: the module paths of a JAX model -> the module names of the matching HF model.

PEFT finds an adapter's modules by their HF names (``model.layers.3.self_attn.q_proj``), so
:func:`~lowrank_jax.io.export_peft` writes every key, ``target_modules`` entry and
``rank_pattern`` / ``alpha_pattern`` key under the mapped name, and
:func:`~lowrank_jax.io.import_peft` reads them back through the same map.

A name map is a list of ``(regex, target)`` entries; the first regex that ``re.fullmatch``\\ es
the ``/`` path wins and ``target`` is expanded with ``re.sub``. A target is

- a template string: one HF module (``r"model.layers.\\1.self_attn.q_proj"``);
- a :class:`Fused` without ``part``: the whole of a fused HF module (Phi-3's ``qkv_proj``), for a
  kernel that is itself fused (gemma's ``qkv_einsum``);
- a :class:`Fused` with ``part``: this kernel is one block of rows of a fused HF module (our
  ``q_proj`` is the ``q`` rows of Phi-3's ``qkv_proj``);
- a tuple of the above: the kernel is stacked on its leading free axis (gemma's ``kv_einsum``
  ``'BSD,CKDH->CBSKH'`` stacks k and v on ``C``) and each slice is its own HF module.

Built-in maps (``name_map=``): ``"llama"``, ``"qwen"``, ``"mistral"``, ``"gemma"`` and ``"hf"``
map the spellings of HF (``q_proj``), tunix (``q_proj``, ``q_einsum``, ``kv_einsum``,
``qkv_einsum``, ``attn_vec_einsum``), gemma (``gating_einsum``, ``linear``) and MaxText
(``query``, ``key``, ``value``, ``out``, ``wi_0``, ``wi_1``, ``wo``) onto HF's decoder names;
``"phi3"`` maps the same spellings onto Phi-3's fused ``qkv_proj`` / ``gate_up_proj``.

Example::

    >>> targets("layers/0/attn/kv_einsum", "gemma")
    (Target(name='model.layers.0.self_attn.k_proj', part=None, parts=()), \
Target(name='model.layers.0.self_attn.v_proj', part=None, parts=()))
    >>> targets("layers/0/attn/k_proj", "phi3")[0].part
    1
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class Fused:
    """A HF module that stacks several projections on its output rows (Phi-3's ``qkv_proj``).

    Args:
        template: the HF module name (an ``re.sub`` template).
        part: which block of rows this kernel is (a template such as ``r"\\2"`` or a literal
            ``"k"``); ``None`` when the kernel is the whole fused module.
        parts: the blocks in row order, e.g. ``("q", "k", "v")``.
    """

    template: str
    part: str | None = None
    parts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Target:
    """Where (part of) an adapter goes: HF module ``name``; for a block of a fused module its
    index ``part`` among ``parts``; ``part=None`` with ``parts`` set: the whole fused module."""

    name: str
    part: int | None = None
    parts: tuple[str, ...] = ()


_ATTN = r"(?:.*/)?layers/(\d+)/(?:self_attn|attn|attention|self_attention)/"
_MLP = r"(?:.*/)?layers/(\d+)/(?:mlp|feed_forward|ffn|ffw)/"
#: the JAX ecosystem's spellings of each role (HF / tunix, gemma, MaxText)
ATTENTION_SPELLINGS = {
    ("q",): ("q_proj", "query", "q_einsum"),
    ("k",): ("k_proj", "key", "k_einsum"),
    ("v",): ("v_proj", "value", "v_einsum"),
    ("o",): ("o_proj", "out", "o", "attn_vec_einsum"),
    ("k", "v"): ("kv_einsum",),
    ("q", "k", "v"): ("qkv_einsum",),
}
MLP_SPELLINGS = {
    ("gate",): ("gate_proj", "wi_0"),
    ("up",): ("up_proj", "wi_1"),
    ("down",): ("down_proj", "wo", "linear"),
    ("gate", "up"): ("gating_einsum",),
}


def _entries(attention, mlp) -> tuple:
    out = []
    for prefix, spellings, target in ((_ATTN, ATTENTION_SPELLINGS, attention),
                                      (_MLP, MLP_SPELLINGS, mlp)):
        for roles, names in spellings.items():
            out.append((prefix + "(?:" + "|".join(names) + ")", target(roles)))
    out.append((_MLP + "(?:router|gate)", r"model.layers.\1.mlp.gate"))  # an MoE router
    out.append((r"(?:.*/)?lm_head", "lm_head"))
    return tuple(out)


def _decoder(kind):
    def target(roles):
        names = tuple(rf"model.layers.\1.{kind}.{r}_proj" for r in roles)
        return names[0] if len(names) == 1 else names
    return target


def _phi3(kind, fused, parts):
    plain = _decoder(kind)

    def target(roles):
        if not set(roles) <= set(parts):
            return plain(roles)
        name = rf"model.layers.\1.{kind}.{fused}"
        if roles == parts:
            return Fused(name, None, parts)
        blocks = tuple(Fused(name, r, parts) for r in roles)
        return blocks[0] if len(blocks) == 1 else blocks
    return target


#: HF decoder naming (Llama, Mistral, Qwen2/3, Gemma 1/2/3) from the JAX ecosystem's names
HF_DECODER_MAP = _entries(_decoder("self_attn"), _decoder("mlp"))
#: Phi-3: q/k/v are row blocks of ``qkv_proj``, gate/up of ``gate_up_proj``
PHI3_MAP = _entries(_phi3("self_attn", "qkv_proj", ("q", "k", "v")),
                    _phi3("mlp", "gate_up_proj", ("gate", "up")))
#: built-in name maps for ``name_map=``; ``"lowrank_jax"`` (the default) is our Llama's
NAME_MAPS = {"llama": HF_DECODER_MAP, "qwen": HF_DECODER_MAP, "gemma": HF_DECODER_MAP,
             "mistral": HF_DECODER_MAP, "hf": HF_DECODER_MAP, "phi3": PHI3_MAP}


def hf_module_name(path: str) -> str:
    """Our module path → the module name in HF ``LlamaForCausalLM``.

    ``layers/3/self_attn/q_proj`` → ``model.layers.3.self_attn.q_proj``; ``lm_head`` stays.

    Example::

        >>> hf_module_name("layers/0/mlp/up_proj")
        'model.layers.0.mlp.up_proj'
    """
    dotted = path.replace("/", ".")
    return dotted if dotted == "lm_head" else "model." + dotted


def our_module_path(hf_name: str) -> str:
    """Inverse of :func:`hf_module_name`: ``model.layers.3.mlp.up_proj`` → ``layers/3/mlp/up_proj``.

    Example::

        >>> our_module_path("model.layers.2.self_attn.v_proj")
        'layers/2/self_attn/v_proj'
    """
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    return name.replace(".", "/")


def _expand(pattern: str, path: str, target):
    if isinstance(target, str):
        return re.sub(pattern, target, path)
    if isinstance(target, Fused):
        part = None if target.part is None else re.sub(pattern, target.part, path)
        return Fused(re.sub(pattern, target.template, path), part, target.parts)
    if isinstance(target, (tuple, list)):
        return tuple(_expand(pattern, path, t) for t in target)
    raise ValueError(f"PEFT name map: target {target!r} for {path!r} must be a template "
                     "string, a lowrank_jax.io.peft_names.Fused or a tuple of them.")


def name_mapper(name_map=None):
    """``path -> target`` for ``name_map`` (see the module docstring for targets).

    ``name_map`` is ``None`` / ``"lowrank_jax"`` (our Llama: :func:`hf_module_name`), a key of
    :data:`NAME_MAPS`, a function ``path -> target``, or a ``{regex: target}`` mapping /
    ``[(regex, target)]`` list. A path no entry maps is a ``ValueError`` naming it.

    Example::

        >>> name_mapper("llama")("layers/2/attn/q_proj")
        'model.layers.2.self_attn.q_proj'
        >>> name_mapper("gemma")("layers/1/attn/attn_vec_einsum")
        'model.layers.1.self_attn.o_proj'
        >>> name_mapper({r"blocks/(\\d+)/fc1": r"h.\\1.mlp.c_fc"})("blocks/0/fc1")
        'h.0.mlp.c_fc'
    """
    if name_map is None or name_map == "lowrank_jax":
        return hf_module_name
    if callable(name_map):
        return name_map
    if isinstance(name_map, str):
        if name_map not in NAME_MAPS:
            raise ValueError(f"name_map={name_map!r} is unknown; use one of "
                             f"{', '.join(['lowrank_jax', *NAME_MAPS])}, a function or a "
                             "{regex: template} mapping.")
        name_map = NAME_MAPS[name_map]
    entries = list(name_map.items()) if isinstance(name_map, Mapping) else list(name_map)

    def mapped(path: str):
        for pattern, target in entries:
            if re.fullmatch(pattern, path):
                return _expand(pattern, path, target)
        raise ValueError(
            f"PEFT name map: no entry maps the module path {path!r} to a HF module name; add "
            "one ({regex: template}) or pass name_map=a function path -> HF name.")
    return mapped


def _target(value: Any, path: str) -> Target:
    if isinstance(value, Target):
        return value
    if isinstance(value, str):
        return Target(value)
    if isinstance(value, Fused):
        if value.part is None:  # the whole fused module
            return Target(value.template, None, tuple(value.parts) or ("fused",))
        if value.part not in value.parts:
            raise ValueError(f"PEFT name map: {path!r} maps to part {value.part!r} of "
                             f"{value.template!r}, which has parts {value.parts}.")
        return Target(value.template, value.parts.index(value.part), tuple(value.parts))
    raise ValueError(f"PEFT name map: {path!r} maps to {value!r}; expected a HF module name, a "
                     "Fused(...) or a tuple of them.")


def targets(path: str, name_map: Any = None) -> tuple[Target, ...]:
    """The :class:`Target`\\ s of ``path`` under ``name_map`` (a function from
    :func:`name_mapper` or anything it takes): one, or one per slice of a stacked kernel."""
    mapper = name_map if callable(name_map) else name_mapper(name_map)
    value = mapper(path)
    values = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(_target(v, path) for v in values)


__all__ = ["ATTENTION_SPELLINGS", "Fused", "HF_DECODER_MAP", "MLP_SPELLINGS", "NAME_MAPS",
           "PHI3_MAP", "Target", "hf_module_name", "name_mapper", "our_module_path", "targets"]
