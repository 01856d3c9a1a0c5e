"""Several ranks, on CPUs as CI runs them: `tiertrain run --gpus 2` (two processes, gloo) against one process with the
same global batch; checkpoints of two ranks resumed on one and on two; the shards; the plan for N GPUs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import zarr

from conftest import beside_gb, cli, hf_dir, refused, stale_store, tiny, tiny_config, write_tokens
from tiertrain.checkpoint import KINDS
from tiertrain.plan.memory import slab_sizes as _layouts
from tiertrain.tiers.placement import kind_bytes, least_host
from tiertrain.tiers.slab import Shard, SlabLayout, host_cost

STEPS = ["--set", "train.steps=6", "--set", "checkpoint.every=3", "--set", "checkpoint.keep=5"]


def losses(run) -> list[tuple[float, float]]:
    return [
        (r["loss"], r["grad_norm"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    ]


def state(run, step: int) -> dict[str, np.ndarray]:
    g = zarr.open_group(run / "checkpoints" / f"step_{step}", mode="r")
    return {f"{k.value}/{u}": g[k.value][str(u)][:] for k in KINDS for u in range(len(g.attrs["numels"]))}


def close(a, b, rel: float = 1e-5) -> None:
    """Every slab of `a` within `rel` of its largest value of `b`'s, and not bit-equal everywhere (the sums over
    the ranks round differently: the comparison would pass by accident otherwise)."""
    assert a.keys() == b.keys()
    for k in a:
        assert np.abs(a[k] - b[k]).max() <= rel * np.abs(b[k]).max(), k


def train(token_file, out, *more, gpus: int = 1):
    r = cli(
        "run",
        *(["--gpus", str(gpus)] if gpus > 1 else []),
        *tiny(token_file),
        *STEPS,
        "--out",
        str(out),
        *more,
    )
    assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """(the token file, the run of one process, the run of two ranks and its output): the 6 steps several tests
    compare with, run once."""
    d = tmp_path_factory.mktemp("plain")
    tokens = write_tokens(d / "tokens.npy")
    train(tokens, d / "one")
    return tokens, d / "one", d / "two", train(tokens, d / "two", gpus=2).stdout


def test_two_ranks_train_as_one_process(plain):
    """The same global batch on two ranks: the losses, norms, weights and moments of the one-process run
    within 1e-5 relative; only rank 0 logs."""
    _, one, two, stdout = plain
    assert stdout.count("done: 6 steps") == 1  # rank 0's lines only
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 6
    for (la, na), (lb, nb) in zip(a, b):
        assert lb == pytest.approx(la, rel=1e-5) and nb == pytest.approx(na, rel=1e-5)
    close(state(two, 6), state(one, 6))
    assert any(not np.array_equal(x, y) for x, y in zip(state(two, 6).values(), state(one, 6).values()))
    assert json.loads((two / "plan.json").read_text())["gpus"] == 2


@pytest.mark.parametrize("speculated", [False, True])
def test_two_ranks_update_their_shards_on_the_gpu_as_one_process(token_file, tmp_path, speculated):
    """A rank's shard of the first unit resident, of the next two updated on the "GPU" (this CPU) as they load or
    speculated in the backward pass: the one-process run with the same updates within 1e-5."""
    sets = [
        "--set",
        "tiers.gpu_resident_gb=0.0003",
        "--set",
        "tiers.gpu_update_units=2",
        "--set",
        f"optim.speculate_gpu_updates={str(speculated).lower()}",
    ]
    one, two = tmp_path / "one", tmp_path / "two"
    train(token_file, one, *sets)
    train(token_file, two, *sets, gpus=2)
    modes = [[u["update"] for u in json.loads((d / "plan.json").read_text())["units"]] for d in (one, two)]
    assert modes[0] == modes[1] and modes[1][0] == "resident"
    assert ("gpu-speculated" if speculated else "gpu") in modes[1]
    for (la, na), (lb, nb) in zip(losses(two), losses(one)):
        assert la == pytest.approx(lb, rel=1e-5) and na == pytest.approx(nb, rel=1e-5)
    close(state(two, 6), state(one, 6))


def test_a_checkpoint_of_two_ranks_resumes_on_two_and_on_one(plain, tmp_path):
    """Saved by two ranks at step 3: resumed by two, the run that never stopped, bit for bit; resumed by one
    process, that run within 1e-5. And one process's checkpoint resumed by two ranks."""
    _, one, two, _ = plain
    for name, gpus, source, exact in (
        ("2on2", 2, two, True),
        ("2on1", 1, two, False),
        ("1on2", 2, one, False),
    ):
        out = tmp_path / name
        r = cli(
            "run",
            *(["--gpus", str(gpus)] if gpus > 1 else []),
            "--resume",
            str(source / "checkpoints" / "step_3"),
            "--out",
            str(out),
        )
        assert r.returncode == 0, r.stderr
        got, want = losses(out), losses(source)[3:]
        assert len(got) == 3
        if exact:
            assert got == want
            assert all(
                np.array_equal(x, y) for x, y in zip(state(out, 6).values(), state(source, 6).values())
            )
        else:
            for (la, na), (lb, nb) in zip(got, want):
                assert la == pytest.approx(lb, rel=1e-5) and na == pytest.approx(nb, rel=1e-5)
            close(state(out, 6), state(source, 6))


