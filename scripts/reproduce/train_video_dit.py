"""Train the small video DiT on procedural sprite videos (CPU, minutes) and save it.

    python scripts/reproduce/train_video_dit.py [--quick] [--steps N] [--out runs/video_dit]

Writes ``<out>/config.json``, ``<out>/params.npz`` and ``<out>/losses.json``; the Video-SVD
sweep (``scripts/reproduce/video_svd.py --checkpoint <out>``) loads it.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from lowrank_jax.data.video import procedural_videos
from lowrank_jax.models.video_dit import (
    VideoDiTConfig,
    load_video_dit,
    save_video_dit,
    train_video_dit,
)


def build_config() -> VideoDiTConfig:
    """The model every Video-SVD number is measured on: 8×16×16 RGB clips, 128 tokens."""
    return VideoDiTConfig(frames=8, height=16, width=16, patch=(1, 4, 4), dim=64, heads=2,
                          layers=2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="60 steps (a smoke run)")
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join("runs", "video_dit"))
    parser.add_argument("--resume", default=None, help="continue training a saved model")
    args = parser.parse_args(argv)
    steps = 60 if args.quick else args.steps
    model = load_video_dit(args.resume) if args.resume else None
    config = model.config if model is not None else build_config()

    def data(key, batch):
        return procedural_videos(key, batch, frames=config.frames, size=config.height)

    start = time.time()
    model, losses = train_video_dit(config, data, steps=steps, batch=args.batch,
                                    learning_rate=args.lr, seed=args.seed, log_every=50,
                                    model=model)
    seconds = time.time() - start
    save_video_dit(args.out, model)
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump({"steps": steps, "batch": args.batch, "seconds": seconds, "resumed_from":
                   args.resume, "losses": losses}, f)
    print(f"trained {steps} steps in {seconds:.0f}s, final loss "
          f"{sum(losses[-20:]) / min(20, len(losses)):.4f}; saved to {args.out}")


if __name__ == "__main__":
    main()
