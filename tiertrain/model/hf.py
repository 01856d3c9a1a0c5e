"""Hugging Face model directories: config.json <-> ModelSpec, safetensors in and out.

Import reads a local directory (config.json and one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) tensor by tensor, so no more than one tensor is ever held beyond its
slab. Export writes what `transformers.AutoModelForCausalLM.from_pretrained` loads: config.json,
shards of at most `shard_bytes` and their index, into a temporary directory renamed when whole.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..errors import UserError
from ..paths import drop_killed_temps, temp_prefix
from . import hf_moe
from .families import ARCHITECTURES, FAMILY_DEFAULTS, WINDOWS, unlike_family
from .hf_read import INDEX, SINGLE, HFError, HFReader, inside, read_json
from .spec import MODEL_TYPES, MOE_TYPES, ModelSpec

if TYPE_CHECKING:
    import torch


def spec_from_hf(model_dir: str | os.PathLike, seq_len: int | None = None) -> ModelSpec:
    """The ModelSpec of a Hugging Face config.json of the Llama family; anything it cannot train exactly
    (another architecture, another activation, biases or sliding windows it does not implement) is refused."""
    d = Path(model_dir)
    c, mt = _config(d)
    window = _implemented(c, d, mt, seq_len)
    theta, scaling = _rope(c, d, mt)
    fam = FAMILY_DEFAULTS[mt]
    need = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [k for k in need if k not in c]
    if missing:
        raise HFError(f"{d}/config.json has no {', '.join(missing)}; it is not a complete {mt} config")
    bad = [k for k in need if isinstance(c[k], bool) or not isinstance(c[k], int) or c[k] <= 0]
    if bad:
        raise HFError(
            f"{d}/config.json: {', '.join(f'{k} = {c[k]!r}' for k in bad)}; each must be a positive integer"
        )
    typed = hf_moe.mistyped(c) if mt in MOE_TYPES else []
    if typed:
        raise HFError(f"{d}/config.json: {'; '.join(typed)}; fix it or re-download the model")
    wrong = f"{d}/config.json has a field of the wrong type ({{}}); fix it or re-download the model"
    try:
        heads = c["num_attention_heads"]
        bias = mt in ("llama", "qwen3") and bool(c.get("attention_bias", False))  # on q, k, v and o
        fields = dict(attention_bias=mt == "qwen2" or bias, attention_out_bias=bias, qk_norm=mt == "qwen3")
        fields.update(hf_moe.spec_fields(c, mt) if mt in MOE_TYPES else {})
        if window is not None and mt in ("qwen2", "qwen3"):  # the blocks that window, for the export
            lim = c.get("max_window_layers", 28)
            n = c["num_hidden_layers"]
            every = ["sliding_attention" if i >= lim else "full_attention" for i in range(n)]
            fields.update(layer_types=list(c.get("layer_types") or every))
        if mt == "mistral" and c.get("layer_types") is not None:  # transformers reads it as Ministral's
            fields.update(layer_types=list(c["layer_types"]))
        spec = ModelSpec(
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=c.get("num_key_value_heads", fam.get("num_key_value_heads")) or heads,
            head_dim=c.get("head_dim") or fam.get("head_dim") or c["hidden_size"] // heads,
            vocab_size=c["vocab_size"],
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(c.get("rms_norm_eps", fam["rms_norm_eps"])),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)) and not _own_head(d),
            max_position_embeddings=c.get("max_position_embeddings", fam["max_position_embeddings"]),
            initializer_range=float(c.get("initializer_range", 0.02)),
            model_type=mt,
            sliding_window=fields.pop("sliding_window", window),
            bos_token_id=c.get("bos_token_id", fam.get("bos_token_id")),
            eos_token_id=c.get("eos_token_id", fam.get("eos_token_id")),
            pad_token_id=c.get("pad_token_id"),
            **fields,
        )
        spec.validate()
    except UserError as e:
        raise HFError(f"{d}/config.json: {e}") from None
    # a number given as a string, a table where a number belongs, an Infinity where an integer does
    except (TypeError, ValueError, OverflowError) as e:
        raise HFError(wrong.format(e)) from None
    return spec


def _own_head(d: Path) -> bool:
    """Whether the weights hold an lm_head.weight other than the embedding: transformers 5 loads such a model
    untied, whatever config.json's tie_word_embeddings says (a rare checkpoint: only then are both read)."""
    if not ((d / INDEX).is_file() or (d / SINGLE).is_file()):
        return False
    r = HFReader(d)
    names = ("lm_head.weight", "model.embed_tokens.weight")
    if not all(n in r.where for n in names):
        return False
    import torch

    head, embed = (r._file(r.where[n]).get_tensor(n) for n in names)
    return head.shape != embed.shape or not torch.equal(head, embed)


