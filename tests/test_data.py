from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_config
from tiertrain.data import Loader
from tiertrain.errors import DataError
from tiertrain.prepare import prepare
from tiertrain.tokenfile import (
    BYTE_EOS,
    HEADER,
    builtin_tokens,
    open_tokens,
    read_tokens,
    token_vocab,
    write_bin,
)


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
            assert (inp[j] == toks[r * S : r * S + S]).all() and (
                tgt[j] == toks[r * S + 1 : r * S + S + 1]
            ).all()
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
    # --eot '' puts none; its one end-of-text id has no name to pick another by
    prepare([str(tmp_path / "b.txt")], str(tmp_path / "o3.bin"), eot="")
    assert read_tokens(tmp_path / "o3.bin").tolist() == list(b"world")
    with pytest.raises(DataError, match="--eot 'X': the byte-level tokenizer has one end-of-text id"):
        prepare([str(tmp_path / "b.txt")], str(tmp_path / "o4.bin"), eot="X")
    assert not (tmp_path / "o4.bin").exists()
    # --out replaces a token file prepare wrote, never another file
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "o3.bin"))
    assert read_tokens(tmp_path / "o3.bin").tolist()[:5] == list("héllo".encode())[:5]
    (tmp_path / "mine.bin").write_bytes(b"MY PRECIOUS DATA")
    with pytest.raises(DataError, match="mine.bin exists and is not a token file tiertrain wrote"):
        prepare([str(tmp_path / "b.txt")], str(tmp_path / "mine.bin"))
    assert (tmp_path / "mine.bin").read_bytes() == b"MY PRECIOUS DATA"


def _word_tokenizer(path, eot="<|endoftext|>"):
    """A word-level tokenizer.json; `eot` a special token of it (or none)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import AddedToken, models, pre_tokenizers

    tok = tokenizers.Tokenizer(
        models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2, "moon": 3}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if eot:
        tok.add_special_tokens([AddedToken(eot, special=True)])
    tok.save(str(path))
    return path


def test_prepare_with_a_tokenizer_json(tmp_path):
    tok = _word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("hello world hello moon sun")
    n, vocab = prepare([str(tmp_path / "a.txt")], str(tmp_path / "o.bin"), str(tok))
    assert vocab == 5 and read_tokens(tmp_path / "o.bin").tolist() == [1, 2, 1, 3, 0, 4]  # 4: <|endoftext|>
    assert token_vocab(tmp_path / "o.bin") == 5
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "p.bin"), str(tok), eot="")
    assert read_tokens(tmp_path / "p.bin").tolist() == [1, 2, 1, 3, 0]
    bare = _word_tokenizer(tmp_path / "bare.json", eot=None)
    with pytest.raises(DataError, match="no end-of-text token.*--eot"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "q.bin"), str(bare))


def test_each_document_begins_as_the_tokenizer_begins_a_text(tmp_path):
    """A tokenizer whose template puts a beginning-of-text token first (Llama's, Mistral's, Gemma's): each
    document is tokenizer(text) as transformers gives it, then the end-of-text token, as transformers' and TRL's
    text pipelines train; --bos '' puts none, --bos names another; a template without one puts none."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, processors

    path = _word_tokenizer(tmp_path / "tokenizer.json", eot="</s>")
    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("<|start|>", special=True)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 5)])
    tok.save(str(path))
    docs = ["hello world", "moon hello moon"]
    (tmp_path / "d.jsonl").write_text("".join(f'{{"text": "{d}"}}\n' for d in docs))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "o.bin"), str(path))
    want = [i for d in docs for i in [*hf(d)["input_ids"], 4]]
    assert want[0] == 5 and read_tokens(tmp_path / "o.bin").tolist() == want
    assert open_tokens(tmp_path / "o.bin").starts.tolist() == [
        0,
        4,
    ]  # a document starts at its beginning token
    prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "none.bin"), str(path), bos="")
    assert read_tokens(tmp_path / "none.bin").tolist() == [t for t in want if t != 5]
    prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "other.bin"), str(path), bos="<|start|>")
    assert read_tokens(tmp_path / "other.bin").tolist() == [6 if t == 5 else t for t in want]
    with pytest.raises(DataError, match="--bos 'nope' is not a token of"):
        prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "x.bin"), str(path), bos="nope")
    plain = _word_tokenizer(tmp_path / "plain.json")  # no template: GPT-2's, Qwen's way
    prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "p.bin"), str(plain))
    assert read_tokens(tmp_path / "p.bin").tolist() == [1, 2, 4, 3, 1, 3, 4]


def test_a_text_file_is_read_in_blocks_and_must_be_utf8(tmp_path, monkeypatch):
    """A .txt file is read a block of whole lines at a time (never whole in memory): the same tokens; bytes that
    are not UTF-8 are refused with the byte where they are, where they became U+FFFD tokens; a directory is named
    as one."""
    import tiertrain.prepare as prep

    text = "".join(f"line {i} of the file, é\n" for i in range(200))
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(prep, "BLOCK_BYTES", 64)
    pieces, _ = next(prep.documents(tmp_path / "a.txt", "text"))
    first = next(pieces)
    assert 64 <= len(first.encode()) < 100 and first.endswith("\n")  # a block, then its line's end
    prepare([str(tmp_path / "a.txt")], str(tmp_path / "o.bin"))
    assert read_tokens(tmp_path / "o.bin").tolist() == [*text.encode(), BYTE_EOS]
    (tmp_path / "latin.txt").write_bytes(b"x" * 300 + "café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin.txt is not UTF-8 text \(byte 303\); convert it"):
        prepare([str(tmp_path / "latin.txt")], str(tmp_path / "l.bin"))
    assert not list(tmp_path.glob(".l.bin*"))
    with pytest.raises(DataError, match="is a directory; pass its files"):
        prepare([str(tmp_path)], str(tmp_path / "d.bin"))


