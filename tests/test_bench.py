"""The benchmark's trace summary (bench.trace), on a hand-made profiler trace."""

from __future__ import annotations

import pytest

from bench.trace import TAG, host_adamw, summarize


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_trace_summary_per_stream_and_phase():
    # after both phases
    ev = [
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 1, stream=7, bytes=TAG),  # 7: compute
        _x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 0, 1, stream=9, bytes=TAG + 1),  # 9: h2d
        _x("user_annotation", "forward", 100, 1000),
        _x("user_annotation", "backward", 1100, 2000),
        # overlapping kernels count once; the part past the forward pass counts in the backward
        _x("kernel", "gemm", 200, 300, stream=7),
        _x("kernel", "gemm", 400, 200, stream=7),
        _x("kernel", "gemm", 1000, 400, stream=7),
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 150, 500, stream=9, bytes=2e9),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1200, 100, stream=11, bytes=1e9),
        _x("kernel", "gemm", 5000, 100, stream=7),
    ]
    (step,) = summarize({"traceEvents": ev})
    f, b = step["forward"], step["backward"]
    assert f["s"] == pytest.approx(1e-3) and b["s"] == pytest.approx(2e-3)
    assert f["busy"]["compute"] == pytest.approx((600 - 200 + 1100 - 1000) / 1e6)
    assert b["busy"]["compute"] == pytest.approx(300 / 1e6)
    assert f["busy"]["h2d"] == pytest.approx(500 / 1e6) and f["moved"]["h2d"] == (2.0, 0.0)
    assert b["busy"]["stream 11"] == pytest.approx(100 / 1e6) and b["moved"]["stream 11"] == (0.0, 1.0)


def test_host_adamw_per_phase_from_the_timeline():
    # this one's, after the norm
    ev = [
        ("step", -1, 0.0),
        ("job", 0, 0.1),
        ("grad", 0, 0.2),
        ("done", 0, 0.5),  # the last update
        ("backward", -1, 1.0),
        ("spec job", 3, 1.1),
        ("spec grad", 3, 1.3),
        ("spec done", 3, 1.6),
        ("norm", -1, 2.0),
        ("job", 0, 2.0),
        ("done", 0, 2.1),
    ]
    assert host_adamw(ev, 1) == [pytest.approx({"forward": 0.3, "backward": 0.3})]


def test_dram_table_counts_the_copy_bytes_and_the_host_adamw():
    from bench.dram import step_bytes, table

    row = {
        "system": "tiertrain",
        "kind": "tiertrain",
        "plan": {"stream": "compute"},
        "batch": 4,
        "step_s": 2.0,
        "h2d_gb": 10.0,
        "d2h_gb": 6.0,
        "host_adam_params": 1e9,
    }
    fp32 = dict(row, system="tiertrain-fp32", plan={"stream": "master"})
    assert step_bytes(row) == pytest.approx(16e9 + 30e9) and step_bytes(fp32) == pytest.approx(16e9 + 28e9)
    # 112 GB/s
    lines = table(
        [row, fp32, {"system": "DeepSpeed ZeRO-3 offload CPU", "kind": "deepspeed", "batch": 4}],
        {"host_adam_fp32_stream_params_per_s": 4e9},
    )
    cells = [ln.split(" | ") for ln in lines if ln.startswith("| tiertrain")]
    assert [c[3] for c in cells] == ["46.0", "44.0"] and [c[4] for c in cells] == ["23", "22"]
    assert [c[5] for c in cells] == ["112", "112"]
    assert [float(c[6]) for c in cells] == pytest.approx([46 / 112, 44 / 112], abs=1e-3)
    assert table([row], {}) == []


def test_adamw_ceiling_is_at_least_what_the_step_reached():
    from bench.dram import adam_rate, dram_rate, table

    probe = {"host_adam_params_per_s": 4e9, "host_adam_fp32_stream_params_per_s": 5e9}
    row = {
        "system": "tiertrain",
        "kind": "tiertrain",
        "plan": {"stream": "compute"},
        "batch": 4,
        "step_s": 1.0,
        "h2d_gb": 10.0,
        "d2h_gb": 6.0,
        "host_adam_params": 1e9,
        "timeline": {"upd_gparams_s": 4.5},
    }
    fp32 = dict(row, system="tiertrain-fp32", plan={"stream": "master"})
    # the bf16 variant's probe (4.0) is below the step's 4.5; the fp32 variant's (5.0) is not
    assert adam_rate(row, probe) == (pytest.approx(4.5e9), True)
    assert adam_rate(fp32, probe) == (5e9, False)
    assert adam_rate(dict(row, timeline=None), probe) == (4e9, False)
    # DRAM: the probe's fp32 rate x 28 B (140 GB/s) against the step's 4.5 x 30 B (135) and x 28 B (126)
    assert dram_rate(row, probe) == pytest.approx(140e9)
    assert dram_rate(dict(row, timeline={"upd_gparams_s": 5.0}), probe) == pytest.approx(150e9)
    cells = [
        ln.split(" | ")
        for ln in table([dict(row, timeline={"upd_gparams_s": 5.0})], probe)
        if ln.startswith("| tiertrain")
    ]
    assert [c[5] for c in cells] == ["150"] and float(cells[0][6]) == pytest.approx(46 / 150, abs=1e-3)