def _config(d: Path) -> tuple[dict, str]:
    """(config.json of the model directory `d`, its model_type), refused where it is none tiertrain trains."""
    if not d.is_dir():
        raise HFError(f"--init-from {d}: not a directory; pass a local Hugging Face model directory")
    c = read_json(d / "config.json", "--init-from needs a Hugging Face model directory with config.json")
    if not isinstance(c, dict):
        raise HFError(
            f"{d}/config.json holds a JSON {type(c).__name__}, not an object of model fields; pass a "
            "Hugging Face model directory"
        )
    mt = c.get("model_type")
    if mt not in MODEL_TYPES:
        raise HFError(f"{d}: model_type {mt!r} is not supported; tiertrain trains {', '.join(MODEL_TYPES)}")
    return c, mt


def _implemented(c: dict, d: Path, mt: str, seq_len: int | None) -> int | None:
    """Refuses what tiertrain does not implement (it could not train the model exactly); the sliding window
    kept for the export (None: none), at least `seq_len`."""

    def refuse(ok: bool, why: str) -> None:
        if not ok:
            raise HFError(
                f"{d}: {why}, which tiertrain does not implement; it cannot train this model exactly"
            )

    # only what the family's transformers class reads: gpt-oss's experts take no hidden_act, only llama's MLP
    # mlp_bias, only mixtral's router its jitter; no class reads hidden_dropout, and attention_bias is llama's
    # and the qwen3 families' (imported) or none (mistral's, mixtral's, qwen2_moe's)
    if mt != "gpt_oss":  # transformers' "swish" is torch's SiLU too
        refuse(
            c.get("hidden_act", "silu") in ("silu", "swish"),
            f"hidden_act {c.get('hidden_act')!r} (only silu)",
        )
    if mt == "llama":
        refuse(not c.get("mlp_bias", False), "mlp_bias")
    if mt == "mixtral":
        refuse(not c.get("router_jitter_noise", 0.0), "router_jitter_noise (only 0)")
    refuse(not c.get("attention_dropout", 0.0), f"attention_dropout {c.get('attention_dropout')} (only 0)")
    q = c.get("quantization_config")
    refuse(q is None or mt == "gpt_oss" and q.get("quant_method") == "mxfp4", f"quantization_config {q}")
    window = (
        c.get("sliding_window", FAMILY_DEFAULTS[mt].get("sliding_window"))
        if (mt == "mistral" or mt != "llama" and c.get("use_sliding_window"))  # llama's class has no window
        else None
    )
    if window is not None and not (isinstance(window, int) and not isinstance(window, bool) and window > 0):
        raise HFError(f"{d}/config.json: sliding_window = {window!r}; it must be a positive integer or null")
    if (
        window is not None and seq_len is not None and mt in ("qwen2", "qwen3")
    ):  # windows by max_window_layers
        n, lim = c.get("num_hidden_layers"), c.get("max_window_layers", 28)
        windowed = "sliding_attention" in (c.get("layer_types") or []) or (
            isinstance(n, int) and isinstance(lim, int) and lim < n and not c.get("layer_types")
        )
        refuse(
            seq_len <= window or not windowed, f"sliding_window {window} shorter than train.seq_len {seq_len}"
        )
    return window


