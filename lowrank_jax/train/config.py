"""Run configuration: YAML presets in ``configs/`` loaded into dataclasses, with checked overrides."""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
from typing import Any

import yaml

from lowrank_jax.models.llama import LlamaConfig

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
PACKAGED_CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "presets"


@dataclasses.dataclass
class OptimizerConfig:
    """``name``: ``spectron`` (factors) + AdamW (the rest), ``adamw`` (every leaf, also factors:
    the "naive" low-rank baseline on a factorized model), or ``sgd``."""

    name: str = "spectron"
    learning_rate: float = 0.02  # Spectron: the ‖ΔW‖₂ budget η; AdamW: the step size
    adamw_learning_rate: float = 3e-3  # for non-factor leaves under Spectron
    weight_decay: float = 0.0
    warmup_fraction: float = 0.05
    schedule: str = "cosine"  # cosine | constant
    grad_clip: float = 1.0  # global-norm clip before the optimizer; 0 disables
    momentum: float = 0.95
    rank: int = 8  # lordo: subspace rank
    sync_every: int = 16  # lordo: steps between projection syncs (single process: M = 1)
    omega: float = 0.9  # lordo: quasi-hyperbolic weight (1 = no full-rank term)

    def __post_init__(self):
        if self.name not in ("spectron", "adamw", "sgd", "lordo"):
            raise ValueError(
                f"optimizer.name={self.name!r} is unknown; use spectron, adamw, sgd or lordo."
            )
        for key in ("learning_rate", "adamw_learning_rate"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(
                    f"optimizer.{key}={value!r} must be a positive number "
                    f"(e.g. --set optimizer.{key}=0.01)."
                )
        if not 0.0 <= self.warmup_fraction < 1.0:
            raise ValueError(f"optimizer.warmup_fraction={self.warmup_fraction} must be in [0, 1).")
        if self.schedule not in ("cosine", "constant"):
            raise ValueError(f"optimizer.schedule={self.schedule!r}: use cosine or constant.")


@dataclasses.dataclass
class TrainConfig:
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    eval_every: int = 200
    eval_batches: int = 8
    checkpoint_every: int = 200
    log_every: int = 10
    val_fraction: float = 0.1

    def __post_init__(self):
        for key in ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every",
                    "log_every", "eval_batches"):
            value = getattr(self, key)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"train.{key}={value!r} must be a positive integer.")


@dataclasses.dataclass
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass
class RunConfig:
    model: LlamaConfig = dataclasses.field(default_factory=LlamaConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    run_dir: str = "runs/tiny"
    name: str = "tiny"

    def __post_init__(self):
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; lower one or raise the other."
            )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {"model": LlamaConfig, "optimizer": OptimizerConfig, "train": TrainConfig,
             "mesh": MeshConfig}


def _did_you_mean(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return f" Did you mean {close[0]!r}?" if close else f" Known keys: {', '.join(sorted(options))}."


def _field_types(cls) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def _coerce(value: str):
    """Parse an override value the way YAML would (numbers, booleans, null, strings)."""
    return yaml.safe_load(value)


def from_dict(raw: dict) -> RunConfig:
    """Build a :class:`RunConfig`, rejecting unknown keys with a did-you-mean."""
    raw = dict(raw or {})
    top = {f.name for f in dataclasses.fields(RunConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in top:
            raise ValueError(f"Unknown config key {key!r}.{_did_you_mean(key, top)}")
        if key in _SECTIONS:
            cls = _SECTIONS[key]
            known = _field_types(cls)
            if not isinstance(value, dict):
                raise ValueError(f"Config section {key!r} must be a mapping, got {value!r}.")
            for sub in value:
                if sub not in known:
                    raise ValueError(
                        f"Unknown config key '{key}.{sub}'.{_did_you_mean(sub, known)}"
                    )
            kwargs[key] = cls(**value)
        else:
            kwargs[key] = value
    return RunConfig(**kwargs)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` strings (``--set``) to a raw config dict."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected key=value, e.g. --set train.steps=100.")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) == 1:
            raw[parts[0]] = _coerce(value)
        elif len(parts) == 2:
            section, sub = parts
            if section not in _SECTIONS:
                top = {f.name for f in dataclasses.fields(RunConfig)}
                raise ValueError(f"Unknown config key {key!r}.{_did_you_mean(section, top)}")
            raw.setdefault(section, {})
            raw[section] = dict(raw[section])
            raw[section][sub] = _coerce(value)
        else:
            raise ValueError(f"--set {item!r}: keys have at most one dot (section.key).")
    return raw


def find_config(path_or_name: str) -> pathlib.Path:
    """A YAML path, or a preset name (``tiny``) looked up in ``configs/``."""
    path = pathlib.Path(path_or_name)
    if path.exists():
        return path
    for folder in (CONFIG_DIR, PACKAGED_CONFIG_DIR):
        candidate = folder / f"{path_or_name}.yaml"
        if candidate.exists():
            return candidate
        candidate = folder / path.name
        if candidate.exists():
            return candidate
    presets = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.exists() else []
    raise FileNotFoundError(f"Config {path_or_name!r} not found; presets: {presets}.")


def load_config(path_or_name: str = "tiny", overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML preset or file, apply ``--set`` overrides, and validate everything."""
    with open(find_config(path_or_name)) as f:
        raw = yaml.safe_load(f) or {}
    return from_dict(apply_overrides(raw, overrides or []))