def test_a_killed_prepare_leaves_no_temporary_for_long(tmp_path):
    """SIGTERM to `prepare` removes its temporary token file, as Ctrl-C does (it stayed for good); one a SIGKILL
    left (its process gone) goes at the next prepare of that --out; a live writer's stays."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "big.txt").write_text("hello world moon\n" * 3_000_000)
    cmd = [
        sys.executable,
        "-m",
        "tiertrain",
        "prepare",
        str(tmp_path / "big.txt"),
        "--out",
        str(tmp_path / "t.bin"),
    ]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".t.bin.tmp-*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGTERM)
    p.wait(60)
    assert p.returncode != 0 and not list(tmp_path.glob(".t.bin*")) and not (tmp_path / "t.bin").exists()
    dead, live = (
        tmp_path / f".t.bin.tmp-{2**22 + 7}-abcd1234",
        tmp_path / f".t.bin.tmp-{os.getpid()}-abcd1234",
    )
    dead.write_bytes(b"half"), live.write_bytes(b"half")
    prepare([str(tmp_path / "big.txt")], str(tmp_path / "small.bin"), eot="")  # another --out: not its
    assert dead.exists()
    (tmp_path / "s.txt").write_text("hello")
    prepare([str(tmp_path / "s.txt")], str(tmp_path / "t.bin"))
    assert not dead.exists() and live.exists()


DOCS = ["hello world", "moon\nhello", "world world moon"]


@pytest.mark.parametrize("tokenizer", ["bytes", "tokenizer.json", "model directory"])
def test_jsonl_and_parquet_prepare_as_text_files(tmp_path, tokenizer):
    """Three documents as three .txt files, as a .jsonl (another field beside the text) and as a .parquet
    file: the same tokens, the end-of-text token after each document."""
    import json

    tok = None
    if tokenizer != "bytes":
        d = tmp_path / "model"
        d.mkdir()
        tok = str(_word_tokenizer(d / "tokenizer.json", eot="</s>"))
        if tokenizer == "model directory":  # tokenizer_config.json names the end-of-text token
            (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
            tok = str(d)
    txts = []
    for i, doc in enumerate(DOCS):
        txts.append(tmp_path / f"d{i}.txt")
        txts[-1].write_text(doc)
    (tmp_path / "d.jsonl").write_text(
        "".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(DOCS))
    )
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"body": DOCS, "n": [1, 2, 3]}), tmp_path / "d.parquet")
    got = {}
    for name, inputs in {
        "txt": [str(p) for p in txts],
        "jsonl": [str(tmp_path / "d.jsonl")],
        "parquet": [str(tmp_path / "d.parquet")],
    }.items():
        prepare(inputs, str(tmp_path / f"{name}.bin"), tok, text_field="body")
        got[name] = read_tokens(tmp_path / f"{name}.bin").tolist()
    assert got["txt"] == got["jsonl"] == got["parquet"]
    eot = BYTE_EOS if tok is None else 4
    assert got["txt"].count(eot) == 3 and got["txt"][-1] == eot
    if tok is not None:
        assert got["txt"] == [1, 2, 4, 3, 1, 4, 2, 2, 3, 4]
    with pytest.raises(DataError, match="no 'text' field.*--text-field"):
        prepare([str(tmp_path / "d.jsonl")], str(tmp_path / "x.bin"), tok)
    with pytest.raises(DataError, match="no column 'text'.*body, n"):
        prepare([str(tmp_path / "d.parquet")], str(tmp_path / "x.bin"), tok)


def test_a_run_checks_the_token_files_vocabulary(tmp_path):
    from tiertrain.trainer import Trainer

    write_bin(tmp_path / "t.bin", [np.arange(5000) % 90], vocab_size=120)  # ids fit, the tokenizer does not
    with pytest.raises(DataError, match="vocabulary of 120 and model.vocab_size is 97"):
        Trainer(tiny_config(tmp_path / "t.bin"))


def test_builtin_corpus_is_bytes():
    toks = builtin_tokens()
    assert toks.size > 300_000 and toks.max() == BYTE_EOS and toks.min() >= 0


def test_a_file_too_short_to_hold_out_rows_says_so(tmp_path):
    """data.val_fraction on a file of less than two rows: named as such, where the line said it held out 0 of -1
    rows and asked to lower the fraction, which could not help."""
    from tiertrain.trainer import Trainer

    np.save(tmp_path / "short.npy", np.arange(40) % 90)
    with pytest.raises(DataError, match="holds 1 row of train.seq_len = 32 tokens: too few to hold out"):
        Trainer(tiny_config(tmp_path / "short.npy", "data.val_fraction=0.1"))