def open_weights(model_dir: str | os.PathLike, spec: ModelSpec) -> "HFReader | hf_moe.MoEReader":
    """The reader of a model directory's weights under tiertrain's names (a mixture of experts' released
    layouts mapped onto its fused tensors)."""
    reader = HFReader(model_dir)
    if not spec.is_moe:
        return reader
    q = read_json(Path(model_dir) / "config.json", "").get("quantization_config") or {}
    return hf_moe.MoEReader(reader, spec, q.get("quant_method") == "mxfp4")


def _rope(c: dict, d: Path, mt: str) -> tuple[object, dict | None]:
    """(rope_theta, the scaling table or None) as transformers 5 standardizes them: rope_scaling, else
    rope_parameters (else the family's: gpt-oss's YaRN, also where both are null), its theta else the top level's
    else the family's, its kind by rope_type or the legacy type; a scaled kind's original positions from the top
    level where config.json has them there (Phi-3's), else the table's, else max_position_embeddings."""
    fam = FAMILY_DEFAULTS[mt]
    key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    rp = c.get(key)
    if rp is None:  # absent or null: the family's (gpt-oss's YaRN); an empty table is the default rope
        rp = fam.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise HFError(
            f"{d}/config.json: {key} holds a JSON {type(rp).__name__}; it must be an object "
            'like {"rope_type": "default", "rope_theta": 500000.0}'
        )
    rp = dict(rp)
    theta = rp.pop("rope_theta", c.get("rope_theta", fam["rope_theta"]))
    kind = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn", "longrope"):
        orig = c.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings")
        rp["original_max_position_embeddings"] = orig or c.get(
            "max_position_embeddings", fam["max_position_embeddings"]
        )
    return theta, {"rope_type": kind, **rp}