def test_two_ranks_spilling_to_nvme_give_the_plain_bits(token_file, tmp_path):
    """Each rank's shards spilled to its own scratch store under --nvme-dir: the bits of two ranks in RAM; the
    scratch stores are gone afterwards, and so are those the run's killed processes had left (the first rank alone
    deletes them, the other waits)."""

    deep = ["--set", "model.num_hidden_layers=8"]
    cfg = tiny_config(token_file, "model.num_hidden_layers=8")
    # the host's
    least = least_host(_layouts(cfg.model, 2), kind_bytes("float32", "master"), 0, host_cost) * 2
    least += beside_gb(cfg, ranks=2) * 1e9  # each rank's process and working set, in --host-gb
    plain, spilled, disk = tmp_path / "plain", tmp_path / "spilled", tmp_path / "nvme"
    for i in range(4):
        stale_store(disk, spilled, f"tiertrain-spilled-{i}")
    train(token_file, plain, *deep, gpus=2)
    r = train(
        token_file, spilled, *deep, "--host-gb", f"{least / 1e9 + 1e-9:.9f}", "--nvme-dir", str(disk), gpus=2
    )
    assert "NVMe tier" in r.stdout
    assert losses(spilled) == losses(plain)
    assert all(np.array_equal(x, y) for x, y in zip(state(spilled, 6).values(), state(plain, 6).values()))
    assert not any(disk.iterdir())


def test_a_batch_the_ranks_cannot_split_is_one_line(token_file, tmp_path):
    r = cli("run", "--gpus", "3", *tiny(token_file), "--out", str(tmp_path / "run"))
    refused(r, "train.batch_size 8", "3 ranks")
    assert not (tmp_path / "run").exists()
    r = cli(
        "run",
        "--gpus",
        "2",
        *tiny(token_file),
        "--set",
        "train.micro_batch_size=8",
        "--out",
        str(tmp_path / "run"),
    )
    refused(r, "train.micro_batch_size 8", "4 rows")


def test_one_rank_is_the_unsharded_run(token_file):
    """With one rank a shard is the slab: the run's numbers do not depend on the ranks' code path."""
    cfg = tiny_config(token_file)
    layouts = [SlabLayout.build([(t.name, t.shape) for t in u.tensors]) for u in cfg.model.units()]
    assert [Shard(lay).numel for lay in layouts] == [lay.numel for lay in layouts]
    assert [Shard(lay).ranges() for lay in layouts] == [lay.ranges() for lay in layouts]


