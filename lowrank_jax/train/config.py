"""Run configuration: YAML presets in ``configs/`` loaded into dataclasses, with checked
overrides."""

from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
import re
from typing import Any

import yaml

from lowrank_jax.models.llama import LlamaConfig
from lowrank_jax.optim.salaad import SalaadConfig

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"
PACKAGED_CONFIG_DIR = pathlib.Path(__file__).resolve().parent / "presets"
BYTE_VOCAB = 256  # pretraining reads the embedded corpus byte by byte
STRUCTURES = ("none", "salaad")  # structure grown during pretraining (see train/structure.py)


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
                    f"(e.g. `optimizer.{key}=0.01`)."
                )
        for key in ("weight_decay", "grad_clip"):
            if getattr(self, key) < 0:
                raise ValueError(f"optimizer.{key}={getattr(self, key)} must be >= 0 "
                                 f"(0 disables it).")
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"optimizer.momentum={self.momentum} must be in [0, 1), e.g. 0.95.")
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
    peak_tflops: float | None = None  # per-device bf16 peak for MFU (default: the chip's)

    def __post_init__(self):
        for key in ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every",
                    "log_every", "eval_batches"):
            value = getattr(self, key)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"train.{key}={value!r} must be a positive integer.")
        if not (isinstance(self.seed, int) and self.seed >= 0):
            raise ValueError(f"train.seed={self.seed!r} must be an integer >= 0, e.g. "
                             "`train.seed=0`.")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"train.peak_tflops={self.peak_tflops} must be > 0 (the device's "
                             "peak in TFLOP/s, e.g. 197 for a TPU v5e), or null.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"train.val_fraction={self.val_fraction} must be in (0, 1), "
                             "e.g. 0.1.")


@dataclasses.dataclass
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for key in ("data", "fsdp", "tensor"):
            value = getattr(self, key)
            if not (isinstance(value, int) and value > 0):
                raise ValueError(f"mesh.{key}={value!r} must be a positive integer.")


@dataclasses.dataclass
class DataConfig:
    """The training text: ``path`` ``None`` is the embedded corpus (the main job); else a file,
    folder or glob of .txt / .jsonl / .parquet / ArrayRecord files read through grain
    (:mod:`lowrank_jax.train.text_data`), tokenized by ``tokenizer`` (``byte``, ``smollm2``, a
    .gguf, a tokenizer.json or a model folder); ``text_field`` names the JSON field / column."""

    path: str | None = None
    tokenizer: str = "byte"
    text_field: str = "text"

    def __post_init__(self):
        if self.path is not None and not str(self.path).strip():
            raise ValueError("data.path is empty; give a file, folder or glob (`data`), or "
                             "leave it out for the embedded corpus.")
        for key in ("tokenizer", "text_field"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key).strip():
                raise ValueError(f"data.{key}={getattr(self, key)!r} must be a non-empty name.")


@dataclasses.dataclass
class RunConfig:
    model: LlamaConfig = dataclasses.field(default_factory=LlamaConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    salaad: SalaadConfig = dataclasses.field(default_factory=SalaadConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    run_dir: str = "runs/tiny"
    name: str = "tiny"
    structure: str = "none"  # "salaad": couple every 2-D weight to L + S (section salaad:)
    topology: str | None = None  # the hardware the mesh is laid out for (compile's --topology)

    def __post_init__(self):
        if not isinstance(self.run_dir, str) or not self.run_dir.strip():
            raise ValueError(f"run_dir={self.run_dir!r} must name a folder, e.g. "
                             "`run_dir=runs/my_run`.")
        if self.model.n_layers < 1:
            raise ValueError(f"model.n_layers={self.model.n_layers} must be a positive integer "
                             "(a model needs at least one layer).")
        bytewise = self.data.path is None or self.data.tokenizer == "byte"
        if bytewise and self.model.vocab_size < BYTE_VOCAB:
            raise ValueError(
                f"model.vocab_size={self.model.vocab_size} is too small for the byte-level "
                f"corpus (token ids 0..{BYTE_VOCAB - 1}); use `model.vocab_size="
                f"{BYTE_VOCAB}`.")
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}; lower one or raise the other."
            )
        if self.structure not in STRUCTURES:
            raise ValueError(f"structure={self.structure!r} is unknown; use "
                             f"{' or '.join(STRUCTURES)} (e.g. `structure=salaad`).")
        if self.structure == "salaad" and self.model.projection != "dense":
            raise ValueError(
                f"structure=salaad needs model.projection=dense (SALAAD grows its own low-rank "
                f"+ sparse structure on dense weights), got {self.model.projection!r}; add "
                "`model.projection=dense`.")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SECTIONS = {"model": LlamaConfig, "optimizer": OptimizerConfig, "train": TrainConfig,
             "mesh": MeshConfig, "salaad": SalaadConfig, "data": DataConfig}


