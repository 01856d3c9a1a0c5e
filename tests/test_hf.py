"""Hugging Face import and export: a transformers model in, trained exactly as transformers would, and out."""

from __future__ import annotations

import copy
import json
import re
import shlex

import pytest
import torch
import torch.nn.functional as F

from conftest import COMMON, cli, hf_dir, reference_train, tiny_config
from tiertrain.errors import ConfigError, UserError
from tiertrain.export import export_hf
from tiertrain.trainer import Trainer

transformers = pytest.importorskip("transformers")
IMPORTED = ["llama3-rope", "mistral", "mistral-window", "qwen2", "qwen3", "llama-bias", "qwen3-bias"]


def _load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class Loss(torch.nn.Module):
    """A transformers model as the reference loop wants it: forward(inputs, targets) -> summed token loss."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, inp, tgt):
        return F.cross_entropy(
            self.hf(input_ids=inp).logits.float().flatten(0, 1), tgt.flatten(), reduction="sum"
        )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", IMPORTED)
def test_export_of_an_import_reproduces_transformers(case, token_file, tmp_path):
    hf = hf_dir(case, tmp_path / "hf", shard="20KB" if case == "qwen2" else None)
    assert (case == "qwen2") == (tmp_path / "hf" / "model.safetensors.index.json").exists()
    given = tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"', "model.hidden_size=32")
    before = copy.deepcopy(given.model)
    tr = Trainer(given)
    assert tr.cfg.model.hidden_size == COMMON["hidden_size"]  # config.json overrides [model]
    # in the trainer's copy: the caller's Config is input only (its [model] the placeholder, its --set kept)
    assert given.model == before and given.model_sets["hidden_size"] == 32
    tr.save_checkpoint(tmp_path / "run")
    tr.close()
    files = export_hf(str(tmp_path / "run"), str(tmp_path / "out"), shard_bytes=30_000)
    assert len(files) > 1 and (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = _load(tmp_path / "out")
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            back(input_ids=tokens).logits, hf.eval()(input_ids=tokens).logits, rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("case", IMPORTED)
def test_imported_training_matches_transformers_and_adamw(case, token_file, tmp_path):
    hf_dir(case, tmp_path / "hf")
    cfg = tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"', "train.steps=5")
    trains_as_transformers(cfg, tmp_path, _load, Loss)


def test_the_pad_token_s_embedding_trains_as_transformers(token_file, tmp_path):
    """A model with a pad_token_id (tied, so the head's gradient still reaches that row): transformers' embedding
    gives the pad token's row no gradient of its own, so neither does tiertrain's; a fresh init zeroes the row."""
    hf_dir("llama-pad", tmp_path / "hf")
    cfg = tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"', "train.steps=3")
    trains_as_transformers(cfg, tmp_path, _load, Loss)
    tr = Trainer(tiny_config(token_file, "model.pad_token_id=-2"))  # torch's padding_idx counts from the end
    emb = tr.run.state.to_dict()["model.embed_tokens.weight"]
    tr.close()
    assert not emb[-2].any() and emb[-3].any()
    with pytest.raises(ConfigError, match="pad_token_id"):
        Trainer(tiny_config(token_file, f"model.pad_token_id={COMMON['vocab_size']}"))


def trains_as_transformers(cfg, tmp_path, load, loss) -> None:
    """cfg's run of the model imported from tmp_path/hf, exported, against the reference loop (plain PyTorch, torch
    AdamW) on the transformers model `load` gives, as `loss` wraps it: losses and norms within 1e-5 relative,
    every weight within 1e-4."""
    tr = Trainer(cfg)
    got = [tr.train_step() for _ in range(cfg.train.steps)]
    tr.save_checkpoint(tmp_path / "run")
    tr.close()
    export_hf(str(tmp_path / "run"), str(tmp_path / "out"))
    ours = load(tmp_path / "out")

    ref = load(tmp_path / "hf").train()
    losses, norms, _ = reference_train(cfg, None, "cpu", autocast=False, model=loss(ref))
    for a, b in zip([r["loss"] for r in got], losses):
        assert a == pytest.approx(b, rel=1e-5)
    for a, b in zip([r["grad_norm"] for r in got], norms):
        assert a == pytest.approx(b, rel=1e-5)
    want = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.detach(), want[name].detach()) < 1e-4, name


def test_bad_model_directories_are_refused(token_file, tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError, match="model_type 'gpt2' is not supported"):
        Trainer(tiny_config(token_file, f'train.init_from="{tmp_path / "gpt2"}"'))

    hf_dir("qwen3", tmp_path / "sharded", shard="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "sharded" / gone).unlink()
    r = cli(
        "run",
        "--init-from",
        str(tmp_path / "sharded"),
        "--set",
        "train.seq_len=32",
        "--out",
        str(tmp_path / "run"),
    )
    assert r.returncode == 2 and f"shard {gone} listed in model.safetensors.index.json is missing" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()

    r = cli(
        "run", "--config", "debug", "--init-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run")
    )
    assert r.returncode == 2 and "not a directory" in r.stderr


def test_a_directory_with_both_layouts_and_a_wrong_index_read_as_transformers_reads_them(
    token_file, tmp_path
):
    """model.safetensors beside an index and its shards: transformers reads the single file, and so does the
    import (it read the index). An index naming the wrong shard for a tensor: one line, the --out left as it
    came (a SafetensorError traceback, and the --out claimed)."""
    from tiertrain.model.hf import HFReader

    d = tmp_path / "both"
    hf_dir("llama2", d, shard="20KB")
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, **{"rope_theta": 10000.0}))
    other.save_pretrained(tmp_path / "one")
    (tmp_path / "one" / "model.safetensors").rename(d / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    got = HFReader(d).get(name, tuple(other.model.layers[0].mlp.up_proj.weight.shape))
    assert torch.equal(got, other.model.layers[0].mlp.up_proj.weight.detach())
    assert torch.equal(_load(d).model.layers[0].mlp.up_proj.weight.detach(), got)
    (d / "model.safetensors").unlink()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = next(
        f for f in sorted(set(index["weight_map"].values())) if f != index["weight_map"][name]
    )
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    data = f'data.path="{token_file}"'
    r = cli(
        "run",
        "--init-from",
        str(d),
        "--set",
        "train.seq_len=32",
        "--set",
        data,
        "--out",
        str(tmp_path / "run"),
    )
    assert r.returncode == 2 and f"cannot read {name}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_export_refuses_to_overwrite(token_file, tmp_path):
    tr = Trainer(tiny_config(token_file))
    tr.save_checkpoint(tmp_path / "run")
    tr.close()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    r = cli("export", str(tmp_path / "run"), "--to", str(tmp_path / "taken"))
    assert r.returncode == 2 and "already exists and is not empty" in r.stderr
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine" and len(
        list((tmp_path / "taken").iterdir())
    ) == 1
    r = cli("export", str(tmp_path / "run"), "--to", str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _load(tmp_path / "bf16").model.embed_tokens.weight.abs().sum() > 0


def test_export_keeps_what_came_in(token_file, tmp_path):
    """An imported Mistral trained by `tiertrain run` and exported: its sliding_window, token ids,
    generation config and tokenizer files come out as they went in, in shards of --max-shard-size; and so do the
    files of a run resumed from its checkpoint into a new --out."""
    hf_dir("mistral", tmp_path / "hf")
    src = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7, "do_sample": True})
    )
    (tmp_path / "hf" / "tokenizer.json").write_text('{"not": "read by the test"}')
    r = cli(
        "run",
        "--init-from",
        str(tmp_path / "hf"),
        "--set",
        f'data.path="{token_file}"',
        "--set",
        "train.steps=2",
        "--set",
        "train.seq_len=32",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        'train.compute_dtype="float32"',
        "--set",
        "model.hidden_size=32",  # config.json's 64 wins, and the run says so
        "--out",
        str(tmp_path / "run"),
    )
    assert r.returncode == 0, r.stderr
    assert "warning: --set model.hidden_size not used: with --init-from" in r.stdout
    r = cli("export", str(tmp_path / "run"), "--to", str(tmp_path / "out"), "--max-shard-size", "30KB")
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert src["sliding_window"] == out["sliding_window"] == 4096
    assert {k: out.get(k) for k in ("bos_token_id", "eos_token_id")} == {
        k: src[k] for k in ("bos_token_id", "eos_token_id")
    }
    for name in ("generation_config.json", "tokenizer.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) > 1
    assert _load(tmp_path / "out").generation_config.temperature == 0.7
    # a run resumed from that run's checkpoint into another directory exports the same files
    r = cli(
        "run",
        "--resume",
        str(tmp_path / "run" / "checkpoints" / "step_2"),
        "--set",
        "train.steps=3",
        "--out",
        str(tmp_path / "fork"),
    )
    assert r.returncode == 0, r.stderr
    assert cli("export", str(tmp_path / "fork"), "--to", str(tmp_path / "out2")).returncode == 0
    for name in ("generation_config.json", "tokenizer.json"):
        assert (tmp_path / "out2" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()


def test_what_tiertrain_does_not_implement_is_refused_at_import(token_file, tmp_path):
    hf_dir("llama3-rope", tmp_path / "hf")
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**c, "attention_dropout": 0.1}))
    with pytest.raises(UserError, match="attention_dropout 0.1"):
        Trainer(tiny_config(token_file, f'train.init_from="{tmp_path / "hf"}"'))


def test_a_fine_tune_lifts_the_positions_of_the_model_it_imports(token_file, tmp_path):
    """--init-from a model of 64 positions: a 4096-position model takes train.seq_len 100 with no more (the
    placeholder [model]'s 2,048 positions do not count); the 64-position one refuses it naming the rope scaling
    that lifts it, and those --set values, laid over its config.json, train. The routers' loss is a --set away
    too; the model's shape stays config.json's."""
    from moe_cases import moe_model

    hf = moe_model("gpt_oss")
    hf.save_pretrained(tmp_path / "hf")
    init = f'train.init_from="{tmp_path / "hf"}"'
    with pytest.raises(ConfigError, match=r"exceeds model.max_position_embeddings \(64\)") as e:
        Trainer(tiny_config(token_file, init, "train.seq_len=100"))
    sets = [a.strip("'") for a in shlex.split(re.search(r"(--set model\..*?');", str(e.value)).group(1))]
    sets = [a for a in sets if a != "--set"]
    tr = Trainer(
        tiny_config(token_file, init, "train.seq_len=100", *sets, "model.output_router_logits=false")
    )
    m = tr.cfg.model
    assert (m.max_position_embeddings, m.rope_scaling["rope_type"], m.rope_scaling["factor"]) == (
        100,
        "yarn",
        7.0,
    )
    assert (
        m.hidden_size == hf.config.hidden_size and not m.output_router_logits
    )  # config.json's True, --set's off
    assert tr.train_step()["loss"] > 0
    tr.close()
    hf.config.max_position_embeddings = 4096
    hf.save_pretrained(tmp_path / "long")
    tr = Trainer(tiny_config(token_file, f'train.init_from="{tmp_path / "long"}"', "train.seq_len=2560"))
    assert tr.cfg.model.max_position_embeddings == 4096
    tr.close()


@pytest.mark.parametrize("case", ["int32", "float8", "nan"])
def test_weights_that_cannot_train_are_refused_by_name(token_file, tmp_path, case):
    """An int32 embedding trained silently (cast to float), and so would a float8 one without the scales of its
    quantized checkpoint; a NaN in a weight failed after the first step as a divergence."""
    from safetensors.torch import load_file, save_file

    hf_dir("llama2", tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.mlp.down_proj.weight"
    if case == "nan":
        tensors[name][3, 4] = float("nan")
    else:
        tensors[name] = tensors[name].to({"int32": torch.int32, "float8": torch.float8_e4m3fn}[case])
    save_file(tensors, f, metadata={"format": "pt"})
    words = {"int32": "is I32; tiertrain imports float weights", "float8": "is F8_E4M3; tiertrain imports"}
    with pytest.raises(UserError, match=f"tensor {name} " + words.get(case, "holds NaN or infinite values")):
        Trainer(tiny_config(token_file, f'train.init_from="{tmp_path / "m"}"'))
