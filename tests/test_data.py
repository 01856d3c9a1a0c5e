from __future__ import annotations

import numpy as np
import pytest

from tiertrain.data import BYTE_EOS, HEADER, Loader, builtin_tokens, prepare, read_tokens, write_bin
from tiertrain.errors import DataError


def test_rows_in_order_without_shuffle(tmp_path):
    toks = np.arange(1000)
    np.save(tmp_path / "t.npy", toks)
    S, B = 10, 4
    ld = Loader(read_tokens(tmp_path / "t.npy"), S, B, 2000, shuffle=False, seed=0)
    assert ld.rows == 99
    for k in (0, 1, 5):
        inp, tgt = ld.batch(k)
        for j in range(B):
            r = k * B + j
            assert (inp[j] == toks[r * S:r * S + S]).all() and (tgt[j] == toks[r * S + 1:r * S + S + 1]).all()
    inp, _ = ld.batch(24)  # samples 96..99: rows 96, 97, 98, then row 0 of the next epoch
    assert [int(x[0]) for x in inp] == [960, 970, 980, 0]


def test_shuffle_is_seeded_resumable_and_a_permutation(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(10_001))
    mk = lambda seed: Loader(read_tokens(tmp_path / "t.npy"), 10, 5, 20_000, shuffle=True, seed=seed)
    a, b = mk(0), mk(0)
    first = [a.batch(k)[0][:, 0] // 10 for k in range(200)]  # 200 steps x 5 = one epoch of 1000 rows
    assert sorted(np.concatenate(first).tolist()) == list(range(1000))
    assert (b.batch(137)[0] == a.batch(137)[0]).all()  # a fresh loader at step 137: same batch
    assert not (mk(1).batch(0)[0] == a.batch(0)[0]).all()
    assert not (a.batch(200)[0] == a.batch(0)[0]).all()  # epoch 1 has its own order


def test_bin_round_trip_and_header(tmp_path):
    p = tmp_path / "t.bin"
    assert write_bin(p, [np.array([1, 2, 3]), [65535]], vocab_size=65536) == 4
    assert p.stat().st_size == HEADER.size + 4 * 2
    assert read_tokens(p).tolist() == [1, 2, 3, 65535]
    write_bin(p, [[70000]], vocab_size=100_000)
    assert read_tokens(p).dtype.itemsize == 4 and read_tokens(p).tolist() == [70000]


def test_bad_files_say_what_to_do(tmp_path):
    with pytest.raises(DataError, match="not found.*tiertrain prepare"):
        read_tokens(tmp_path / "missing.bin")
    (tmp_path / "junk.bin").write_bytes(b"hello world, not tokens at all......")
    with pytest.raises(DataError, match="bad magic"):
        read_tokens(tmp_path / "junk.bin")
    write_bin(tmp_path / "cut.bin", [np.arange(100)], 1000)
    data = (tmp_path / "cut.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-10])
    with pytest.raises(DataError, match="truncated"):
        read_tokens(tmp_path / "cut.bin")
    np.save(tmp_path / "f.npy", np.zeros((3, 3)))
    with pytest.raises(DataError, match="1-D integer"):
        read_tokens(tmp_path / "f.npy")
    np.save(tmp_path / "short.npy", np.arange(50))
    with pytest.raises(DataError, match="fewer than one batch.*lower"):
        Loader(read_tokens(tmp_path / "short.npy"), 16, 4, 100, False, 0)
    np.save(tmp_path / "big.npy", np.arange(500)[::-1].copy())
    with pytest.raises(DataError, match="vocab_size = 100"):
        Loader(read_tokens(tmp_path / "big.npy"), 16, 4, 100, False, 0).batch(0)


def test_prepare_byte_level(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\n")
    (tmp_path / "b.txt").write_text("world")
    n, vocab = prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "o.bin"))
    toks = read_tokens(tmp_path / "o.bin").tolist()
    assert vocab == 257 and n == len(toks)
    assert toks == list("héllo\n".encode()) + [BYTE_EOS] + list(b"world") + [BYTE_EOS]
    with pytest.raises(DataError, match="not found"):
        prepare([str(tmp_path / "none.txt")], str(tmp_path / "o2.bin"))


def test_prepare_with_a_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world hello moon")
    n, vocab = prepare([str(tmp_path / "a.txt")], str(tmp_path / "o.bin"), str(tmp_path / "tokenizer.json"))
    assert vocab == 3 and read_tokens(tmp_path / "o.bin").tolist() == [1, 2, 1, 0]


def test_builtin_corpus_is_bytes():
    toks = builtin_tokens()
    assert toks.size > 300_000 and toks.max() == BYTE_EOS and toks.min() >= 0
