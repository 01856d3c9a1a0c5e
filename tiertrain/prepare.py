"""`tiertrain prepare`: documents from .txt, .jsonl and .parquet files, tokenized into a .bin token file with
the tokenizer's end-of-text token after each document.

A .txt file is one document (read in blocks of whole lines: a huge file never sits in memory); a .jsonl file
holds one JSON object per line and a .parquet file one row per document, the text in `text_field`. The
tokenizer is byte-level (ids 0-255, 256 ends a document), a Hugging Face tokenizer.json, or a Hugging Face
model directory (its tokenizer.json, else transformers' AutoTokenizer). Documents are encoded in batches
(the tokenizers library spreads a batch over every core).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

from .errors import DataError
from .tokenfile import BYTE_EOS, BYTE_VOCAB, MAGIC, TokenWriter

KINDS = (".txt", ".jsonl", ".parquet")
BATCH_CHARS = 1 << 23  # text per encode_batch call: enough to keep every core busy, little memory
BLOCK_BYTES = 1 << 26  # a .txt file is read in blocks of whole lines this large
# end-of-text tokens of the common tokenizers, for a tokenizer.json without a tokenizer_config.json beside it
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>")


def documents(path: Path, text_field: str) -> Iterator[tuple[Iterator[str], int]]:
    """(the pieces of one document, in order, read as they are taken; the input bytes they cover), one document at
    a time. A .txt file is one document, read in blocks of whole lines: it never sits in memory whole, and a
    tokenizer's merges do not cross a block's end (one token in tens of millions may differ from encoding it
    whole)."""
    if path.suffix == ".txt":
        yield _blocks(path), path.stat().st_size
        return
    for text, _, nbytes, where in records(path, text_field, "text", "--text-field"):
        if not isinstance(text, str) and not (text is None and path.suffix == ".parquet"):
            raise DataError(f"{where}: {text_field!r} holds a {type(text).__name__}, not text")
        yield iter([text or ""]), nbytes


def _blocks(path: Path) -> Iterator[str]:
    """A .txt file's text in blocks of whole lines; not UTF-8 text is refused where it is met."""
    with open(path, "rb") as f:
        at = 0
        while block := f.read(BLOCK_BYTES):
            block += f.readline()
            try:
                yield block.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path} is not UTF-8 text (byte {at + e.start:,}); convert it, e.g. iconv -f latin1 -t utf-8"
                ) from None
            at += len(block)


