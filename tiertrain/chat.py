"""`tiertrain prepare --chat`: conversations (.jsonl or .parquet records, each a list of {role, content} messages,
and the record's tools and template variables) rendered with the tokenizer's chat template into samples of a token
file, each token marked trained or not.

The marks are transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`: the tokens that overlap
the template's {% generation %} blocks (the assistant's turns) train. For a template without such blocks the same
marks come from rendering each conversation's prefixes: an assistant turn is the text between the render of the
messages before it with the generation prompt and the render up to it (less the whitespace after it), in characters
of the whole conversation's render, tokenized once; a token overlapping that span trains, by transformers' rule.
A template that rewrites earlier turns as later ones come (Qwen3's own) is refused: its prefixes are not its
conversation's. `--train-on-prompt` trains every token. Nothing is dropped unsaid: a conversation longer than a row
(`--seq-len`) is truncated or skipped (`--too-long`), one with nothing left to train is skipped, and both are
counted in the report.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import DataError
from .prepare import check_paths, check_vocabulary, records
from .tokenfile import TokenWriter

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test for the blocks
BATCH = 256  # conversations per tokenizer call
OPTIONS = ("tools", "chat_template_kwargs")  # a record's fields TRL's SFTTrainer renders with its messages


@dataclass
class ChatReport:
    """What `prepare --chat` wrote and left out."""

    method: str = ""
    vocab: int = 0
    tokens: int = 0
    samples: int = 0
    trained: int = 0
    truncated: int = 0  # cut to a row (--seq-len, --too-long truncate)
    too_long: int = 0  # skipped: longer than a row (--too-long skip)
    untrained: int = 0  # skipped: no token to train (no assistant turn, or none left in its first row)
    seq_len: int | None = None

    def lines(self, out: str) -> list[str]:
        left = [
            f"{self.truncated:,} truncated to a row of {self.seq_len + 1:,} tokens (--seq-len {self.seq_len})"
            if self.truncated
            else "",
            f"{self.too_long:,} skipped: longer than a row of {self.seq_len + 1:,} tokens (--seq-len "
            f"{self.seq_len}, --too-long skip)"
            if self.too_long
            else "",
            f"{self.untrained:,} skipped: no token to train" if self.untrained else "",
        ]
        return [
            f"wrote {self.tokens:,} tokens of {self.samples:,} conversations (vocabulary {self.vocab:,}) to {out}; "
            f"{self.trained:,} tokens trained: {self.method}",
            "left out: " + "; ".join(x for x in left if x) if any(left) else "nothing left out or cut",
            f'train on it with --set data.path="{out}"',
        ]


def load_tokenizer(spec: str | None, template: str | None):
    """A fast transformers tokenizer (its offsets map tokens to characters) with a chat template: a model
    directory's, or the directory of the tokenizer.json given; `template`: a Jinja file replacing its own, or the
    name of one of its named templates (default: the one named "default")."""
    if spec is None:
        raise DataError("--chat needs --tokenizer DIR: a model directory whose tokenizer has a chat template")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("--chat renders chat templates with transformers: pip install transformers") from None
    p = Path(spec)
    d = p.parent if p.is_file() else p
    if not d.is_dir():
        raise DataError(f"--tokenizer {spec} not found; pass a model directory (or its tokenizer.json)")
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - tokenizers' own errors too (a tokenizer.json a newer version wrote)
        first = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise DataError(
            f"{spec}: no tokenizer could be loaded ({type(e).__name__}: {first}); pass a model directory whose "
            "tokenizer this transformers reads"
        ) from None
    check_vocabulary(tok, d)
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"{d}: its tokenizer is not a tokenizers one (no tokenizer.json), and the assistant's tokens are "
            "found by their offsets; pass a directory with a tokenizer.json"
        )
    # several named templates (tokenizer_config.json's list, additional_chat_templates/): transformers renders
    # with "default" where none is named
    named = tok.chat_template if isinstance(tok.chat_template, dict) else {}
    names = ", ".join(sorted(named))
    if template is not None and named and template in named and not Path(template).exists():
        tok.chat_template = named[template]
    elif template is not None:
        try:
            tok.chat_template = Path(template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            also = f", or one of {d}'s named templates ({names})" if named else ""
            raise DataError(
                f"--chat-template {template}: cannot read it ({e}); pass a Jinja text file{also}"
            ) from None
        if not tok.chat_template.strip():
            raise DataError(f"--chat-template {template} is empty; pass a Jinja chat template")
    elif named:
        if "default" not in named:
            raise DataError(
                f"{d} has named chat templates ({names}) and none is named default; pick one with "
                "--chat-template NAME"
            )
        tok.chat_template = named["default"]
    if not isinstance(tok.chat_template, str) or not tok.chat_template:
        raise DataError(
            f"{d} has no chat template (tokenizer_config.json's chat_template, or chat_template.jinja); "
            "pass one with --chat-template FILE"
        )
    return tok


def _check(conv, where: str, field: str, prefixes: bool) -> list[dict]:
    if not isinstance(conv, list) or not conv or not all(isinstance(m, dict) and "role" in m for m in conv):
        raise DataError(
            f"{where}: {field!r} is not a list of messages, each with a role and a content; fix the record, or pass "
            "the field that holds the messages with --messages-field"
        )
    if prefixes and conv[0]["role"] == "assistant":
        raise DataError(
            f"{where}: the conversation begins with the assistant's turn, which has no prompt to render before "
            "it; begin it with a system or user message, or use a template with {% generation %} blocks"
        )
    return conv


def options(tok, extra: dict, where: str) -> dict:
    """The arguments of apply_chat_template a record gives beside its messages, as TRL's SFTTrainer passes them:
    its `tools` (function schemas; a JSON string is decoded) and its `chat_template_kwargs` (the template's
    variables)."""
    import inspect
    import json

    opts, tools, kw = {}, extra.get("tools"), extra.get("chat_template_kwargs", {})
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            tools = None
    if "tools" in extra and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(f"{where}: 'tools' is not a list of function schemas (JSON objects); fix the record")
    if tools:
        opts["tools"] = tools
    # its own arguments (tokenize, tools, ...), read only for a record that gives variables
    taken = (
        set(inspect.signature(tok.apply_chat_template).parameters) if isinstance(kw, dict) and kw else set()
    )
    if not isinstance(kw, dict) or taken & set(kw):
        raise DataError(
            f"{where}: 'chat_template_kwargs' must be a table of the template's variables (enable_thinking, ...), "
            f"none of apply_chat_template's own arguments ({', '.join(sorted(taken & set(kw))) or 'not a table'})"
        )
    return {**opts, **kw}


def _render(tok, messages: list[dict], where: str, prompt: bool = False, opts: dict | None = None) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt, **(opts or {}))
    except Exception as e:  # noqa: BLE001 - jinja2 raises its own errors from a template's own code
        raise DataError(f"{where}: the chat template failed on it ({type(e).__name__}: {e})") from None


def spans_to_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters overlap a span (transformers' rule, spans in order)."""
    mask, k = [0] * len(offsets), 0
    for t, (a, e) in enumerate(offsets):
        while k < len(spans) and a >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if e > spans[k][0]:
            mask[t] = 1
    return mask


