"""A QLoRA adapter trained by lowrank_jax, loaded by HuggingFace PEFT on the dequantized base.

Quantizes SmolLM2-135M (``--quantize nf4|rtn4|unisvq2``, as ``finetune --quantize``), trains a
rank-``r`` LoRA on all 7 projections for ``--steps`` steps through the quantized base, exports the
adapter in PEFT format, writes the *dequantized* base as a HF folder
(:func:`lowrank_jax.nn.merge.dequantize_model` + ``save_model``), then loads both with
``transformers.AutoModelForCausalLM`` + ``peft.PeftModel.from_pretrained`` and compares their
logits on held-out text with ours (the QLoRA forward: codes dequantized on the fly).

Needs torch, transformers and peft next to jax in the running Python (CPU wheels are enough)::

    python -m scripts.reproduce.qlora_hf --quantize nf4 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quantize", default="nf4", choices=("nf4", "rtn4", "unisvq2"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens", type=int, default=128, help="held-out tokens compared")
    p.add_argument("--out", default="runs/qlora_hf")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import transformers
        from peft import PeftModel
    except ImportError as err:
        raise SystemExit(f"this script needs torch, transformers and peft in this Python "
                         f"({err}); pip install torch transformers peft") from err
    import jax.numpy as jnp

    from lowrank_jax.data import corpus_text
    from lowrank_jax.io.peft import export_peft
    from lowrank_jax.hub import load_model, save_model
    from lowrank_jax.nn.merge import dequantize_model
    from lowrank_jax.quantize.qlora_base import quantize_base
    from lowrank_jax.train.finetune import finetune, token_batches

    os.makedirs(args.out, exist_ok=True)
    model, tok = load_model(args.model)
    text = corpus_text()
    cut = int(0.9 * len(text))
    train_ids = np.asarray(tok.encode(text[:cut], add_bos=False), np.int32)
    held = np.asarray(tok.encode(text[cut:], add_bos=False), np.int32)[: args.tokens][None]
    quantize_base(model, args.quantize)
    result = finetune(model, token_batches(train_ids, 4, 64, 0),
                      targets=r"(q|k|v|o|gate|up|down)_proj", rank=args.rank,
                      alpha=2.0 * args.rank, steps=args.steps, lr=args.lr, seed=0,
                      progress=False)
    ours = np.asarray(model(jnp.asarray(held))[0], np.float32)
    adapter_dir, base_dir = os.path.join(args.out, "adapter"), os.path.join(args.out, "base")
    export_peft(model, adapter_dir, base_model_name_or_path=base_dir)
    base, _ = load_model(args.model)
    quantize_base(base, args.quantize)  # deterministic: the same codes the adapter trained on
    dequantize_model(base)
    save_model(base, base_dir, tokenizer=tok)
    del base

    start = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, adapter_dir).eval()
    with torch.no_grad():
        theirs = peft_model(torch.tensor(held, dtype=torch.long)).logits.numpy()
        with peft_model.disable_adapter():
            no_adapter = peft_model(torch.tensor(held, dtype=torch.long)).logits.numpy()
    err = np.abs(ours - theirs)
    report = {
        "model": args.model, "quantize": args.quantize, "steps": args.steps, "rank": args.rank,
        "tokens": int(held.shape[1]), "loss_first": result.losses[0],
        "loss_last": result.losses[-1],
        "max_abs_error": float(err.max()), "mean_abs_error": float(err.mean()),
        "max_rel_error": float(err.max() / np.abs(theirs).max()),
        "argmax_agreement": float(np.mean(ours.argmax(-1) == theirs.argmax(-1))),
        "adapter_effect_max_abs": float(np.abs(theirs - no_adapter).max()),
        "hf_seconds": time.perf_counter() - start,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": __import__("peft").__version__},
    }
    with open(os.path.join(args.out, "hf_check.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