def _did_you_mean(key: str, options) -> str:
    close = difflib.get_close_matches(key, list(options), n=1)
    return (f" Did you mean {close[0]!r}?" if close
            else f" Known keys: {', '.join(sorted(options))}.")


def _field_types(cls) -> dict[str, Any]:
    return {f.name: f.type for f in dataclasses.fields(cls)}


def _coerce(value: str, key: str = "value"):
    """Parse an override value the way YAML would (numbers, booleans, null, strings)."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"`{key}={value}`: the value is not valid YAML ({problem}); "
                         "quote it, e.g. `name=\"my run\"`.") from None


_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def _as_type(name: str, value, annotation: str):
    """``value`` read as the declared type ``annotation`` (YAML 1.2 numbers: ``1e-3`` is a
    float), or a ValueError naming ``name``."""
    kinds = {part.strip() for part in str(annotation).split("|")}
    if value is None and "None" in kinds:
        return None
    if isinstance(value, str) and kinds & {"float", "int"} and _FLOAT.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads 1e-3 as a string; YAML 1.2 as a number
    if "int" in kinds and isinstance(value, float) and value.is_integer() and "float" not in kinds:
        value = int(value)
    if "float" in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{name}={value} must be a finite number.")
        return value  # an int is a valid float (and keeps its spelling in messages)
    if "int" in kinds and isinstance(value, int) and not isinstance(value, bool):
        return value
    if "bool" in kinds and isinstance(value, bool):
        return value
    if "str" in kinds and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if "tuple[str, ...]" in kinds and isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    wanted = {"int": "an integer", "float": "a number", "bool": "true or false",
              "str": "a string"}
    described = " or ".join(wanted.get(k, k) for k in sorted(kinds) if k != "None")
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{name} is empty; give {described} (e.g. `{name}=...`).")
    raise ValueError(f"{name}={value!r} must be {described}.")


def _build(section: str, cls, values: dict):
    known = _field_types(cls)
    kwargs = {}
    for sub, value in values.items():
        if sub not in known:
            raise ValueError(f"Unknown config key '{section}.{sub}'.{_did_you_mean(sub, known)}")
        kwargs[sub] = _as_type(f"{section}.{sub}", value, known[sub])
    try:
        return cls(**kwargs)
    except ValueError as error:
        message = str(error)
        if message.startswith(cls.__name__ + "."):  # "SalaadConfig.rho=..." -> "salaad.rho=..."
            message = message[len(cls.__name__) + 1:]
        first = message.split("=", 1)[0]
        if first in known:  # LlamaConfig speaks of its own fields: name them as config keys
            message = f"{section}.{message}"
        raise ValueError(message) from None


def from_dict(raw: dict) -> RunConfig:
    """Build a :class:`RunConfig`, rejecting unknown keys with a did-you-mean and reading every
    value as its field's declared type (YAML 1.2 numbers), validated."""
    raw = dict(raw or {})
    top = _field_types(RunConfig)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in top:
            raise ValueError(f"Unknown config key {key!r}.{_did_you_mean(key, top)}")
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"Config section {key!r} must be a mapping (key: value lines), "
                                 f"got {value!r}.")
            kwargs[key] = _build(key, _SECTIONS[key], value)
        else:
            kwargs[key] = _as_type(key, value, top[key])
    return RunConfig(**kwargs)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``section.key=value`` strings (``--set``) to a raw config dict."""
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in (raw or {}).items()}
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"`{item}`: expected key=value, e.g. `train.steps=100`.")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        if len(parts) == 1:
            raw[parts[0]] = _coerce(value, key)
        elif len(parts) == 2:
            section, sub = parts
            if section not in _SECTIONS:
                top = {f.name for f in dataclasses.fields(RunConfig)}
                raise ValueError(f"Unknown config key {key!r}.{_did_you_mean(section, top)}")
            raw.setdefault(section, {})
            if not isinstance(raw[section], dict):
                raise ValueError(f"Config section {section!r} must be a mapping, got "
                                 f"{raw[section]!r}.")
            raw[section] = dict(raw[section])
            raw[section][sub] = _coerce(value, key)
        else:
            raise ValueError(f"`{item}`: keys have at most one dot (section.key).")
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
    path = find_config(path_or_name)
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except UnicodeDecodeError as error:
        raise ValueError(f"config={path}: not UTF-8 text (byte {error.object[error.start]:#x} "
                         f"at offset {error.start}); save the file as UTF-8.") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"config={path}: invalid YAML{where} ({problem}); fix the file "
                         "(see configs/tiny.yaml for the layout).") from None
    if not isinstance(raw, dict):
        raise ValueError(f"config={path}: expected a mapping of sections (model:, optimizer:, "
                         f"train:, run_dir:), got a {type(raw).__name__}.")
    return from_dict(apply_overrides(raw, overrides or []))