def _apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """How far apart two ranks' and one process's tensors are, relative in norm: AdamW turns a rounding-level change
    of a near-zero gradient into one of up to lr in that element (the CPU's matmul kernels round the sums over the
    ranks' rows differently: AVX-512 FP16 machines put a qwen2 bias 1.25e-5 of its largest value apart)."""
    return float((a - b).norm() / b.norm()) if b.norm() else float((a - b).abs().max())


def test_two_ranks_import_a_hugging_face_model_and_export_it(token_file, tmp_path):
    """--init-from on two ranks (each keeps its shard of the imported weights) trains as one process, and
    `export` writes the two ranks' checkpoint as it writes one process's."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    hf_dir("qwen2", tmp_path / "hf")  # tied embeddings: the head reads the embedding's gathered weights
    runs = {}
    for gpus in (1, 2):
        out = tmp_path / f"run{gpus}"
        r = cli(
            "run",
            *(["--gpus", "2"] if gpus == 2 else []),
            "--init-from",
            str(tmp_path / "hf"),
            "--set",
            f'data.path="{token_file}"',
            "--set",
            "train.steps=3",
            "--set",
            "train.seq_len=32",
            "--set",
            "train.batch_size=4",
            "--set",
            "train.micro_batch_size=2",
            "--set",
            'train.device="cpu"',
            "--set",
            'train.compute_dtype="float32"',
            "--out",
            str(out),
        )
        assert r.returncode == 0, r.stderr
        r = cli("export", str(out), "--to", str(tmp_path / f"hf{gpus}"))
        assert r.returncode == 0, r.stderr
        runs[gpus] = load_file(tmp_path / f"hf{gpus}" / "model.safetensors")
    for (la, na), (lb, nb) in zip(losses(tmp_path / "run2"), losses(tmp_path / "run1")):
        assert la == pytest.approx(lb, rel=1e-5) and na == pytest.approx(nb, rel=1e-5)
    assert runs[1].keys() == runs[2].keys()
    for k, v in runs[1].items():
        assert _apart(runs[2][k], v) <= 1e-5, k


@pytest.mark.gpu
@pytest.mark.parametrize("updates", ["host", "gpu", "gpu-speculated"])
def test_two_ranks_on_the_gpu_train_as_one(token_file, tmp_path, updates):
    """The CUDA path of two ranks (streams, events, pinned shards; shards resident and updated on the GPU), on
    one GPU through gloo: as one rank on the GPU within 1e-5 relative. NCCL needs two GPUs: bench/ranks.py."""
    import os

    sets = (
        []
        if updates == "host"
        else [
            "--set",
            "tiers.gpu_resident_gb=0.0003",
            "--set",
            "tiers.gpu_update_units=2",
            "--set",
            f"optim.speculate_gpu_updates={str(updates != 'gpu').lower()}",
        ]
    )
    runs = {}
    for gpus in (1, 2):
        out = tmp_path / f"run{gpus}"
        r = cli(
            "run",
            *(["--gpus", "2"] if gpus == 2 else []),
            *tiny(token_file),
            *STEPS,
            *sets,
            "--set",
            'train.device="cuda"',
            "--out",
            str(out),
            env={**os.environ, "TIERTRAIN_DIST_BACKEND": "gloo"},
        )
        assert r.returncode == 0, r.stderr
        runs[gpus] = out
    for (la, na), (lb, nb) in zip(losses(runs[2]), losses(runs[1])):
        assert la == pytest.approx(lb, rel=1e-5) and na == pytest.approx(nb, rel=1e-5)
    close(state(runs[2], 6), state(runs[1], 6))


HOOK = """
import os
if os.environ.get("RANK") == "1":  # rank 1 alone fails, at its fifth step
    from tiertrain import trainer
    from tiertrain.errors import DataError

    step = trainer.Trainer.train_step

    def failing(self):
        if self.step == 4:
            raise DataError("rank 1 cannot read its rows (a test)")
        return step(self)

    trainer.Trainer.train_step = failing