def hf_config(spec: ModelSpec, dtype: str) -> dict:
    """config.json for `spec`, in the keys transformers 4.x and 5.x both read."""
    c = {
        "architectures": [ARCHITECTURES[spec.model_type]],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.n_kv_heads,
        "head_dim": spec.hd,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": spec.initializer_range,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if spec.model_type in ("llama", "qwen3"):  # q, k, v and o biases, or none
        c.update(attention_bias=spec.attention_bias)
    if spec.model_type == "llama":
        c.update(mlp_bias=False)
    lt = ["sliding_attention" if spec.window(i) else "full_attention" for i in range(spec.num_hidden_layers)]
    if spec.model_type == "mistral" and len(set(lt)) == 1:
        c.update(sliding_window=spec.window(0))  # every block's
    elif spec.model_type == "mistral":  # per block: transformers reads mistral with layer_types as Ministral
        c.update(layer_types=lt, sliding_window=spec.sliding_window)
    if spec.is_moe:
        c.update(hf_moe.config_fields(spec))
    if spec.model_type == "gpt_oss" and spec.rope_scaling is None:  # null would read as its YaRN default
        c.update(rope_scaling={"rope_type": "default"})
    if WINDOWS[spec.model_type] == "per block":  # spelled out: the family's own default differs per class
        c.update(layer_types=lt)
        if spec.model_type != "gpt_oss":
            c.update(use_sliding_window="sliding_attention" in lt)
        if "sliding_attention" in lt:
            c.update(sliding_window=spec.sliding_window)
    # null too: a key left out would read as the family's default id
    c.update({k: getattr(spec, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    return c


# what an imported model's directory holds beside its weights that its export should too
CARRIED = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
CARRIED_DIRS = ("additional_chat_templates",)  # a tokenizer's named chat templates, one .jinja file each


def carry_files(src: str | os.PathLike, dst: str | os.PathLike) -> tuple[list[str], list[str]]:
    """Copies the CARRIED files `src` has into the new directory `dst`; (the names copied, those left behind: a
    link that leads out of the model directory is never followed)."""
    extra = [f"{t}/{f.name}" for t in CARRIED_DIRS for f in sorted((Path(src) / t).glob("*.jinja"))]
    present = [n for n in (*CARRIED, *extra) if (Path(src) / n).is_file()]
    names = [n for n in present if inside(Path(src), n)]
    if names:
        Path(dst).mkdir(parents=True, exist_ok=True)
    for n in names:
        (Path(dst) / n).parent.mkdir(exist_ok=True)
        shutil.copyfile(Path(src) / n, Path(dst) / n)
    return names, [n for n in present if n not in names]


def write_hf(
    out_dir: str | os.PathLike,
    spec: ModelSpec,
    tensors: Iterator[tuple[str, "torch.Tensor"]],
    dtype: str,
    shard_bytes: int = 5 << 30,
    carried: str | os.PathLike | None = None,
) -> list[str]:
    """Writes config.json and safetensors shards (+ index) of the (name, tensor) stream, and the files of
    `carried` (carry_files); returns the shards. `out_dir` must not exist or be empty; it appears only when
    whole, made in a new temporary directory beside it (never a path that was there)."""
    import tempfile

    out = Path(out_dir)
    if out.is_symlink():
        raise HFError(f"--to {out} is a symbolic link; pass a new directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFError(f"--to {out} already exists and is not empty; pass a new directory")
    unlike = unlike_family(spec)
    if unlike:
        raise HFError(
            f"this {spec.model_type} model has {'; '.join(unlike)}: transformers would load its export as "
            "another model (attention tensors missing or new, or other windows); train a model with those keys "
            "as transformers builds them"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    drop_killed_temps(out)  # an export to it killed before it was whole left its temporary
    # its process in its name: a later export to the same --to deletes it, once that process is gone
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        files = _shards(tmp, hf_moe.released(spec, tensors) if spec.is_moe else tensors, dtype, shard_bytes)
        (tmp / "config.json").write_text(json.dumps(hf_config(spec, dtype), indent=2) + "\n")
        if carried is not None:
            carry_files(carried, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep the model from other users
        os.replace(tmp, out)  # over an empty --to too, in one step
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # a full or read-only disk: safetensors raises its own error for what the OS said
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
            raise HFError(
                f"cannot write the export to {out}: {str(e).splitlines()[0][:160]}; pass a --to on a disk with "
                "room for it (nothing was left there)"
            ) from None
        raise
    return files


def _shards(
    tmp: Path, tensors: Iterator[tuple[str, "torch.Tensor"]], dtype: str, shard_bytes: int
) -> list[str]:
    """The tensors in `dtype` as safetensors files of at most `shard_bytes` in `tmp`, named as transformers names
    them, with their index where there are several; the files' names."""
    import torch
    from safetensors.torch import save_file

    want = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    shard: dict[str, torch.Tensor] = {}
    names: dict[str, int] = {}  # tensor name -> shard number (from 1)
    total = count = 0

    def flush() -> None:
        nonlocal shard, count
        count += 1
        save_file(shard, tmp / f"part-{count}", metadata={"format": "pt"})
        os.chmod(tmp / f"part-{count}", 0o644)  # safetensors writes 0600: readable by all, as config.json is
        names.update({k: count for k in shard})
        shard = {}

    for name, t in tensors:
        t = t.to(want).contiguous()
        n = t.numel() * t.element_size()
        if shard and sum(x.numel() * x.element_size() for x in shard.values()) + n > shard_bytes:
            flush()
        shard[name] = t
        total += n
    flush()
    files = {
        k: f"model-{k:05d}-of-{count:05d}.safetensors" if count > 1 else SINGLE for k in range(1, count + 1)
    }
    for k, fname in files.items():
        os.replace(tmp / f"part-{k}", tmp / fname)
    if count > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: files[k] for n, k in sorted(names.items())},
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return list(files.values())
