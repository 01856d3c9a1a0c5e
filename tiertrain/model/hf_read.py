"""Reading a Hugging Face model directory's safetensors weights, tensor by tensor, by name: a single
`model.safetensors` or the shards `model.safetensors.index.json` lists, never a file outside the directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..errors import UserError

if TYPE_CHECKING:
    import torch

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFError(UserError):
    pass


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{path} not found: {what}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFError(f"{path} is not valid JSON ({e}); re-download the model") from None


FLOATS = ("F32", "F16", "BF16", "F64")  # safetensors' names of the dtypes an import takes
MXFP4_PARTS = ("_blocks", "_scales")  # gpt-oss's released experts: bytes, dequantized on import


class HFReader:
    """Tensors of a Hugging Face directory by name, from whichever shard holds them."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        if (self.dir / SINGLE).is_file():  # first, as transformers reads a directory holding both
            if not inside(self.dir, SINGLE):
                raise HFError(
                    f"{self.dir / SINGLE} links outside the model directory; copy the model's files into it"
                )
            self.where = None
        elif (self.dir / INDEX).is_file():
            index = read_json(self.dir / INDEX, "")
            wm = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
                raise HFError(
                    f"{self.dir / INDEX} has no weight_map of tensor names to files; re-download the model"
                )
            outside = [f for f in wm.values() if not inside(self.dir, f)]
            if outside:  # a shard's name is a file of this directory, never a path out of it
                raise HFError(
                    f"{self.dir / INDEX} names a shard outside the model directory ({outside[0]!r}); "
                    "re-download the model"
                )
            self.where = dict(wm)
        else:
            raise HFError(
                f"{self.dir} holds neither {SINGLE} nor {INDEX}; tiertrain reads safetensors weights"
            )
        files = sorted(set(self.where.values())) if self.where else [SINGLE]
        missing = [f for f in files if not (self.dir / f).is_file()]
        if missing:
            raise HFError(
                f"{self.dir}: shard {missing[0]} listed in {INDEX} is missing"
                f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; re-download it"
            )
        self._open: dict[str, object] = {}
        if self.where is None:
            self.where = {k: SINGLE for k in self._file(SINGLE).keys()}

    def _file(self, name: str):
        from safetensors import safe_open

        if name not in self._open:
            try:
                self._open[name] = safe_open(self.dir / name, framework="pt")
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file
                raise HFError(
                    f"{self.dir / name} is not a readable safetensors file ({e}); re-download it"
                ) from None
        return self._open[name]

    def check(self, names: Iterable[str]) -> None:
        """Every tensor named is there, in a float dtype (MXFP4's blocks and scales: bytes), before the
        training state is allocated: the headers alone are read."""
        names = list(names)
        missing = [n for n in names if n not in self.where]
        if missing:
            raise HFError(
                f"{self.dir} lacks tensor {missing[0]}"
                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}; "
                "its weights do not match its config.json"
            )
        for n in names:
            dtype = self._read(n, lambda f: f.get_slice(n).get_dtype())
            # float8 and integer weights are a quantized model's, whose scales tiertrain does not apply
            if dtype not in (("U8",) if n.endswith(MXFP4_PARTS) else FLOATS):
                raise HFError(
                    f"{self.dir}: tensor {n} is {dtype}; tiertrain imports float weights (F32, F16, BF16), "
                    "not a quantized checkpoint: import the model's unquantized release"
                )

    def _read(self, name: str, what):
        """`what` of the open shard that holds tensor `name`."""
        try:
            return what(self._file(self.where[name]))
        except HFError:
            raise
        except Exception as e:  # noqa: BLE001 - a shard without the tensor its index names, or a torn one
            raise HFError(
                f"{self.dir / self.where[name]}: cannot read {name} ({e}); re-download the model"
            ) from None

    def get(self, name: str, shape: tuple[int, ...]) -> "torch.Tensor":
        t = self._read(name, lambda f: f.get_tensor(name))
        if tuple(t.shape) != tuple(shape):
            raise HFError(
                f"{self.dir}: tensor {name} has shape {tuple(t.shape)}, config.json implies {tuple(shape)}"
            )
        if t.is_floating_point() and not t.isfinite().all():  # else the first step would say "diverged"
            raise HFError(f"{self.dir}: tensor {name} holds NaN or infinite values; import a sound copy")
        return t


def model_root(model_dir: Path) -> Path:
    """The directory a model's files must stay inside: the model directory, or for a snapshot of the Hugging Face
    hub's cache (`models--ORG--NAME/snapshots/REV`, whose files link to `../../blobs`) the model's cache entry."""
    d = Path(model_dir).resolve()
    return (
        d.parent.parent if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--") else d
    )


def inside(model_dir: Path, name: str) -> bool:
    """`name` is a file of the model directory (or below it), and no link leads out of model_root."""
    return (
        not Path(name).is_absolute()
        and ".." not in Path(name).parts
        and (Path(model_dir) / name).resolve().is_relative_to(model_root(model_dir))
    )