"""


def test_a_rank_that_fails_mid_run_stops_every_rank_with_its_line(plain, tmp_path):
    """Rank 1 fails while rank 0 waits for it in a collective: the job stops at once with rank 1's one line,
    and the last checkpoint is whole: the run resumes and ends as the run that never failed."""
    import os

    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOOK)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")]),
    }
    (token_file, _, whole, _), out = plain, tmp_path / "run"
    r = cli("run", "--gpus", "2", *tiny(token_file), *STEPS, "--out", str(out), env=env)
    refused(r, "rank 1: rank 1 cannot read its rows")
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_3"]
    r = cli("run", "--gpus", "2", "--resume", "latest", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert losses(out) == losses(whole)
    assert all(np.array_equal(x, y) for x, y in zip(state(out, 6).values(), state(whole, 6).values()))


def test_a_divergence_every_rank_meets_is_said_once(token_file, tmp_path):
    r = cli(
        "run",
        "--gpus",
        "2",
        *tiny(token_file),
        "--set",
        "optim.lr=1e30",
        "--set",
        "optim.grad_clip=0",
        "--set",
        "optim.warmup_steps=0",
        "--out",
        str(tmp_path / "run"),
    )
    refused(r, "training diverged", "optim.lr")


STATE = """
import sys
import torch
from safetensors.torch import save_file
sys.path.insert(0, sys.argv[1])
from conftest import tiny_config
from tiertrain.trainer import Trainer

tr = Trainer(tiny_config(sys.argv[2]))
for _ in range(2):
    tr.train_step()
sd = tr.state_dict()  # every rank's parts, gathered
tr.load_state_dict({k: v * 0.5 for k, v in sd.items()})  # each rank keeps its part of what it is given
half = tr.state_dict()
tr.close()
if tr.ranks.first:
    save_file({**sd, **{"half." + k: v for k, v in half.items()}}, sys.argv[3])
"""


def test_two_ranks_gather_and_set_the_whole_state(token_file, tmp_path):
    """Trainer.state_dict on two ranks gathers every rank's part (as one process's, within 1e-5 after two steps),
    and load_state_dict sets each rank's part of what it is given."""
    from pathlib import Path

    from safetensors.torch import load_file

    from tiertrain.launch import launch

    tests = str(Path(__file__).parent)
    for n in (1, 2):
        assert (
            launch(n, ["-c", STATE, tests, str(token_file), str(tmp_path / f"{n}.safetensors")], module=None)
            == 0
        )
    one, two = (load_file(tmp_path / f"{n}.safetensors") for n in (1, 2))
    assert one.keys() == two.keys()
    for k, v in one.items():
        assert _apart(two[k], v) <= 1e-5, k
    for k in (k for k in two if not k.startswith("half.")):
        assert torch.equal(two["half." + k], two[k] * 0.5), k


REFUSED = """
import sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from conftest import tiny_config
from tiertrain.errors import UserError
from tiertrain.trainer import Trainer

cfg = tiny_config(sys.argv[2], *sys.argv[3:])
try:
    Trainer(cfg)
except UserError:
    sys.exit(3 if dist.is_initialized() else 0)
sys.exit(4)
"""


@pytest.mark.parametrize("refusal", ["train.batch_size=6", 'data.val_path="/nonexistent/val.bin"'])
def test_a_trainer_refused_under_a_job_ends_the_process_group_it_made(token_file, refusal):
    """Trainer(cfg) as a rank of a job (API use under torchrun) makes the job's process group; refused after
    that (a micro-batch that does not divide a rank's rows; a validation file that is not there), it ends the
    group, as close() does."""
    from pathlib import Path

    from tiertrain.launch import launch

    tests = str(Path(__file__).parent)
    assert launch(2, ["-c", REFUSED, tests, str(token_file), refusal], module=None) == 0


