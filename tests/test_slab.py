from __future__ import annotations

import pytest
import torch

from tiertrain.config import load_config
from tiertrain.tiers.slab import PAGE, SlabLayout, alloc_slab


def test_layout_views_are_disjoint_aligned_and_grouped():
    lay = SlabLayout.build([("norm", (5,)), ("w1", (7, 3)), ("b", (3,)), ("w2", (2, 2))])
    names = [e.name for e in lay.entries]
    assert names == ["w1", "w2", "norm", "b"]  # decayed (>= 2-D) first
    assert all(e.offset % 64 == 0 for e in lay.entries)
    assert lay.numel % 2048 == 0
    spans = sorted((e.offset, e.offset + e.numel) for e in lay.entries)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    (a, b, d1), (c, e, d2) = lay.ranges()
    assert (a, d1, d2, b, c, e) == (0, True, False, lay.entries[2].offset, lay.entries[2].offset, lay.numel)
    flat = alloc_slab(lay.numel, torch.float32, pin=False)
    assert flat.data_ptr() % PAGE == 0 and flat.numel() == lay.numel and not flat.any()
    views = lay.views(flat)
    views["w2"].fill_(3.0)
    assert views["w2"].shape == (2, 2) and flat.sum() == 12.0  # views write into the slab


def test_biases_of_two_dims_take_no_decay_in_the_layout_checkpoints_hold():
    """gpt-oss's experts' biases are 2-D: they stay where the layout put them (among the 2-D tensors, so older
    checkpoints read alike) and the decay skips them, as HF Trainer's rule skips every bias."""
    tensors = [("w", (4, 4)), ("up_bias", (2, 6)), ("down", (2, 3, 4)), ("down_bias", (2, 4)), ("norm", (4,))]
    lay = SlabLayout.build(tensors)
    assert [e.name for e in lay.entries] == ["w", "up_bias", "down", "down_bias", "norm"]
    decayed = {e.name for e in lay.entries for a, b, d in lay.ranges() if d and a <= e.offset < b}
    assert decayed == {"w", "down"}
    got = lay.ranges()
    assert got[0][0] == 0 and got[-1][1] == lay.numel and all(x[1] == y[0] for x, y in zip(got, got[1:]))


def test_every_model_tensor_has_a_slot():
    spec = load_config("qwen2.5-32b").model
    for u in spec.units()[:3] + spec.units()[-1:]:
        lay = SlabLayout.build([(t.name, t.shape) for t in u.tensors])
        assert {e.name for e in lay.entries} == {t.name for t in u.tensors}
        assert lay.numel >= u.numel


def test_a_pinned_slab_is_unregistered_while_its_pages_are_still_mapped(monkeypatch):
    """cudaHostUnregister before munmap: unmapped first, another thread may map the range again and fail to
    register it (CUDA's "already registered": the GPU suite met it now and then). A fake cudart checks the
    order on a CPU."""
    import gc

    calls = []

    def mapped(ptr: int) -> bool:
        with open("/proc/self/maps") as f:
            spans = (line.split()[0].split("-") for line in f)
            return any(int(a, 16) <= ptr < int(b, 16) for a, b in spans)

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, mapped(ptr)))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr, mapped(ptr)))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    flat = alloc_slab(3 * PAGE, torch.float32, pin=True)
    ptr = flat.data_ptr()
    view = flat[PAGE:].view(torch.int32)  # a view keeps the pages: nothing is unregistered while one lives
    del flat
    gc.collect()
    assert calls == [("register", ptr, True)]
    del view
    gc.collect()
    assert calls == [("register", ptr, True), ("unregister", ptr, True)]
    assert not mapped(ptr)


@pytest.mark.gpu
def test_pinned_slabs_made_and_dropped_from_threads_all_register():
    """dev/pin_race.py in short: the code that unregistered after unmapping failed about one slab in six here."""
    import threading
    import time

    failed, stop = [], time.monotonic() + 2.0

    def churn():
        while time.monotonic() < stop:
            try:
                slab = alloc_slab(16 * PAGE // 4, torch.float32, pin=True)
            except MemoryError as e:
                failed.append(e)
            else:
                del slab

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failed, failed[0]
