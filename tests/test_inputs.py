"""The fault review's inputs that each get one line saying what to change (exit 2, no traceback), before
anything is written or allocated: prepare's outputs and inputs, model directories, tokenizers, the planner's budgets
and files, export's sizes, the validation data's settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, refused, tiny


# ---- one line, not a traceback ---------------------------------------------------------------------
def test_prepare_refuses_in_one_line_and_leaves_nothing(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    a = str(tmp_path / "a.txt")
    refused(cli("prepare", a, "--out", str(tmp_path / "missing" / "t.bin")), "does not exist")
    (tmp_path / "d.bin").mkdir()
    refused(cli("prepare", a, "--out", str(tmp_path / "d.bin")), "is a directory")
    (tmp_path / "t.bin.tmp").write_text("a user's file")  # the old temporary name: never written
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    refused(cli("prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "t.bin")), "bad.jsonl:2")
    # a .txt is all text: --text-field would be ignored, where it was silently
    refused(
        cli("prepare", a, "--text-field", "body", "--out", str(tmp_path / "t.bin")),
        "--text-field body",
        ".txt",
    )
    refused(cli("prepare", str(tmp_path), "--out", str(tmp_path / "t.bin")), "is a directory; pass its files")
    assert (tmp_path / "t.bin.tmp").read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "bad.jsonl", "d.bin", "t.bin.tmp"]


@pytest.mark.parametrize("case", ["int", "binary", "truncated", "not-parquet"])
def test_a_parquet_file_prepare_cannot_read_is_one_line(tmp_path, case):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    if case in ("int", "binary"):
        col = [1, 2, 3] if case == "int" else [b"a", b"b", b"c"]
        pq.write_table(pa.table({"text": col}), path)
    else:
        pq.write_table(pa.table({"text": ["hello world"] * 1000}), path)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if case == "truncated" else b"just some text\n" * 40)
    words = "not text" if case in ("int", "binary") else "not a readable .parquet"
    refused(cli("prepare", str(path), "--out", str(tmp_path / "t.bin")), words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.parquet"]


@pytest.mark.parametrize("model", ["empty", "only unknown"])
@pytest.mark.parametrize("given", ["tokenizer.json", "directory"])
def test_a_tokenizer_without_a_vocabulary_is_refused(tmp_path, model, given):
    """None of its tokens, or only its unknown token (a Unigram's default): every text would come out as
    end-of-text tokens and nothing else; so with a model directory, and with --chat."""
    pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, Tokenizer, models

    tok = Tokenizer(models.WordLevel({}, unk_token=None) if model == "empty" else models.Unigram())
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world\n")
    spec = str(tmp_path / "tokenizer.json") if given == "tokenizer.json" else str(tmp_path)
    refused(
        cli("prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "t.bin"), "--tokenizer", spec),
        "no vocabulary",
    )
    if given == "directory" and model == "only unknown":
        pytest.importorskip("transformers")
        (tmp_path / "c.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
        (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
        r = cli(
            "prepare",
            str(tmp_path / "c.jsonl"),
            "--chat",
            "--out",
            str(tmp_path / "t.bin"),
            "--tokenizer",
            spec,
        )
        refused(r, "no vocabulary")
    assert not (tmp_path / "t.bin").exists()


def _hf(tmp_path: Path, config: dict, index=None) -> str:
    d = tmp_path / "hf"
    d.mkdir(exist_ok=True)
    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 97,
    }
    (d / "config.json").write_text(json.dumps({**base, **config}))
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(d)


@pytest.mark.parametrize(
    "config, index, words",
    [
        ({}, [{"weight_map": {}}], "no weight_map"),
        ({"rope_parameters": ["default", 10000]}, None, "rope_parameters holds a JSON list"),
        ({"model_type": "mistral", "sliding_window": "4096"}, None, "sliding_window = '4096'"),
        ({"rope_theta": float("inf")}, None, "rope_theta"),
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": float("inf"),
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                }
            },
            None,
            "finite",
        ),
        (
            {},
            {"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}},
            "outside the model directory",
        ),
    ],
)
def test_a_model_directory_it_cannot_read_is_one_line(token_file, tmp_path, config, index, words):
    refused(
        cli(
            "run",
            *tiny(token_file),
            "--init-from",
            _hf(tmp_path, config, index),
            "--out",
            str(tmp_path / "run"),
        ),
        words,
    )
    assert not (tmp_path / "run").exists()


def test_tokenizer_files_that_link_outside_the_model_stay_behind(tmp_path):
    from tiertrain.model.hf import carry_files

    model, secret = tmp_path / "model", tmp_path / "secret.txt"
    model.mkdir()
    secret.write_text("not the model's")
    (model / "tokenizer.json").symlink_to(secret)
    (model / "tokenizer_config.json").write_text("{}")
    copied, left = carry_files(model, tmp_path / "out")
    assert copied == ["tokenizer_config.json"] and left == ["tokenizer.json"]
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    hub = tmp_path / "models--org--name"  # the hub cache's snapshots link to its blobs: inside the model
    (hub / "blobs").mkdir(parents=True)
    (hub / "snapshots" / "rev").mkdir(parents=True)
    (hub / "blobs" / "abc").write_text("{}")
    (hub / "snapshots" / "rev" / "tokenizer.json").symlink_to("../../blobs/abc")
    assert carry_files(hub / "snapshots" / "rev", tmp_path / "out2") == (["tokenizer.json"], [])


@pytest.mark.parametrize(
    "args, words",
    [
        (["--host-gb", "nan"], "--host-gb nan"),
        (["--gpu-gb", "inf"], "--gpu-gb inf"),
        (["--host-gb", "-1"], "--host-gb -1"),
        (["--batch-size", "0"], "--batch-size"),
        (["--seq-len", "0"], "--seq-len"),
        (["--chart", "/nonexistent/dir/c.png"], "does not exist"),
        (["--hardware", "HW"], "not a probe file"),
        (["--host-gb", "1e300"], "--host-gb 1e300"),  # overflowed the advice's rounding
        (["--nvme-gb", "1e300"], "--nvme-gb 1e300"),
        (["--gpu-gb", "1e300"], "--gpu-gb 1e300"),
        (["--hardware", "DIR"], "cannot be read"),
        (["--gpus", "2", "--gpus-per-host", "4"], "--gpus-per-host 4 is more than"),
        (
            ["--gpus", "4", "--set", "train.batch_size=16", "--set", "train.micro_batch_size=8"],
            "a rank's 4 rows",
        ),
    ],
)
def test_plan_refuses_impossible_budgets_and_files(tmp_path, args, words):
    (tmp_path / "hw.json").write_text(json.dumps({"h2d_gbs": 10}))
    args = [a.replace("HW", str(tmp_path / "hw.json")).replace("DIR", str(tmp_path)) for a in args]
    r = cli("plan", "--config", "debug", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and words in r.stderr, r.stderr


def test_export_refusals_speak_of_export(token_file, tmp_path):
    refused(cli("export", str(tmp_path), "--to", str(tmp_path / "hf")), "export", "neither a tiertrain run")
    assert "--resume" not in cli("export", str(tmp_path), "--to", str(tmp_path / "hf")).stderr
    a = tmp_path / "a"
    assert cli("run", *tiny(token_file), "--set", "train.steps=1", "--out", str(a)).returncode == 0
    refused(
        cli("export", str(a), "--to", str(tmp_path / "hf"), "--max-shard-size", "1.2.3GB"), "--max-shard-size"
    )
    refused(cli("export", str(a), "--to", str(tmp_path / "hf"), "--max-shard-size", "0GB"), "a positive size")
    chunk = a / "checkpoints" / "step_1" / "master" / "0" / "c" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-4] + b"\0\0\0\0")  # its checksum no longer holds
    line = refused(cli("export", str(a), "--to", str(tmp_path / "hf")), "fails its checksum", "another of")
    assert "resume" not in line  # it was told to resume from another checkpoint
    assert not (tmp_path / "hf").exists()


def test_validation_data_messages_name_their_setting(token_file, tmp_path):
    refused(
        cli("run", *tiny(token_file), "--set", 'data.val_path="missing.npy"', "--out", str(tmp_path / "a")),
        "data.val_path 'missing.npy' not found",
    )
    refused(
        cli("run", *tiny(token_file), "--set", "data.val_fraction=0.999999", "--out", str(tmp_path / "b")),
        "data.val_fraction = 0.999999 holds out",
    )


def test_a_run_that_diverged_before_saving_says_what_to_do(token_file, tmp_path):
    """A run that diverged after its first step, before any checkpoint: a new run and a resume on its directory are
    both refused with what to do (a new --out), neither pointing at the other."""
    out = tmp_path / "run"
    refused(
        cli(
            "run",
            *tiny(token_file),
            "--set",
            "optim.lr=1e30",
            "--set",
            "optim.grad_clip=0",
            "--out",
            str(out),
        ),
        "diverged",
    )
    for r in (
        cli("run", *tiny(token_file), "--out", str(out)),
        cli("run", "--resume", "latest", "--out", str(out)),
    ):
        line = refused(r, "saved no checkpoint", "stopped after step 1", "new")
        assert "--resume latest" not in line


def test_plan_takes_the_configs_budgets_as_run_does(tmp_path):
    """tiers.host_gb and tiers.nvme_gb set in the config (or by --set) are `plan`'s budgets where no flag gives one,
    as they are `run`'s: a run refused for its host budget points at `plan` with the same --set, which must miss
    too. A flag still wins over the config."""
    import json

    small = ["--set", "tiers.host_gb=0.2"]
    r = cli("plan", "--config", "debug", *small, "--format", "json")
    assert r.returncode == 1 and not json.loads(r.stdout)["fits"], r.stdout[-400:]  # a miss
    r = cli("plan", "--config", "debug", *small, "--host-gb", "64", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["fits"]
    refused(cli("run", *small, "--out", str(tmp_path / "r")), "--host-gb")
    # --nvme-gb 0 with --nvme-dir: the directory's free space, as run's tiers.nvme_gb = 0 (it meant no tier)
    spill = ["--config", "llama3.1-8b", "--hardware", "reference", "--host-gb", "40", "--format", "json"]
    free = cli("plan", *spill, "--nvme-dir", str(tmp_path))
    zero = cli("plan", *spill, "--nvme-dir", str(tmp_path), "--nvme-gb", "0")
    assert json.loads(zero.stdout)["fits"] == json.loads(free.stdout)["fits"]
    assert json.loads(zero.stdout)["nvme_bytes"] == json.loads(free.stdout)["nvme_bytes"]
    # a --nvme-dir still to be made: the free space of the disk it will be on, as `run` budgets it
    later = cli("plan", *spill, "--nvme-dir", str(tmp_path / "new" / "nvme"))
    assert (
        later.returncode == free.returncode
        and json.loads(later.stdout)["fits"] == json.loads(free.stdout)["fits"]
    )


# ---- the bad-input review (2026-11-27) ------------------------------------------------------------------
@pytest.mark.parametrize(
    "sets,words",
    [
        (["tiers.host_gb=1e308"], "tiers.host_gb = 1e+308 is not allowed"),
        (["tiers.nvme_gb=1e308", "tiers.nvme_dir='x'"], "tiers.nvme_gb = 1e+308 is not allowed"),
        (["tiers.gpu_resident_gb=1e308"], "tiers.gpu_resident_gb = 1e+308 is not allowed"),
        (["model.num_hidden_layers=1000000"], "must be at most 4096"),
        (["model.head_dim=0"], "model.head_dim = 0 is not allowed"),
        # accepted, and exported into config.json for generation
        (["model.bos_token_id=-5"], "model.bos_token_id = -5 is not allowed: must be a token id below 384"),
        (["model.eos_token_id=[2, 99999]"], "model.eos_token_id = [2, 99999] is not allowed"),
        (["tiers.gpu_update_units=1", 'tiers.stream="compute"'], 'needs tiers.stream = "master"'),
        (
            [
                'model.rope_scaling={rope_type="yarn", factor=2.0, original_max_position_embeddings=64, beta_fast="x"}'
            ],
            "yarn's beta_fast",
        ),
        (
            [
                'model.rope_scaling={rope_type="yarn", factor=2.0, original_max_position_embeddings=64, truncate=1}'
            ],
            "truncate",
        ),
    ],
)
def test_values_that_broke_the_setup_or_hung_are_one_line(sets, words, tmp_path):
    """A traceback after --out was claimed (a budget past any disk, yarn's optional keys as strings), or a hang
    building a million blocks' units: one line, before anything is made, in run and in plan alike."""
    args = [a for s in sets for a in ("--set", s)]
    refused(cli("run", "--config", "debug", *args, "--out", str(tmp_path / "run")), words)
    assert not (tmp_path / "run").exists()
    refused(cli("plan", "--config", "debug", *args), words)


def test_a_seed_past_64_bits_of_init_key_trains(token_file, tmp_path):
    """The init's generator keys are seed x 1,000,003 + a name's CRC: from a seed of 1.8e13 (a time in ns, say)
    they passed manual_seed's 64 bits, a traceback after --out was claimed. They wrap around now; the smaller
    seeds' keys are as they were."""
    r = cli(
        "run", *tiny(token_file), "--set", "train.seed=1732700000000000000", "--out", str(tmp_path / "run")
    )
    assert r.returncode == 0, r.stderr[-500:]


def test_a_fault_in_the_setup_gives_back_the_run_directory(tmp_path, monkeypatch):
    """Any exception while the trainer is built (a bug's traceback, an interrupt), not only a refusal, takes back
    the --out it claimed, where it left a marked directory."""
    from click.testing import CliRunner

    from tiertrain import start
    from tiertrain.cli import main

    def broken(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(start, "Trainer", broken)
    r = CliRunner().invoke(main, ["run", "--config", "debug", "--out", str(tmp_path / "run")])
    assert isinstance(r.exception, RuntimeError) and not (tmp_path / "run").exists()


def test_a_resume_with_no_step_to_take_is_refused(token_file, tmp_path):
    """train.steps at or below the checkpoint's step: the resumed run trained nothing, and (into a new --out) wrote
    a run of the same checkpoint again with an empty metrics.jsonl."""
    from conftest import tree_hash

    run = tmp_path / "run"
    assert cli("run", *tiny(token_file), "--set", "train.steps=2", "--out", str(run)).returncode == 0
    before = tree_hash(run)
    for steps, out in (("1", run), ("2", run), ("2", tmp_path / "fork")):
        r = cli("run", "--resume", str(run), "--set", f"train.steps={steps}", "--out", str(out))
        refused(r, f"train.steps = {steps}: the checkpoint is at step 2")
    lock = "tiertrain-run.lock"  # each try takes the lock, and writes its pid there
    assert {**tree_hash(run), lock: ""} == {**before, lock: ""} and not (tmp_path / "fork").exists()


def test_a_config_without_a_model_needs_one_to_import(tmp_path):
    """`--config finetune` (no [model]) without --init-from trained the placeholder [model]'s 0.9 M parameters at
    16 x 2048 tokens; and `plan` with train.init_from planned that placeholder, not the model it imports."""
    from conftest import hf_dir

    refused(cli("run", "--config", "finetune", "--out", str(tmp_path / "run")), "has no [model]")
    assert not (tmp_path / "run").exists()
    refused(cli("plan", "--config", "finetune"), "has no [model]")
    hf = hf_dir("llama2", tmp_path / "hf")
    r = cli(
        "plan",
        "--config",
        "finetune",
        "--set",
        f'train.init_from="{tmp_path / "hf"}"',
        "--seq-len",
        "64",
        "--format",
        "json",
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"] == sum(p.numel() for p in hf.parameters())


def test_a_chart_is_an_image_in_an_existing_directory(tmp_path):
    """report --out and plan --chart: a name matplotlib cannot save, a directory, a directory missing, a path that
    cannot be written gave tracebacks (or wrote `name.png` while printing `chart: name`); one line now."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    assert cli("run", "--config", "debug", "--set", "train.steps=2", "--out", str(run)).returncode == 0
    for out, words in (
        (tmp_path / "r.txt", "a chart is an image file"),
        (tmp_path, "a chart is an image file"),
        (tmp_path / "nodir" / "r.png", "does not exist"),
        (run / "metrics.jsonl" / "r.png", "does not exist"),
    ):
        refused(cli("report", str(run), "--out", str(out)), words)
        refused(cli("plan", "--config", "debug", "--chart", str(out)), words)
    r = cli("report", str(run), "--out", str(tmp_path / "r.svg"))
    assert r.returncode == 0 and (tmp_path / "r.svg").is_file() and f"chart: {tmp_path / 'r.svg'}" in r.stdout


def test_what_a_run_cannot_use_is_refused_where_it_is_given(tmp_path):
    """prepare of documents with no text wrote a file of 0 or 1 tokens, which no run can use; a --hardware file
    that is no probe's was read only on a GPU, so a CPU run trained with it."""
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    for name in ("empty.txt", "empty.jsonl"):
        refused(cli("prepare", str(tmp_path / name), "--out", str(tmp_path / "t.bin")), "holds no text")
        assert not list(tmp_path.glob("t.bin*"))
    (tmp_path / "hw.json").write_text("{}")
    r = cli("run", "--config", "debug", "--hardware", str(tmp_path / "hw.json"), "--out", str(tmp_path / "r"))
    refused(r, "is not a probe file")
    assert not (tmp_path / "r").exists()
    # checkpoints asked on NVMe with no tier: said so, where it spoke of 0 B free on an --nvme-dir of ""
    r = cli("run", "--config", "debug", "--set", 'tiers.activations="nvme"', "--out", str(tmp_path / "r"))
    refused(r, 'tiers.activations = "nvme" puts activation checkpoints on the NVMe tier', "pass --nvme-dir")


def test_a_file_where_a_directory_belongs_is_named_so(tmp_path):
    """`--resume FILE` was told the file "does not exist"; `plan --nvme-dir FILE` planned as if it were a disk, where
    `run` refuses it."""
    f = tmp_path / "a.txt"
    f.write_text("a user's file")
    refused(cli("run", "--resume", str(f), "--out", str(tmp_path / "r")), "is a file, not a directory")
    for where in (f, f / "sub"):
        refused(
            cli("plan", "--config", "debug", "--nvme-dir", str(where)), f"{f} is a file; pass a directory"
        )
    assert f.read_text() == "a user's file" and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]


@pytest.mark.parametrize("flag, value", [("--host-gb", "nan"), ("--nvme-gb", "inf"), ("--host-gb", "1e308")])
def test_run_names_a_budget_flag_it_refuses(tmp_path, flag, value):
    """`run --host-gb nan` was refused as `tiers.host_gb ... (got "NaN")`, naming the key and not the flag given."""
    r = cli("run", "--config", "debug", flag, value, "--out", str(tmp_path / "r"))
    refused(r, f"{flag} {value}: pass a number of GB from 0 to")
    assert not (tmp_path / "r").exists()
