"""Run configuration: the Config of its sections (tiertrain.sections, and [model]), read from a TOML file, `--set
section.key=value` overrides or a checkpoint's record, every value checked against its field's type. Every message
raised here is one line that names the key and how to fix it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w

from .errors import ConfigError
from .model.spec import ModelSpec
from .sections import (
    AUTO,
    Auto,
    CheckpointConfig,
    DataConfig,
    HardwareConfig,
    OptimConfig,
    TiersConfig,
    TrainConfig,
    _need,
    _show,
)

SHIPPED = Path(__file__).parent / "configs"
# a released model's settings a fine-tune may change with --set (its positions, and whether its routers' balance is
# trained), as transformers' from_pretrained takes config overrides; its shape comes from its config.json
LIFTED = (
    "max_position_embeddings",
    "rope_scaling",
    "rope_theta",
    "output_router_logits",
    "router_aux_loss_coef",
)


SECTIONS = {
    "model": ModelSpec,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "tiers": TiersConfig,
    "checkpoint": CheckpointConfig,
    "hardware": HardwareConfig,
}


@dataclass
class Config:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    tiers: TiersConfig = field(default_factory=TiersConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    # the `model.*` values --set gave, by key: with train.init_from the LIFTED ones are laid over the imported model
    model_sets: dict = field(default_factory=dict, repr=False, compare=False)

    def validate(self) -> "Config":
        for name in SECTIONS:
            getattr(self, name).validate()
        if not self.train.init_from:  # else [model] stands in for config.json's: checked once it is read
            self.check_model()
        _need(
            not self.train.eval_every or self.data.val_path or self.data.val_fraction,
            "train",
            "eval_every",
            self.train,
            "needs validation data: set data.val_path or data.val_fraction",
        )
        return self

    def check_model(self) -> None:
        """What the model allows of the training: its positions, and qwen's windows."""
        _need(
            self.train.seq_len <= self.model.max_position_embeddings,
            "train",
            "seq_len",
            self.train,
            f"exceeds model.max_position_embeddings ({self.model.max_position_embeddings}); lower "
            f"train.seq_len, or lift the limit with a rope scaling that stretches the positions to it: "
            + position_lift(self.model, self.train.seq_len),
        )
        _need(  # qwen2 and qwen3 place their windows by max_window_layers, which tiertrain does not implement
            self.model.model_type not in ("qwen2", "qwen3")
            or not any(self.model.window(i) for i in range(self.model.num_hidden_layers))
            or self.train.seq_len <= self.model.sliding_window,
            "train",
            "seq_len",
            self.train,
            f"exceeds model.sliding_window ({self.model.sliding_window}), which tiertrain does not "
            f"implement for {self.model.model_type} (it attends to the whole sequence); lower train.seq_len",
        )

    def imported(self, spec: ModelSpec) -> "Config":
        """A copy whose [model] is `spec`, an imported model's (its config.json replaces [model]), with the LIFTED
        values --set gave laid over it, checked."""
        lifted = {k: v for k, v in self.model_sets.items() if k in LIFTED}
        cfg = dataclasses.replace(self, model=dataclasses.replace(spec, **lifted))
        cfg.model.validate()
        cfg.check_model()
        return cfg

    def to_dict(self) -> dict:
        out = {}
        for name in SECTIONS:
            sec = getattr(self, name)
            out[name] = {
                f.name: getattr(sec, f.name)
                for f in dataclasses.fields(sec)
                if not f.name.startswith("_") and getattr(sec, f.name) is not None
            }
        return out

    def to_toml(self) -> str:
        return tomli_w.dumps(self.to_dict())


