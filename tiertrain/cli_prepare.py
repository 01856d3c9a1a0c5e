"""`tiertrain prepare`: documents or conversations into a token file (prepare.py, chat.py)."""

from __future__ import annotations

import contextlib
import sys

import click

from .errors import UserError


def _fail(err: Exception) -> None:
    click.echo(f"error: {err}", err=True)
    sys.exit(2)


@click.command()
@click.argument("inputs", nargs=-1, required=True, metavar="FILE...")
@click.option("--out", required=True, metavar="FILE.bin", help="Token file to write.")
@click.option(
    "--tokenizer",
    default=None,
    metavar="PATH",
    help="A Hugging Face tokenizer.json or model directory. Default: byte-level (ids 0-255, 256 ends "
    "a document).",
)
@click.option(
    "--text-field",
    default="text",
    show_default=True,
    help="The field (.jsonl) or column (.parquet) that holds each document's text.",
)
@click.option(
    "--eot",
    default=None,
    metavar="TOKEN",
    help="The token put after each document. Default: the tokenizer's end-of-text token; '' for none.",
)
@click.option(
    "--bos",
    default=None,
    metavar="TOKEN",
    help="The token put before each document. Default: the tokenizer's, where its template puts one "
    "(Llama, Mistral, Gemma; not GPT-2, Qwen), as tokenizer(text) does; '' for none.",
)
@click.option(
    "--chat",
    is_flag=True,
    help="Conversations (.jsonl, .parquet): each record's messages rendered with the --tokenizer's chat template, "
    "the assistant's tokens trained, the rest not; each a sample that trains whole and alone.",
)
@click.option(
    "--messages-field",
    default="messages",
    show_default=True,
    help="With --chat: the field or column that holds each conversation's list of {role, content} messages.",
)
@click.option("--train-on-prompt", is_flag=True, help="With --chat: train every token, the prompts' too.")
@click.option(
    "--seq-len",
    type=click.IntRange(min=1),
    default=None,
    metavar="S",
    help="With --chat: the train.seq_len to train with; a conversation longer than a row (S + 1 tokens) is "
    "truncated or skipped (--too-long), and counted. Default: none cut (a run refuses one longer than its rows).",
)
@click.option(
    "--too-long",
    type=click.Choice(["truncate", "skip"]),
    default="truncate",
    show_default=True,
    help="With --chat --seq-len: what happens to a conversation longer than a row.",
)
@click.option(
    "--chat-template",
    default=None,
    metavar="FILE|NAME",
    help="With --chat: a Jinja chat template to use instead of the tokenizer's own, or the name of one of its "
    "named templates (default: the one named default).",
)
def prepare(
    inputs: tuple[str, ...],
    out: str,
    tokenizer: str | None,
    text_field: str,
    eot: str | None,
    bos: str | None,
    chat: bool,
    messages_field: str,
    train_on_prompt: bool,
    seq_len: int | None,
    too_long: str,
    chat_template: str | None,
) -> None:
    """Tokenize documents (.txt: one per file; .jsonl: one per line; .parquet: one per row) into a token file
    for data.path; with --chat, conversations (a list of messages per record) with the assistant's tokens marked
    for training."""
    import os

    from .prepare import prepare as do_prepare
    from .signals import TermInterrupts

    try:
        if not out.endswith(".bin"):
            raise UserError(f"--out {out}: token files written by prepare end in .bin")
        ctx = click.get_current_context()

        def named(param: str) -> bool:  # given on the command line, even as its default
            return ctx.get_parameter_source(param) is not click.core.ParameterSource.DEFAULT

        given = [
            f
            for f, v in (
                ("--train-on-prompt", train_on_prompt),
                ("--seq-len", seq_len),
                ("--chat-template", chat_template),
                ("--messages-field", named("messages_field")),
            )
            if v
        ]
        if given and not chat:
            raise UserError(
                f"{', '.join(given)}: only with --chat (conversations); add --chat or leave them out"
            )
        # documents' flags: a conversation ends where its template says, and its text is its messages
        plain = [
            f
            for f, v in (
                ("--eot", eot is not None),
                ("--bos", bos is not None),
                ("--text-field", named("text_field")),
            )
            if v
        ]
        if plain and chat:
            raise UserError(
                f"{', '.join(plain)}: only for documents, not with --chat (a conversation's text and end are its "
                "template's); leave them out"
            )
        if named("text_field") and all(i.endswith(".txt") for i in inputs):
            raise UserError(
                f"--text-field {text_field}: a .txt file is one document, all text; it names the field of .jsonl "
                "or .parquet records; leave it out"
            )
        if named("too_long") and seq_len is None:
            raise UserError(
                f"--too-long {too_long}: only with --seq-len S (the rows it cuts to); add --seq-len"
            )
        total = sum(os.path.getsize(p) for p in inputs if os.path.isfile(p))
        bar = (
            click.progressbar(length=total, label="tokenizing", file=sys.stderr)
            if sys.stderr.isatty()  # a bar on a terminal; a log or a pipe gets only the result lines
            else contextlib.nullcontext(None)
        )
        with TermInterrupts(), bar as b:  # SIGTERM as Ctrl-C: the token file's temporary goes
            step = b.update if b is not None else (lambda n: None)
            if chat:
                from .chat import prepare_chat

                lines = prepare_chat(
                    list(inputs),
                    out,
                    tokenizer,
                    messages_field,
                    train_on_prompt,
                    seq_len,
                    too_long,
                    chat_template,
                    step,
                ).lines(out)
            else:
                count, vocab = do_prepare(list(inputs), out, tokenizer, text_field, eot, step, bos)
                lines = [
                    f"wrote {count:,} tokens (vocabulary {vocab:,}) to {out}; train on it with "
                    f'--set data.path="{out}"'
                ]
    except UserError as e:
        _fail(e)
    except OSError as e:  # the disk: full, read-only, not ours
        from .errors import why

        _fail(
            UserError(
                f"--out {out}: writing the token file failed ({why(e)}); pass a file on a writable disk "
                "with room"
            )
        )
    for line in lines:
        click.echo(line)
