from __future__ import annotations

import glob

import pytest

from tiertrain.config import Config, load_config, parse_override
from tiertrain.errors import ConfigError


def test_default_is_the_shipped_debug_config():
    cfg = load_config()
    assert cfg.model.hidden_size == 128 and cfg.train.steps == 150 and cfg.data.path == ""
    assert load_config("debug").to_dict() == cfg.to_dict() == load_config("configs/debug.toml").to_dict()


# finetune.toml holds no [model]: it needs --init-from (tests/test_inputs.py)
@pytest.mark.parametrize("path", sorted(p for p in glob.glob("configs/*.toml") if "finetune" not in p))
def test_shipped_configs_load_and_round_trip(path, tmp_path):
    cfg = load_config(path)
    again = tmp_path / "again.toml"
    again.write_text(cfg.to_toml())
    assert load_config(str(again)).to_dict() == cfg.to_dict()


def test_llama3b_is_the_benchmark_shape():
    m = load_config("configs/llama-3b.toml").model
    assert (
        m.hidden_size,
        m.num_hidden_layers,
        m.num_attention_heads,
        m.n_kv_heads,
        m.intermediate_size,
        m.vocab_size,
    ) == (3072, 26, 24, 24, 8192, 32000)


def test_published_parameter_counts():
    # Llama 2 7B / 13B, Llama 3 70B, Qwen2.5 32B, Llama 3.2 1B, as their model cards state
    expect = {
        "llama-7b": 6.738e9,
        "llama-13b": 13.016e9,
        "llama-70b": 70.554e9,
        "qwen2.5-32b": 32.764e9,
        "llama-1b": 1.236e9,
    }
    for name, n in expect.items():
        assert abs(load_config(name).model.n_params - n) / n < 1e-3, name


def test_overrides_are_toml_literals():
    cfg = load_config(
        None,
        [
            "train.steps=7",
            "optim.betas=[0.8, 0.9]",
            'train.compute_dtype="float32"',
            "data.path=/tmp/x.bin",
            'model.rope_scaling={rope_type="default"}',
            "optim.lr=1",
        ],
    )
    assert cfg.train.steps == 7 and cfg.optim.betas == [0.8, 0.9] and cfg.train.compute_dtype == "float32"
    assert cfg.data.path == "/tmp/x.bin" and cfg.model.rope_scaling == {"rope_type": "default"}
    assert isinstance(cfg.optim.lr, float)


@pytest.mark.parametrize(
    "sets, words",
    [
        (["train.stpes=5"], ["unknown key train.stpes", "steps"]),
        (["trian.steps=5"], ["unknown section [trian]"]),
        (["train.batch_size=-4"], ["train.batch_size", "positive"]),
        (
            ["train.batch_size=12", "train.micro_batch_size=8"],
            ["train.batch_size", "multiple of train.micro_batch_size"],
        ),
        (["train.steps=1.5"], ["train.steps must be an integer"]),
        (['train.steps="ten"'], ["train.steps must be an integer"]),
        (["data.shuffle=1"], ["data.shuffle must be true or false"]),
        (['train.compute_dtype="fp16"'], ["train.compute_dtype", "bfloat16"]),
        (["train.seq_len=4096"], ["train.seq_len", "max_position_embeddings (1024)"]),
        (["model.num_key_value_heads=3"], ["model.num_key_value_heads", "divide"]),
        (["optim.betas=[0.9]"], ["optim.betas", "two numbers"]),
        (["optim.min_lr=1.0"], ["optim.min_lr", "between 0 and optim.lr"]),
        (['optim.schedule="linear"'], ["optim.schedule", "cosine"]),
        (['model.rope_scaling={rope_type="llama3"}'], ["model.rope_scaling", "factor"]),
        (["steps=5"], ["section.key=value"]),
        (["train.micro_batch_size=-1"], ["train.micro_batch_size", '"auto" (the plan chooses)']),
        # "auto" is the one spelling of "the plan decides": the numbers that used to mean it say so
        (["train.micro_batch_size=0"], ["train.micro_batch_size", '"auto" (the plan chooses)']),
        (["optim.speculate_units=-1"], ["optim.speculate_units", '"auto" (the plan chooses)']),
        (["optim.speculate_gpu_updates=1"], ['optim.speculate_gpu_updates must be true or false or "auto"']),
        (
            ["tiers.gpu_resident_gb=-1"],
            ["tiers.gpu_resident_gb", '"auto" (the GPU memory the plan leaves free)'],
        ),
        (["tiers.gpu_update_units=-1"], ["tiers.gpu_update_units", '"auto" (the plan chooses)']),
        (["train.loss_chunk_tokens=0"], ["train.loss_chunk_tokens", '"auto"']),
        (["train.micro_batch_size=3"], ["train.batch_size", "multiple of train.micro_batch_size (3)"]),
    ],
)
def test_bad_values_name_the_key_and_fix(sets, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found.*shipped name.*llama-3b"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(bad))


def test_config_toml_has_every_section():
    text = Config().validate().to_toml()
    for section in ("[model]", "[data]", "[train]", "[optim]"):
        assert section in text
    assert parse_override("a.b=3") == {"a": {"b": 3}}


def test_a_checkpoints_older_config_loads_with_renamed_keys_and_numbers():
    """A checkpoint's config from before `train.tile_tokens` (then `train.mlp_chunk_tokens`) and with older numbers
    for "auto" loads as it meant; a renamed key in a config a user gives, or in --set, reads as the new one (older
    numbers for "auto" there are refused: only a checkpoint may hold them); both names at once are refused."""
    from tiertrain.config import ConfigError, config_from_dict

    old = {"train": {"mlp_chunk_tokens": 4096, "micro_batch_size": 0}, "tiers": {"gpu_update_units": -1}}
    cfg = config_from_dict(old, legacy=True)
    assert (
        cfg.train.tile_tokens == 4096
        and cfg.train.micro_batch_size == "auto"
        and cfg.tiers.gpu_update_units == "auto"
    )
    assert config_from_dict({"train": {"mlp_chunk_tokens": 4096}}).train.tile_tokens == 4096
    assert config_from_dict({}, ["train.mlp_chunk_tokens=2048"]).train.tile_tokens == 2048
    with pytest.raises(ConfigError, match="old name of train.tile_tokens"):
        config_from_dict({"train": {"mlp_chunk_tokens": 4096, "tile_tokens": 0}})
    with pytest.raises(ConfigError, match="micro_batch_size"):
        config_from_dict({"train": {"micro_batch_size": 0}})