def test_torchrun_runs_the_job_run_gpus_runs(token_file, tmp_path):
    """`torchrun --nproc-per-node 2 -m tiertrain run` is the job `tiertrain run --gpus 2` starts: the same bits."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # torchrun's default; --gpus takes the cores' share
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    assert cli("run", "--gpus", "2", *tiny(token_file), *STEPS, "--out", str(ours), env=env).returncode == 0
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "tiertrain",
            "run",
            *tiny(token_file),
            *STEPS,
            "--out",
            str(theirs),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert losses(theirs) == losses(ours)
    assert all(np.array_equal(x, y) for x, y in zip(state(theirs, 6).values(), state(ours, 6).values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_over_nccl_train_as_one(token_file, tmp_path):
    """Two ranks on two GPUs, NCCL between them (the all-gathers and reduce-scatters on the GPUs' streams): as
    one GPU within 1e-5 relative, with the shards resident, updated on the GPU and speculated, or on the host."""
    for sets in (
        [],
        [
            "--set",
            "tiers.gpu_resident_gb=0.0003",
            "--set",
            "tiers.gpu_update_units=2",
            "--set",
            "optim.speculate_gpu_updates=true",
        ],
    ):
        runs = {}
        for gpus in (1, 2):
            runs[gpus] = tmp_path / f"run{gpus}-{len(sets)}"
            train(token_file, runs[gpus], *sets, "--set", 'train.device="cuda"', gpus=gpus)
        for (la, na), (lb, nb) in zip(losses(runs[2]), losses(runs[1])):
            assert la == pytest.approx(lb, rel=1e-5) and na == pytest.approx(nb, rel=1e-5)
        close(state(runs[2], 6), state(runs[1], 6))


@pytest.mark.gpu
def test_more_ranks_than_gpus_is_one_line(token_file, tmp_path):
    n = torch.cuda.device_count()
    r = cli(
        "run",
        "--gpus",
        str(n + 1),
        *tiny(token_file),
        "--set",
        'train.device="cuda"',
        "--out",
        str(tmp_path / "r"),
    )
    refused(r, f"--gpus {n + 1}", f"pass --gpus {n} or fewer")
    assert not (tmp_path / "r").exists()


LOADER_HOOK = """
import os
if os.environ.get("RANK") == "1":
    from tiertrain import data, errors, trainer

    def failing(*a, **k):
        raise errors.DataError("rank 1 cannot read its data file here")

    trainer.loaders = failing
"""


def test_a_refusal_one_rank_meets_before_training_stops_every_rank_with_its_line(plain, tmp_path):
    """A check one rank alone meets before the first step: rank 1's data file unreadable on its host, and rank 0's
    disk check of a resume's checkpoints. Every rank stops together with that rank's one line, at once, where the
    other ranks used to wait in another collective (a hang) or abort gloo."""
    import os
    import subprocess
    import sys

    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(LOADER_HOOK)
    hooked = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "hook"), os.environ.get("PYTHONPATH", "")]),
    }
    token_file, run = plain[0], tmp_path / "run"

    def tiertrain(*args, env=None):  # a hang fails the test rather than the suite
        cmd = [sys.executable, "-m", "tiertrain", "run", "--gpus", "2", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)

    refused(
        tiertrain(*tiny(token_file), *STEPS, "--out", str(run), env=hooked), "rank 1 cannot read its data"
    )
    assert not run.exists()
    assert tiertrain(*tiny(token_file), *STEPS, "--out", str(run)).returncode == 0
    many = [
        "--set",
        "train.steps=100000000",
        "--set",
        "checkpoint.every=1",
        "--set",
        "checkpoint.keep=100000000",
    ]
    refused(tiertrain("--resume", "latest", "--out", str(run), *many), "rank 0: the checkpoints need")
    # what every rank meets alike is the job's line, said once, without a rank's number
    r = tiertrain(*tiny(token_file), "--set", "train.nope=1", "--out", str(tmp_path / "bad"))
    line = refused(r, "unknown key train.nope")
    assert line.startswith("error: unknown key") and not (tmp_path / "bad").exists()


def test_the_launcher_says_which_rank_died_and_how(capfd):
    """A rank that exits without a word (os._exit, a signal) stops the others, and the launcher says which rank
    and how, where the job used to end silently."""
    import signal

    from tiertrain.launch import launch

    wait = "import os, signal, time\nif os.environ['RANK'] == '1':\n    {}\ntime.sleep(60)"
    for how, code, words in (
        ("os._exit(3)", 3, "rank 1 exited with status 3"),
        ("os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL, "rank 1 was killed by SIGKILL"),
    ):
        assert launch(2, ["-c", wait.format(how)], module=None) == code
        assert words in capfd.readouterr().err


def test_a_terminals_ctrl_c_passed_on_by_the_launcher_stops_a_rank_once():
    """A rank gets a terminal's Ctrl-C twice (the terminal's and the launcher's): within a second the second is
    the same stop, after its step with a checkpoint; one later interrupts at once."""
    import os
    import signal
    import time

    from tiertrain.signals import StopSignals

    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal == "SIGINT"
        time.sleep(1.1)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)


def test_a_rendezvous_port_taken_is_one_line(tmp_path):
    """The launcher picks a free port, which another process may take before rank 0 listens on it: one line
    naming the address, where the job printed torch's traceback."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        job = dict(WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        env = {**os.environ, **job, "MASTER_PORT": str(s.getsockname()[1])}
        cmd = [sys.executable, "-m", "tiertrain", "run", "--out", str(tmp_path / "r")]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    refused(r, f"the ranks cannot meet at 127.0.0.1:{env['MASTER_PORT']}", "run it again")
    assert not (tmp_path / "r").exists()


def test_a_signal_the_launcher_passes_on_lets_every_rank_clean_up(tmp_path):
    """SIGTERM to the launcher reaches every rank; one that stops at once (before the loop, an interrupt) does not
    get the others killed: each gives back what it made (its NVMe store), where they were SIGKILLed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    rank = (
        "import os, pathlib, signal, sys, time\n"
        "d = pathlib.Path(sys.argv[1]); r = os.environ['RANK']\n"
        "def stop(*a):\n"
        "    if r == '1':\n"
        "        time.sleep(1.0)\n"
        "        (d / 'cleaned-1').write_text('')\n"
        "    sys.exit(130)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "(d / f'ready-{r}').write_text('')\n"
        "time.sleep(60)\n"
    )
    job = f"import sys; from tiertrain.launch import launch; sys.exit(launch(2, ['-c', {rank!r}, {str(tmp_path)!r}], module=None))"
    p = subprocess.Popen([sys.executable, "-c", job])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready-{r}").exists() for r in "01") and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(60) == 130
    assert (tmp_path / "cleaned-1").exists()


def test_the_launcher_deletes_the_stores_of_ranks_killed(tmp_path):
    """A rank killed (by a signal, or by the launcher when another failed) cannot delete its NVMe store, which
    stayed on the disk until the run's next start: the launcher deletes it, and nothing else beside it."""
    from tiertrain.launch import launch

    (tmp_path / "users").mkdir()  # not a store of tiertrain's: stays
    rank = (
        "import os, signal, sys, time\n"
        "from tiertrain.tiers.nvme import new_scratch\n"
        "new_scratch(sys.argv[1], 'run'); new_scratch(sys.argv[1], 'run')\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(1)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    assert launch(2, ["-c", rank, str(tmp_path)], module=None) == 128 + 9
    assert [p.name for p in tmp_path.iterdir()] == ["users"]


def test_ranks_die_with_a_launcher_killed_outright(tmp_path):
    """SIGKILL to the launcher, which it cannot pass on: its ranks die with it (they trained on unwatched, holding
    the run directory), ranks that joined the job as tiertrain's do (Ranks.from_env)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    rank = (
        "import os, pathlib, sys, time\n"
        "from tiertrain.parallel import Ranks\n"
        "Ranks.from_env()\n"
        "pathlib.Path(sys.argv[1], f'rank-{os.getpid()}').write_text('')\n"
        "time.sleep(120)\n"
    )
    job = f"import sys; from tiertrain.launch import launch; sys.exit(launch(2, ['-c', {rank!r}, {str(tmp_path)!r}], module=None))"
    p = subprocess.Popen([sys.executable, "-c", job], env={**os.environ, "TIERTRAIN_DIST_BACKEND": "gloo"})
    deadline = time.monotonic() + 90
    while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [psutil.Process(int(f.name[5:])) for f in tmp_path.glob("rank-*")]
    assert len(ranks) == 2
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)

    def gone(r):
        try:
            return r.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 20
    while not all(map(gone, ranks)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [r.pid for r in ranks if not gone(r)]
    for pid in alive:  # not left behind by a failing test
        os.kill(pid, signal.SIGKILL)
    assert not alive


@pytest.mark.parametrize("where", ["checkpoint", "store", "plan"])
def test_a_refusal_one_rank_meets_in_a_resume_stops_every_rank(plain, tmp_path, where):
    """One rank alone failing as a resume sets up (its checkpoint's disk, its NVMe store's), or planning another
    run than the others (its host's RAM or GPU): every rank stops with one line, where the others waited for it
    in a collective for good."""
    import os
    import subprocess
    import sys

    _, _, two, _ = plain
    rank = (
        "import dataclasses, os, sys\n"
        "from tiertrain import assemble, checkpoint_load\n"
        "from tiertrain.tiers.nvme import StoreError\n"
        "planned = assemble._planned\n"
        "def other(*a, **k):  # this rank's plan: another writer's ring\n"
        "    p, chosen = planned(*a, **k)\n"
        "    rp = dataclasses.replace(p.run_plan, ck_pieces=p.run_plan.ck_pieces + 1)\n"
        "    return dataclasses.replace(p, run_plan=rp), chosen\n"
        "def broken(*a, **k):\n"
        "    raise OSError(5, 'Input/output error') if sys.argv[1] == 'checkpoint' else StoreError('no room')\n"
        "patch = {'checkpoint': (checkpoint_load, '_check_size', broken), 'store': (assemble, 'activation_store', broken),\n"
        "         'plan': (assemble, '_planned', other)}\n"
        "if os.environ['RANK'] == '1':\n"
        "    setattr(*patch[sys.argv[1]])\n"
        "from tiertrain.cli import main\n"
        "main(args=sys.argv[2:], prog_name='tiertrain')\n"
    )
    args = [where, "run", "--resume", str(two / "checkpoints" / "step_3"), "--out", str(tmp_path / "r")]
    job = f"import sys; from tiertrain.launch import launch; sys.exit(launch(2, ['-c', {rank!r}, *{args!r}], module=None))"
    r = subprocess.run(
        [sys.executable, "-c", job], capture_output=True, text=True, timeout=240, env=os.environ
    )
    words = {
        "checkpoint": "rank 1: ",  # then its checkpoint's line
        "store": "rank 1: no room",
        "plan": "error: the ranks planned different runs",  # rank 0's, for all
    }[where]
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0], r.stderr
    assert where != "checkpoint" or "reading master/0 failed (Input/output error)" in lines[0]
    assert not (tmp_path / "r").exists()


def test_a_world_size_left_in_the_shell_is_one_line(token_file, tmp_path):
    """WORLD_SIZE set without the rest of a job (RANK, MASTER_ADDR, MASTER_PORT): one line saying so, where torch's
    traceback came; with --gpus as its value too."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
    for more in ([], ["--gpus", "2"]):
        r = cli("run", *more, *tiny(token_file), "--out", str(tmp_path / "r"), env={**env, "WORLD_SIZE": "2"})
        refused(r, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT not", "unset WORLD_SIZE")
        assert not (tmp_path / "r").exists()