def assistant_spans(tok, conv: list[dict], where: str, opts: dict) -> tuple[str, list[tuple[int, int]]]:
    """(the conversation's render, the character span of each assistant turn): by rendering its prefixes."""
    full = _render(tok, conv, where, opts=opts)
    spans = []
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = _render(tok, conv[:i], where, prompt=True, opts=opts)
        upto = _ended(
            tok, conv[: i + 1], _render(tok, conv[: i + 1], where, opts=opts), full, before, where, opts
        )
        if not (full.startswith(before) and upto.startswith(before) and full.startswith(upto)):
            raise DataError(
                f"{where}: the chat template is not prefix-preserving (message {i}, the assistant's: the render of "
                "the messages before it is not the start of the conversation's), so the assistant's tokens cannot "
                "be told from it; pass --chat-template FILE with {% generation %} blocks (TRL ships training "
                "templates)"
            )
        end = len(before) + len(upto[len(before) :].rstrip())  # the separator after the turn is not trained
        if end > len(before):
            spans.append((len(before), end))
    return full, spans


def _ended(tok, conv: list[dict], render: str, full: str, before: str, where: str, opts: dict) -> str:
    """The render of `conv` (up to an assistant's turn) as the turn is trained: without an end-of-text token that
    is not the turn's. Phi-3's templates put `eos_token` after the last message whatever its role, where no
    generation prompt follows: it closes the conversation, and is never trained. gpt-oss's ends its last turn
    with its own `<|return|>` (trained: the model learns to stop), which it writes as `<|end|>` where the
    conversation goes on: such a turn is trained up to it. `before`: the render of the messages before the turn
    with the generation prompt."""
    eos = getattr(tok, "eos_token", None)
    body = render.rstrip()
    if not eos or not body.endswith(eos):
        return render
    cut = body[: -len(eos)]
    if _closing(tok, conv[:-1], eos, before, where, opts) or (
        not full.startswith(body) and full.startswith(cut)
    ):
        return cut
    return render


def _closing(tok, conv: list[dict], eos: str, prompted: str, where: str, opts: dict) -> bool:
    """Whether the template ends `conv` (the messages before an assistant's turn; `prompted`: their render with the
    generation prompt) with an `eos` that the prompt replaces: one that closes the conversation (Phi-3's), not a
    message's own (Llama 3's <|eot_id|>)."""
    body = _render(tok, conv, where, opts=opts).rstrip()
    return body.endswith(eos) and prompted.startswith(body[: -len(eos)]) and not prompted.startswith(body)


