"""Long context: the tiled MLP and loss against untiled runs, checkpoints on NVMe (and split across homes) against
the GPU's, and the plans of the issue's long runs."""
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from tiertrain.config import load_config
from tiertrain.plan.hardware import REFERENCE
from tiertrain.plan.planner import Budgets, plan
from tiertrain.plan.report import to_markdown
from tiertrain.plan.resolve import search
from tiertrain.trainer import Trainer

LONG = ["train.seq_len=2048", "model.max_position_embeddings=2048", "train.batch_size=2", "train.micro_batch_size=1",
        'train.device="cpu"', "train.steps=3", 'train.compute_dtype="float32"']


def _train(cfg, steps: int):
    tr = Trainer(cfg)
    recs = [tr.train_step() for _ in range(steps)]
    sd = tr.state_dict()
    tr.close()
    tr.discard_scratch()
    return [r["loss"] for r in recs], sd, tr


def test_tiled_mlp_and_loss_match_untiled():
    """The debug model at 2048 tokens, the MLP and the loss in tiles of 128 tokens: losses and weights equal to
    the untiled run within 1e-6 relative (fp32; only the order of the weight gradients' sums differs)."""
    whole = load_config("debug", LONG + ["train.mlp_chunk_tokens=0", "train.loss_chunk_tokens=4096"])
    tiled = load_config("debug", LONG + ["train.mlp_chunk_tokens=128", "train.loss_chunk_tokens=128"])
    base, base_sd, tr = _train(whole, 3)
    assert tr.run_plan.mlp_tile == 0
    losses, sd, tr = _train(tiled, 3)
    assert tr.run_plan.mlp_tile == 128 and tr.schedule.ctx.mlp_tile == 128
    assert losses == pytest.approx(base, rel=1e-6)
    # relative in norm: AdamW turns a rounding-level change of a near-zero gradient into one of up to lr
    worst = max(float((sd[k] - base_sd[k]).norm() / base_sd[k].norm()) for k in base_sd)
    assert 0 < worst <= 1e-6  # and the tiles did run: the sums' order shows


def test_plan_tiles_the_mlp_beyond_a_tile():
    """"auto": no tiles while the untiled MLP takes at most an eighth of the GPU (they cost its forward pass
    again), tiles beyond; and the tiled working set no longer grows with the intermediate size times the length."""
    spec = load_config("llama-7b").model
    b = Budgets(host_gb=1000, gpu_gb=141)
    short = plan(spec, 1, 65536, "bfloat16", b, REFERENCE, micro=1, advise=False)
    long = plan(spec, 1, 131072, "bfloat16", b, REFERENCE, micro=1, advise=False)
    untiled = plan(spec, 1, 131072, "bfloat16", b, REFERENCE, micro=1, advise=False, mlp_tile=0)
    assert short.mlp_tile == 0 and long.mlp_tile == 8192 and untiled.mlp_tile == 0
    assert untiled.gpu["working set"] - long.gpu["working set"] > 0.5 * 16.8 * spec.intermediate_size * 131072
    assert long.times["compute bwd"] > untiled.times["compute bwd"]  # the tiles' forward runs again


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("home", ["host", "nvme", "split"])
def test_checkpoint_homes_give_the_same_bits(token_file, tmp_path, home, device):
    """Checkpoints on NVMe, in RAM, and split across the GPU, the host and NVMe: the same bits as on the GPU."""
    sets = ['train.compute_dtype="bfloat16"', "model.num_hidden_layers=5", "train.steps=3", f'train.device="{device}"']
    base, base_sd, _ = _train(tiny_config(token_file, *sets), 3)
    acts = "nvme" if home == "split" else home
    cfg = tiny_config(token_file, *sets, f'tiers.activations="{acts}"', f'tiers.nvme_dir="{tmp_path}"')
    tr = Trainer(cfg)
    assert set(tr.run_plan.checkpoints().values()) == {acts} and len(tr.run_plan.checkpoints()) == 5
    if home == "split":  # the order a split plan gives: NVMe for the first blocks, then the host, the GPU last
        tr.checkpoints.homes = {1: "nvme", 2: "nvme", 3: "host", 4: "gpu", 5: "gpu"}
    recs = [tr.train_step() for _ in range(3)]
    sd = tr.state_dict()
    store = tr.checkpoints.store
    if acts == "nvme":
        import zarr

        assert store.rows == [1, 2, 3, 4, 5] and zarr.open_group(store.root, mode="r")["checkpoints"].shape[0] == 6
        per_step = 2 * (2 if home == "split" else 5) * cfg.train.batch_size * cfg.train.seq_len * cfg.model.hidden_size * 4
        assert recs[-1]["ck_disk_gb"] * 1e9 == per_step  # each written once and read back once
    tr.close()
    tr.discard_scratch()
    assert [r["loss"] for r in recs] == base
    for k in base_sd:
        assert torch.equal(sd[k], base_sd[k]), k
    assert not list(Path(tmp_path).glob("tiertrain-*"))  # the scratch stores are gone


def test_nvme_checkpoints_need_an_nvme_tier(token_file):
    from tiertrain.errors import ConfigError

    with pytest.raises(ConfigError, match="--nvme-dir"):
        Trainer(tiny_config(token_file, 'tiers.activations="nvme"'))


@pytest.mark.parametrize("config,seq", [("llama-7b", 262144), ("llama-3b", 524288), ("llama-1b", 1048576)])
def test_long_runs_plan_under_the_issues_budgets(config, seq):
    """115 GB of RAM, 55 GB of disk, a 141 GB GPU: the checkpoints split across the three (the last blocks' on the
    GPU, the first ones' on NVMe), the MLP tiled, the attention's FLOPs counted; no longer sequence by 1024 tokens
    more than the report's longest fits."""
    cfg = load_config(config, [f"train.seq_len={seq}", "train.batch_size=1", "train.micro_batch_size=1",
                               f"model.max_position_embeddings={seq}"])
    p = search(cfg, REFERENCE, 115, 141, 55, config)
    assert p.fits, p.why
    assert p.activations == "split" and p.mlp_tile and p.longest_seq_len >= seq
    homes = [u["checkpoint"] for u in p.units[1:-1]]
    assert homes == sorted(homes, key=("nvme", "host", "gpu").index)  # NVMe first, the GPU's last
    assert homes.count("nvme") == p.checkpoints["nvme"] > 0 and homes.count("gpu") == p.checkpoints["gpu"] > 0
    ck = seq * cfg.model.hidden_size * 4
    assert p.host_total <= 115e9 + 3e9 and p.gpu_total <= 141e9 * 0.95
    assert p.nvme_checkpoints >= p.checkpoints["nvme"] * ck and sum(p.nvme_bytes.values()) + p.nvme_checkpoints <= 55e9
    assert f"activation checkpoints on NVMe | | {p.nvme_checkpoints / 1e9:.1f} GB" in to_markdown(p)
    assert p.times["NVMe bwd"] > 0  # the checkpoints' reads are priced in the backward pass
    longer = load_config(config, [f"train.seq_len={p.longest_seq_len + 1024}", "train.batch_size=1",
                                  "train.micro_batch_size=1", f"model.max_position_embeddings={p.longest_seq_len + 1024}"])
    assert not search(longer, REFERENCE, 115, 141, 55, config, advise=False).fits