def test_timeline_rates_count_only_the_host_units():
    """The worker also runs the resident units' updates (on the GPU, in a millisecond or two): the host
    AdamW's rates and busy times leave them out, or the step's host AdamW would pass for several times
    faster than it ran (the floor's ceiling takes the rate after the norm). Rows recorded before
    `host_units` was: all but the first units whose parameters the host did not update."""
    from bench.timeline import host_units, summarize

    M = 100_000_000
    ev = [
        ("step", -1, 0.0),
        ("backward", -1, 0.1),
        ("spec job", 2, 0.1),
        ("spec grad", 2, 0.12),
        ("spec done", 2, 0.17),
        ("norm", -1, 0.2),
        ("job", 0, 0.2),
        ("done", 0, 0.202),  # resident: 2 ms
        ("job", 1, 0.202),
        ("grad", 1, 0.202),
        ("done", 1, 0.252),
        ("step", -1, 0.21),
        ("backward", -1, 0.3),
        ("norm", -1, 0.4),
    ]
    numels = [M, M, M]
    s, every = summarize(ev, numels, {1, 2}), summarize(ev, numels)
    assert s["upd_gparams_s"] == pytest.approx(0.1 / 0.05) and s["upd_busy_s"] == pytest.approx(0.05)
    assert s["upd_queued_s"] == pytest.approx(0.002) and s["spec_gparams_s"] == pytest.approx(2.0)
    assert every["upd_gparams_s"] == pytest.approx(0.2 / 0.052)
    assert host_units({"host_units": [2]}, numels) == {2}
    assert host_units({"host_adam_params": 2 * M, "gpu_updates": 0}, numels) == {1, 2}
    assert host_units({"host_adam_params": 3 * M}, numels) == {0, 1, 2}
    assert host_units({"host_adam_params": M + 5}, numels) is None
    assert host_units({"host_adam_params": M, "gpu_updates": 1}, numels) is None


def test_a_bench_system_is_overrides_and_its_rows_record_the_plan(tmp_path):
    """A tiertrain system of bench.pipeline is a list of --set overrides; its row records them and the
    RunPlan they resolved to, and the report's systems table reads the plan, not the name."""
    import argparse

    from bench.pipeline import TIERTRAIN, run_tiertrain
    from bench.pipeline_report import systems_table
    from tiertrain.plan.hardware import REFERENCE

    hw = tmp_path / "hw.json"
    REFERENCE.save(hw)
    a = argparse.Namespace(
        config="debug", batches=[2], micro=1, warmup=1, steps=1, grad_clip=1.0, hardware=str(hw)
    )
    (row,) = run_tiertrain(a, "tiertrain-host-adam", TIERTRAIN["tiertrain-host-adam"])
    assert row["kind"] == "tiertrain" and row["sets"] == TIERTRAIN["tiertrain-host-adam"]
    assert row["plan"]["stream"] == "master" and row["plan"]["micro_batch"] == 1
    assert {u["update"] for u in row["plan"]["units"]} == {"host"} and row["speculated"] == 0
    (line,) = [ln for ln in systems_table([row]) if ln.startswith("| tiertrain-host-adam")]
    assert "| master | host | 0 |" in line and f"{len(row['plan']['units'])} host |" in line


def test_chat_bench_data_is_conversations_and_the_same_tokens_as_text(tmp_path):
    """bench.chat's synthetic conversations: lengths in range, turns of untrained then trained tokens, and the
    plain text the same tokens as one stream."""
    import numpy as np

    from bench.chat import conversations
    from tiertrain.tokenfile import open_tokens

    n = conversations(tmp_path / "c.bin", tmp_path / "t.bin", 30, (200, 4000), 128256)
    c, t = open_tokens(tmp_path / "c.bin"), open_tokens(tmp_path / "t.bin")
    lengths = np.diff(np.append(c.starts, len(c.tokens)))
    assert n["conversations"] == 30 and lengths.min() >= 200 and lengths.max() <= 4000
    assert (c.tokens[:] == t.tokens[:]).all() and t.mask is None and (t.starts == c.starts).all()
    assert 0.3 < n["trained_tokens"] / n["tokens"] < 0.9 and c.mask[: c.starts[1]][:20].sum() == 0


def test_a_bench_ranks_row_records_the_plan_it_ran(tmp_path):
    """bench.ranks' tiertrain worker, one rank on the CPU: its row carries the step, the plan's prediction of it
    and the RunPlan (the row's keys are read by its report)."""
    import argparse

    from bench.ranks import run_tiertrain

    a = argparse.Namespace(
        config="configs/debug.toml",
        batch=2,
        warmup=1,
        steps=1,
        grad_clip=1.0,
        set=['train.compute_dtype="float32"', 'train.device="cpu"', "train.micro_batch_size=1"],
    )
    row = run_tiertrain(a)
    assert row["gpus"] == 1 and row["batch"] == 2 and len(row["losses"]) == 1
    assert row["step_s"] > 0 and row["pred_step_s"] > 0 and row["bottleneck"] == "compute"
    assert row["plan"]["micro_batch"] == 1 and row["plan"]["compute_dtype"] == "float32"