def encode(
    tok, convs: list[list[dict]], opts: list[dict], wheres: list[str], how: str
) -> list[tuple[list[int], list[int]]]:
    """Each conversation's (token ids, marks): `how` "generation" (the template's blocks), "prefixes" or "all";
    `opts`: each one's arguments of apply_chat_template (`options`)."""
    if how == "generation" and any(opts) and len(convs) > 1:  # one call takes one set of tools
        return [x for c, o, w in zip(convs, opts, wheres) for x in encode(tok, [c], [o], [w], how)]
    if how == "generation":
        try:
            out = tok.apply_chat_template(
                convs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **opts[0]
            )
        except Exception as e:  # noqa: BLE001 - a template's error: the conversation that raised it, if one does
            for conv, o, where in zip(convs, opts, wheres):
                _render(tok, conv, where, opts=o)
            raise DataError(
                f"{wheres[0]}..{wheres[-1]}: the chat template failed ({type(e).__name__}: {e})"
            ) from None
        return list(zip(out["input_ids"], out["assistant_masks"]))
    rendered = [
        assistant_spans(tok, c, w, o) if how == "prefixes" else (_render(tok, c, w, opts=o), [])
        for c, o, w in zip(convs, opts, wheres)
    ]
    enc = tok([r for r, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    return [
        (ids, spans_to_mask(offsets, spans) if how == "prefixes" else [1] * len(ids))
        for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered)
    ]


def _add(writer: TokenWriter, report: ChatReport, ids, mask, too_long: str) -> None:
    """One conversation into the file, cut to a row or left out as asked, counted."""
    ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)
    over = report.seq_len is not None and len(ids) > report.seq_len + 1
    if over and too_long == "skip":
        report.too_long += 1
        return
    if over:
        ids, mask = ids[: report.seq_len + 1], mask[: report.seq_len + 1]
    trained = int(mask[1:].sum())  # a sample's first token is predicted from nothing
    if not trained:  # counted once: as left out
        report.untrained += 1
        return
    report.truncated += over
    writer.add(ids, mask, start=True)
    report.samples += 1
    report.trained += trained


def prepare_chat(
    inputs: list[str],
    out: str,
    tokenizer: str | None,
    messages_field: str = "messages",
    train_on_prompt: bool = False,
    seq_len: int | None = None,
    too_long: str = "truncate",
    chat_template: str | None = None,
    progress: Callable[[int], None] = lambda n: None,
) -> ChatReport:
    """The conversations of `inputs` as samples of the .bin file `out`, with their loss mask (chat.py)."""
    paths = check_paths(inputs, out)
    for p in paths:
        if p.suffix == ".txt":
            raise DataError(f"{p}: --chat reads conversations from .jsonl or .parquet records, not .txt")
    tok = load_tokenizer(tokenizer, chat_template)
    how = "all" if train_on_prompt else "generation" if GENERATION.search(tok.chat_template) else "prefixes"
    report = ChatReport(
        method={
            "all": "every token (--train-on-prompt)",
            "generation": "the assistant's, marked by the template's {% generation %} blocks",
            "prefixes": "the assistant's, found by rendering each conversation's prefixes (the template has no "
            "{% generation %} blocks)",
        }[how],
        vocab=len(tok),
        seq_len=seq_len,
    )
    writer = TokenWriter(out, report.vocab, samples=True, masked=True)
    try:
        batch, opts, wheres, done = [], [], [], 0
        for p in paths:
            for conv, extra, nbytes, where in records(
                p, messages_field, "messages", "--messages-field", OPTIONS
            ):
                batch.append(_check(conv, where, messages_field, how == "prefixes"))
                opts.append(options(tok, extra, where))
                wheres.append(where)
                done += nbytes
                if len(batch) == BATCH:
                    for ids, mask in encode(tok, batch, opts, wheres, how):
                        _add(writer, report, ids, mask, too_long)
                    batch, opts, wheres = [], [], []
                    progress(done)
                    done = 0
        for ids, mask in encode(tok, batch, opts, wheres, how) if batch else []:
            _add(writer, report, ids, mask, too_long)
        progress(done)
        if not (report.samples or report.untrained or report.too_long):
            raise DataError(
                f"{', '.join(inputs)} holds no conversation; pass a file of records with messages"
            )
        if not report.samples:
            raise DataError(
                f"no conversation of {', '.join(inputs)} has a token to train ({report.untrained} without, "
                f"{report.too_long} too long); check --messages-field and the chat template, or pass --train-on-prompt"
            )
    except BaseException:
        writer.abort()
        raise
    report.tokens = writer.close()
    return report