def position_lift(spec: ModelSpec, n: int) -> str:
    """The `--set` values that let `spec` train sequences of `n` tokens: max_position_embeddings raised to `n`, and
    a rope scaling stretching the positions the model was trained with (its original context, or its whole one
    without a scaling) by the factor that reaches `n`: a yarn model's own yarn with that factor, else llama3's. A
    linear or dynamic scaling stays as it is (transformers' reads the raised positions alike)."""
    rs = dict(spec.rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind in ("linear", "dynamic"):
        return f"--set model.max_position_embeddings={n}"
    if kind not in ("llama3", "yarn"):
        rs = {
            "rope_type": "llama3",
            "factor": 1.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": spec.max_position_embeddings,
        }
    old = rs["original_max_position_embeddings"]
    table = {**rs, "factor": float(max(rs["factor"], math.ceil(n / old)))}
    if kind == "llama3":
        table = {"rope_type": "llama3", **{k: v for k, v in table.items() if k not in ("type", "rope_type")}}
    inline = ", ".join(f"{k} = {_toml_value(v)}" for k, v in table.items())
    return f"--set model.max_position_embeddings={n} --set 'model.rope_scaling={{{inline}}}'"


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f'"{v}"' if isinstance(v, str) else str(v)


PATHS = (
    ("data", "path"),
    ("data", "val_path"),
    ("train", "init_from"),
    ("tiers", "nvme_dir"),
    ("checkpoint", "dir"),
)


def absolute_paths(d: dict) -> dict:
    """A config's dict (Config.to_dict) with its paths absolute: what a checkpoint records, so that a resume from
    another working directory reads the same files."""
    out = {sec: dict(vals) for sec, vals in d.items()}
    for sec, key in PATHS:
        if out.get(sec, {}).get(key):
            out[sec][key] = str(Path(out[sec][key]).absolute())
    return out


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _coerce(section: str, key: str, value: object, hint: object) -> object:
    """Checks a TOML value against a field's type; ints are accepted where floats are expected."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    auto_ok = Auto in args
    if auto_ok:  # int | "auto" and the like
        if value == AUTO:
            return value
        args = [a for a in args if a is not Auto]
    if int in args and list[int] in args:  # a token id or a list of them (eos_token_id)
        if not (_int(value) or isinstance(value, list) and value and all(_int(v) for v in value)):
            raise ConfigError(
                f"{section}.{key} must be an integer or a list of integers (got {_show(value)}); "
                f"fix it in the config file or with --set {section}.{key}=..."
            )
        return value
    if typing.get_origin(hint) in (typing.Union, type(int | None)) and len(args) == 1:
        hint = args[0]
    base = typing.get_origin(hint) or hint
    ok = False
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:  # inf and nan are TOML literals, and no setting means them
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif base is str or base is typing.Literal:  # a Literal's values: validate() names them
        ok = isinstance(value, str)
    elif base is list and typing.get_args(hint) in ((int,), (str,)):  # block numbers, layer types
        kind = typing.get_args(hint)[0]
        ok = isinstance(value, list) and all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
        base = list[kind]
    elif base is list:
        ok = isinstance(value, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value
        )
        value = [float(v) for v in value] if ok else value
    elif base is dict:
        ok = isinstance(value, dict)
    if not ok:
        want = {
            bool: "true or false",
            int: "an integer",
            float: "a finite number",
            str: "a quoted string",
            typing.Literal: "a quoted string",
            list: "a list of finite numbers",
            list[int]: "a list of integers",
            list[str]: "a list of quoted strings",
            dict: "a table like {key = value}",
        }[base]
        if auto_ok:
            want += ' or "auto" (the plan decides)'
        raise ConfigError(
            f"{section}.{key} must be {want} (got {_show(value)}); "
            f"fix it in the config file or with --set {section}.{key}=..."
        )
    return value


def _apply(cfg: Config, data: dict, origin: str) -> None:
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(
                f"unknown section [{section}] in {origin}; known sections: {', '.join(SECTIONS)}"
            )
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] in {origin} must be a table of keys, e.g. {section}.key = value")
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(type(obj))
        known = [f.name for f in dataclasses.fields(obj) if not f.name.startswith("_")]
        for key, value in values.items():
            if (section, key) in RENAMED:  # an older name reads as the new one, in files and --set
                new = RENAMED[(section, key)]
                if new in values:
                    raise ConfigError(
                        f"{section}.{key} in {origin} is the old name of {section}.{new}, which it "
                        f"gives too; keep only {section}.{new}"
                    )
                key = new
            if key not in known:
                raise ConfigError(
                    f"unknown key {section}.{key} in {origin}; known keys of [{section}]: {', '.join(known)}"
                )
            setattr(obj, key, _coerce(section, key, value, hints[key]))


def parse_override(text: str) -> dict:
    """'section.key=value' with the value read as a TOML literal (a bare word is taken as a string)."""
    key, eq, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not eq or not dot or not section or not name:
        raise ConfigError(f"--set {text!r} is not of the form section.key=value, e.g. --set train.steps=50")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return {section: {name: value}}


def resolve_path(path: str | None) -> Path:
    if path is None:
        return SHIPPED / "debug.toml"
    p = Path(path)
    if p.is_file():
        return p
    shipped = SHIPPED / (p.name if p.suffix == ".toml" else p.name + ".toml")
    if p.parent == Path(".") and shipped.is_file():
        return shipped
    names = ", ".join(sorted(f.stem for f in SHIPPED.glob("*.toml")))
    raise ConfigError(
        f"config file {path!r} not found; pass --config an existing TOML file or a shipped name ({names})"
    )


def load_config(path: str | None = None, overrides: list[str] = (), new: bool = True) -> Config:
    """The config file (None: the debug one; a shipped name) with the `--set` overrides; `new`: False for a
    resumed run's (config_from_dict)."""
    src = resolve_path(path)
    try:
        data = tomllib.loads(src.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{src} is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{src} is not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8, as TOML requires"
        ) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {src}: {e.strerror}") from None
    cfg = config_from_dict(data, overrides, str(src), new=new)
    # no [model] to train and none to import: the placeholder's 0.9 M parameters
    if "model" not in data and not cfg.model_sets and not cfg.train.init_from:
        raise ConfigError(
            f"{src} has no [model], and train.init_from is empty: pass --init-from DIR (a Hugging Face model "
            "directory), or a --config with a [model]"
        )
    return cfg


# a checkpoint written before "auto" was the one spelling holds these numbers for "the plan decides"
LEGACY = {
    ("train", "micro_batch_size"): {0: AUTO},
    ("train", "loss_chunk_tokens"): {0: AUTO},
    ("optim", "speculate_units"): {-1: AUTO},
    ("optim", "speculate_gpu_updates"): {-1: AUTO, 0: False, 1: True},
    ("tiers", "gpu_resident_gb"): {-1: AUTO},
    ("tiers", "gpu_update_units"): {-1: AUTO},
}
# keys renamed since: the old name is read as the new one, in config files, --set and checkpoints alike
RENAMED = {("train", "mlp_chunk_tokens"): "tile_tokens", ("tiers", "checkpoint_dtype"): "activation_dtype"}


def config_from_dict(
    data: dict, overrides: list[str] = (), origin: str = "the config", legacy: bool = False, new: bool = True
) -> Config:
    """A config from parsed TOML (or a checkpoint's config), then `--set` overrides. `legacy`: a checkpoint's,
    whose older numbers for "auto" are read as it. `new`: a new run's, which imports train.init_from's model (a
    resumed run keeps its checkpoint's)."""
    cfg = Config()
    if legacy:
        data = {
            sec: {
                k: LEGACY[(sec, k)].get(v, v) if (sec, k) in LEGACY and not isinstance(v, bool) else v
                for k, v in vals.items()
            }
            if isinstance(vals, dict)
            else vals
            for sec, vals in data.items()
        }
    _apply(cfg, data, origin)
    given = [parse_override(o) for o in overrides]
    init_from = next(
        (g["train"]["init_from"] for g in reversed(given) if "init_from" in g.get("train", {})), None
    )
    # a new run importing a model: its config.json gives [model], and the --set model.* values outside LIFTED go
    # unused (the run says so); laid over the placeholder [model] they would be checked against another model
    imports = new and not legacy and (cfg.train.init_from if init_from is None else init_from)
    for g in given:
        sets = g.get("model", {})
        _apply(cfg, {**g, "model": {k: v for k, v in sets.items() if k in LIFTED}} if imports else g, "--set")
        cfg.model_sets.update(sets)
    return cfg.validate()