def records(
    path: Path, field: str, what: str, flag: str, also: tuple[str, ...] = ()
) -> Iterator[tuple[object, dict, int, str]]:
    """(the value of `field`, {each field of `also` the record has: its value}, the input bytes it covers, where it
    is: file:line or file:row) of each record of a .jsonl file (a JSON object a line) or a .parquet file (a row; a
    column of `what`: "text" or "messages")."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    value = record[field]
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(
                        f"{path}:{n} is not a JSON object ({e}); fix the line or the file"
                    ) from None
                except (KeyError, TypeError):
                    raise DataError(
                        f"{path}:{n} has no {field!r} field; pass the field that holds the {what} with {flag}"
                    ) from None
                yield (
                    value,
                    {k: record[k] for k in also if record.get(k) is not None},
                    len(line),
                    f"{path}:{n}",
                )
        return
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading .parquet needs pyarrow: pip install 'tiertrain[data]'") from None
    import pyarrow as pa

    try:
        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            raise DataError(
                f"{path} has no column {field!r} (it has {', '.join(pf.schema_arrow.names)}); "
                f"pass the column that holds the {what} with {flag}"
            )
        kind = pf.schema_arrow.field(field).type
        ok = (
            pa.types.is_string(kind) or pa.types.is_large_string(kind)
            if what == "text"
            else pa.types.is_list(kind) or pa.types.is_large_list(kind)
        )
        if not ok:
            raise DataError(
                f"{path}: column {field!r} holds {kind}, not {what}; pass the column that holds the {what} "
                f"with {flag}"
            )
        rows, size, n = max(pf.metadata.num_rows, 1), path.stat().st_size, 0
        more = [k for k in also if k in pf.schema_arrow.names]
        for batch in pf.iter_batches(columns=[field, *more], batch_size=1024):
            for row in batch.to_pylist():
                n += 1
                yield (
                    row[field],
                    {k: row[k] for k in more if row[k] is not None},
                    size // rows,
                    f"{path}:row {n}",
                )
    except (pa.ArrowException, OSError) as e:  # not parquet, or cut short
        raise DataError(
            f"{path} is not a readable .parquet file ({str(e).splitlines()[0][:160]}); rewrite it, "
            "or pass .jsonl or .txt"
        ) from None


class Encoder:
    """A tokenizer's batched encoding, its vocabulary size and its end-of-text id."""

    def __init__(self, spec: str | None, eot: str | None, bos: str | None = None):
        self.encode_batch: Callable[[list[str]], list[list[int]]]
        # what the tokenizer's template puts before a text (_prefix)
        self.specials: list[int] = []
        if spec is None:
            for flag, name in (("--eot", eot), ("--bos", bos)):
                if name:  # its one special id has no name
                    raise DataError(
                        f"{flag} {name!r}: the byte-level tokenizer has one end-of-text id ({BYTE_EOS}) and no "
                        f"named tokens; leave {flag} out for it, pass {flag} '' for none, or pass --tokenizer"
                    )
            self.vocab, self.eot, self.bos = BYTE_VOCAB, BYTE_EOS if eot is None else None, []
            self.encode_batch = lambda texts: [list(t.encode("utf-8")) for t in texts]
            return
        p = Path(spec)
        if p.is_dir() and not (p / "tokenizer.json").is_file():
            self._auto(p)
        else:
            self._tokenizer_json(p / "tokenizer.json" if p.is_dir() else p)
        name = eot if eot is not None else _config_eot(p.parent if p.is_file() else p)
        if name is None:
            name = next((t for t in EOT_NAMES if self.token_id(t) is not None), None)
        if name is None:
            raise DataError(
                f"{spec}: no end-of-text token found (none of {', '.join(EOT_NAMES)}, no "
                "tokenizer_config.json eos_token); pass --eot TOKEN, or --eot '' to put none"
            )
        self.eot = self.token_id(name) if name else None
        if name and self.eot is None:
            raise DataError(f"--eot {name!r} is not a token of {spec}; pass one of its special tokens")
        # the beginning-of-text token(s) tokenizer(text) puts first (Llama's, Mistral's, Gemma's; GPT-2 and Qwen
        # put none), as transformers' and TRL's text pipelines train them; --bos names another, '' none
        self.bos = self.specials if bos is None else [self.token_id(bos)] if bos else []
        if bos and self.bos == [None]:
            raise DataError(f"--bos {bos!r} is not a token of {spec}; pass one of its special tokens")

    def _tokenizer_json(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "--tokenizer needs the `tokenizers` package: pip install 'tiertrain[hf]'"
            ) from None
        if not path.is_file():
            raise DataError(
                f"tokenizer {str(path)!r} not found; pass a tokenizer.json or a Hugging Face model directory"
            )
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises its own Exception for a file it cannot parse
            raise DataError(
                f"{path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:120]}); "
                "pass the tokenizer.json of a tokenizers / transformers model"
            ) from None
        if tok.get_vocab_size(with_added_tokens=False) < 2:
            raise DataError(
                f"{path} has no vocabulary (its model lists {tok.get_vocab_size(with_added_tokens=False)} "
                "tokens); pass the tokenizer.json of a trained tokenizer"
            )
        self.vocab = tok.get_vocab_size(with_added_tokens=True)
        self.token_id = tok.token_to_id
        self.encode_batch = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
        self.specials = _prefix(tok.encode("a").ids, tok.encode("a", add_special_tokens=False).ids)

    def _auto(self, path: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise DataError(
                f"{path} has no tokenizer.json; its tokenizer needs transformers: pip install transformers"
            ) from None
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise DataError(
                f"{path}: no tokenizer could be loaded ({str(e).splitlines()[0][:160]})"
            ) from None
        check_vocabulary(tok, path)
        self.vocab = len(tok)
        self.token_id = lambda t: tok.convert_tokens_to_ids(t) if t in tok.get_vocab() else None
        self.encode_batch = lambda texts: tok(texts, add_special_tokens=False)["input_ids"]
        self.specials = _prefix(tok("a")["input_ids"], tok("a", add_special_tokens=False)["input_ids"])


def _prefix(special: list[int], plain: list[int]) -> list[int]:
    """The ids a tokenizer's template puts before a text: `special` (encoded with them) up to where `plain`
    (without) begins; none where the template changes the text itself."""
    for i in range(len(special) - len(plain) + 1):
        if special[i : i + len(plain)] == plain:
            return special[:i]
    return []


def check_vocabulary(tok, path) -> None:
    """A transformers tokenizer whose model lists fewer than two tokens (none, or only its unknown token) is
    refused: every text would come out as nothing or as that token."""
    if (tok.vocab_size or 0) < 2:
        raise DataError(
            f"{path}: its tokenizer has no vocabulary ({tok.vocab_size or 0} tokens); pass the directory of a "
            "trained tokenizer"
        )


def _config_eot(model_dir: Path) -> str | None:
    """The eos_token of a model directory's tokenizer_config.json, if it names one."""
    try:
        eos = json.loads((model_dir / "tokenizer_config.json").read_text()).get("eos_token")
    except (OSError, json.JSONDecodeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def check_paths(inputs: list[str], out: str) -> list[Path]:
    """The input files, each of a kind prepare reads, and --out a file in an existing directory."""
    paths, target = [Path(p) for p in inputs], Path(out)
    if target.is_dir():
        raise DataError(
            f"--out {out} is a directory; pass the token file to write, e.g. {target / 'tokens.bin'}"
        )
    if not target.parent.is_dir():
        raise DataError(
            f"--out {out}: the directory {target.parent} does not exist; create it or pass a file in an "
            "existing directory"
        )
    if target.exists() or target.is_symlink():  # replaced only where it is a token file prepare wrote
        try:
            ours = not target.is_symlink() and target.is_file() and target.open("rb").read(8) == MAGIC
        except OSError:
            ours = False
        if not ours:
            raise DataError(
                f"--out {out} exists and is not a token file tiertrain wrote; pass a new file name (prepare "
                "replaces only its own .bin files)"
            )
    for p in paths:
        if p.is_dir():
            raise DataError(f"input {str(p)!r} is a directory; pass its files, e.g. {p / '*.txt'}")
        if not p.is_file():
            raise DataError(f"input file {str(p)!r} not found; pass existing files to `tiertrain prepare`")
        if p.suffix not in KINDS:
            raise DataError(f"{p}: unknown input type {p.suffix!r}; prepare reads {', '.join(KINDS)}")
    return paths


def prepare(
    inputs: list[str],
    out: str,
    tokenizer: str | None = None,
    text_field: str = "text",
    eot: str | None = None,
    progress: Callable[[int], None] = lambda n: None,
    bos: str | None = None,
) -> tuple[int, int]:
    """Tokenizes the documents of `inputs` into the .bin file `out`, each after the tokenizer's beginning-of-text
    token where its template puts one and before the end-of-text token, recording where each document starts
    (data.document_mask keeps them apart); (tokens, vocabulary size). `eot`, `bos`: those tokens' names (None:
    the tokenizer's; "": none); `progress` is called with the input bytes each batch covered."""
    paths = check_paths(inputs, out)
    enc = Encoder(tokenizer, eot, bos)
    writer = TokenWriter(out, enc.vocab, samples=True)

    text = [0]  # the documents' own tokens

    def flush(batch: list[tuple[str, bool, bool]]):  # (piece, begins a document, ends it)
        ids = enc.encode_batch([t for t, _, _ in batch])
        for (_, first, last), part in zip(batch, ids):
            text[0] += len(part)
            writer.add(enc.bos + part if first else part, start=first)
            if last and enc.eot is not None:
                writer.add([enc.eot])

    try:
        batch, chars, done = [], 0, 0
        for p in paths:
            for pieces, nbytes in documents(p, text_field):
                piece, first = next(pieces, ""), True
                while True:  # a piece and the next: whether it ends the document
                    ahead = next(pieces, None)
                    batch.append((piece, first, ahead is None))
                    chars += len(piece)
                    if chars >= BATCH_CHARS:
                        flush(batch)
                        batch, chars = [], 0
                    if ahead is None:
                        break
                    piece, first = ahead, False
                done += nbytes
                if not batch:
                    progress(done)
                    done = 0
        flush(batch)
        progress(done)
        if writer.count < 2 or not text[0]:  # not one token to predict from another: no run could use it
            raise DataError(
                f"{', '.join(inputs)} holds no text to train on ({text[0]} token"
                f"{'' if text[0] == 1 else 's'}); pass documents with text in them"
            )
    except BaseException:
        writer.abort()
        raise
    return writer.close(), enc.vocab
