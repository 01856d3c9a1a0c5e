"""Fine-tuning on conversations: `prepare --chat` marks the assistant's tokens as transformers'
return_assistant_tokens_mask does (a template with {% generation %} blocks, and one without, by its prefixes), a
run's loss on them is transformers' with labels -100 on the rest, one step on every conversation is transformers +
torch.optim.AdamW, `--init-from` without --config takes fine-tuning settings, and the README's example runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, chat_example, chat_tokenizer_dir, cli, refused
from tiertrain.chat import prepare_chat
from tiertrain.config import load_config
from tiertrain.errors import DataError
from tiertrain.metrics import read_metrics
from tiertrain.optim.adamw import lr_at
from tiertrain.rows import Packed
from tiertrain.tokenfile import open_tokens
from tiertrain.trainer import Trainer

transformers = pytest.importorskip("transformers")
EX = chat_example()
TEMPLATES = {"generation blocks": EX.CHATML_TRAINING, "no generation blocks": EX.CHATML}
# beside the example's: contents whose first characters merge with the header's newline into one token, an empty
# turn, trailing spaces, a tool message, a conversation without the assistant
TRICKY = [
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "\n\nThe capital of France is Paris."},
    ],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "And of Germany?  "},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "well?"},
        {"role": "assistant", "content": "Berlin.  \n"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ],
    [{"role": "user", "content": "nobody answers"}],
]


def _conversations(path) -> list[list[dict]]:
    lines = EX.CONVERSATIONS.read_text().splitlines()
    convs = [json.loads(x)["messages"] for x in lines] + TRICKY
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return convs


def _marks(convs) -> list[tuple[list[int], list[int]]]:
    """transformers' own: apply_chat_template(..., return_assistant_tokens_mask=True) with the blocks' template."""
    tok = EX.chat_tokenizer(EX.conversation_texts(), EX.CHATML_TRAINING)
    out = [tok.apply_chat_template(c, return_dict=True, return_assistant_tokens_mask=True) for c in convs]
    return [(o["input_ids"], o["assistant_masks"]) for o in out]


@pytest.mark.parametrize("template", TEMPLATES)
def test_prepare_chat_marks_the_assistants_tokens_as_transformers_does(tmp_path, template):
    convs = _conversations(tmp_path / "c.jsonl")
    tok = chat_tokenizer_dir(tmp_path / "tok", TEMPLATES[template])
    report = prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c.bin"), str(tok))
    assert ("generation %} blocks" in report.method) and (
        ("prefixes" in report.method) == (template[:2] == "no")
    )
    tf = open_tokens(tmp_path / "c.bin")
    want = [m for m in _marks(convs) if sum(m[1][1:])]
    assert report.samples == len(want) == len(convs) - 1 and report.untrained == 1  # the unanswered one
    ends = np.append(tf.starts[1:], len(tf.tokens))
    for (ids, mask), a, e in zip(want, tf.starts, ends):
        assert tf.tokens[a:e].tolist() == ids and tf.mask[a:e].tolist() == mask
    assert report.trained == sum(sum(m[1:]) for _, m in want) and report.tokens == len(tf.tokens)


def _hf_step(hf_dir, convs, cfg) -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' mean loss over every assistant target of the conversations (labels -100 elsewhere,
    num_items_in_batch over all of them, each conversation run alone), then clip_grad_norm_ and one
    torch.optim.AdamW step at the run's first learning rate: (the loss, the weights after)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    marks = [m for m in _marks(convs) if sum(m[1][1:])]
    labels = [torch.tensor([i if k else -100 for i, k in zip(ids, mask)]) for ids, mask in marks]
    n = sum(int((lab[1:] != -100).sum()) for lab in labels)
    total = 0.0
    for (ids, _), lab in zip(marks, labels):
        out = model(input_ids=torch.tensor([ids]), labels=lab[None], num_items_in_batch=n, use_cache=False)
        out.loss.backward()
        total += out.loss.item()
    o = cfg.optim
    torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    params = dict(model.named_parameters())  # decay on 2+ dims but biases, as tiertrain's
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in params.items() if p.ndim >= 2 and not n.endswith("bias")],
                "weight_decay": o.weight_decay,
            },
            {
                "params": [p for n, p in params.items() if p.ndim < 2 or n.endswith("bias")],
                "weight_decay": 0.0,
            },
        ],
        lr=lr_at(0, o, cfg.train.steps),
        betas=tuple(o.betas),
        eps=o.eps,
    )
    opt.step()
    return total, {k: v.detach() for k, v in model.state_dict().items()}


def _hf_model(tmp_path, tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = EX.tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id)
    with torch.no_grad():  # norms off one, so that their gradients are tested
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def _rows(path, seq_len: int) -> int:
    tf = open_tokens(path)
    return Packed(tf.tokens, tf.starts, tf.mask, seq_len, "").rows


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_masked_loss_is_transformers_loss(tmp_path, template):
    """One step on every conversation (packed into rows of 256) from an imported transformers Llama: the loss is
    transformers' with labels -100 on the untrained tokens, the weights after are torch.optim.AdamW's."""
    convs = _conversations(tmp_path / "c.jsonl")
    tok = chat_tokenizer_dir(tmp_path / "tok", TEMPLATES[template])
    hf = _hf_model(tmp_path, tok)
    prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c.bin"), str(tok))
    rows = _rows(tmp_path / "c.bin", 256)
    sets = [f'train.init_from="{hf}"', f'data.path="{tmp_path / "c.bin"}"', "train.seq_len=256"]
    sets += [
        f"train.batch_size={rows}",
        "train.micro_batch_size=1",
        "train.steps=1",
        'train.compute_dtype="float32"',
    ]
    cfg = load_config("finetune", [*sets, 'train.device="cpu"', "data.shuffle=false"])
    tr = Trainer(cfg)
    loss = tr.train_step()["loss"]
    got = tr.state_dict()
    tr.close()
    want, weights = _hf_step(hf, convs, cfg)
    assert loss == pytest.approx(want, rel=1e-6)
    for name, w in weights.items():
        assert _rel(got[name], w) < 1e-6, name


def test_prepare_then_run_init_from_is_one_adamw_step_on_every_conversation(tmp_path):
    """The contract as a user runs it: `prepare --chat --tokenizer`, then `run --init-from` (no --config: the
    fine-tuning settings) on the prepared file with a batch of every row; metrics.jsonl's loss is the mean
    cross-entropy over all assistant targets and the exported weights are torch.optim.AdamW's after it."""
    convs = _conversations(tmp_path / "c.jsonl")
    hf = _hf_model(tmp_path, chat_tokenizer_dir(tmp_path / "tok", EX.CHATML))
    r = cli(
        "prepare",
        str(tmp_path / "c.jsonl"),
        "--chat",
        "--tokenizer",
        str(hf),
        "--out",
        str(tmp_path / "c.bin"),
    )
    assert r.returncode == 0 and "rendering each conversation's prefixes" in r.stdout, r.stderr
    assert "1 skipped: no token to train" in r.stdout
    rows = _rows(tmp_path / "c.bin", 512)
    sets = [
        f'data.path="{tmp_path / "c.bin"}"',
        "train.seq_len=512",
        f"train.batch_size={rows}",
        "train.steps=1",
    ]
    sets += ['train.compute_dtype="float32"', 'train.device="cpu"']
    args = [a for s in sets for a in ("--set", s)]
    r = cli("run", "--init-from", str(hf), *args, "--out", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert (
        "1 rows packing" not in r.stdout and f"{rows} rows packing its {len(convs) - 1} samples" in r.stdout
    )
    r = cli("export", str(tmp_path / "run"), "--to", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    cfg = load_config(str(tmp_path / "run" / "config.toml"))
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.weight_decay, cfg.optim.betas) == (
        1e-5,
        0.0,
        0.0,
        [0.9, 0.999],
    )
    want, weights = _hf_step(hf, convs, cfg)
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[0]["loss"] == pytest.approx(want, rel=1e-5)
    got = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.float32
    ).state_dict()
    for name, w in weights.items():
        assert _rel(got[name], w) < 1e-5, name


# a template that renders the last assistant turn as no other (as Qwen3's own does with its thinking)
REWRITES = EX.CHATML.replace(
    "'<|im_start|>' + message['role']", "'<|im_start|>' + message['role'] + (' last' if loop.last else '')"
)


def test_what_prepare_chat_cannot_do_is_one_line(tmp_path):
    _conversations(tmp_path / "c.jsonl")
    out = str(tmp_path / "c.bin")

    def chat(name: str, tokenizer, *more: str):
        return cli(
            "prepare", str(tmp_path / name), "--chat", "--tokenizer", str(tokenizer), "--out", out, *more
        )

    refused(cli("prepare", str(tmp_path / "c.jsonl"), "--chat", "--out", out), "--chat needs --tokenizer")
    tok = chat_tokenizer_dir(tmp_path / "tok", REWRITES)
    refused(chat("c.jsonl", tok), "c.jsonl:1", "not prefix-preserving", "--chat-template")
    (tmp_path / "t.jinja").write_text(EX.CHATML_TRAINING)  # the remedy it names
    r = chat("c.jsonl", tok, "--chat-template", str(tmp_path / "t.jinja"))
    assert r.returncode == 0 and "{% generation %} blocks" in r.stdout, r.stderr
    (tmp_path / "bad.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "a"}]}\n{"messages": "hello"}\n'
    )
    refused(chat("bad.jsonl", tok), "bad.jsonl:2", "--messages-field")
    refused(cli("prepare", str(tmp_path / "c.jsonl"), "--seq-len", "64", "--out", out), "only with --chat")
    shutil.copy(tok / "tokenizer.json", tmp_path / "tokenizer.json")  # a tokenizer without a chat template
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"})
    )
    refused(chat("c.jsonl", tmp_path), "no chat template")
    # a tokenizer.json this tokenizers cannot read (a newer version's model type): tokenizers' own error, one line
    damaged = json.loads((tok / "tokenizer.json").read_text())
    damaged["model"]["type"] = "BPE2"
    (tmp_path / "tokenizer.json").write_text(json.dumps(damaged))
    refused(chat("c.jsonl", tmp_path), "no tokenizer could be loaded")
    given = str(tmp_path / "tokenizer.json")  # the file given is named, not its directory
    refused(chat("c.jsonl", given), f"{given}: no tokenizer could be loaded")
    (tmp_path / "none.jsonl").write_text("\n")  # was told none of its conversations has a token to train
    refused(chat("none.jsonl", tok), "none.jsonl holds no conversation")
    (tmp_path / "empty.jinja").write_text("\n")  # was told the tokenizer "has no chat template"
    refused(chat("c.jsonl", tok, "--chat-template", str(tmp_path / "empty.jinja")), "empty.jinja is empty")
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["c.bin"]  # the one that succeeded


def test_conversations_longer_than_a_row_are_cut_or_skipped_and_counted(tmp_path):
    convs = _conversations(tmp_path / "c.jsonl")
    tok = chat_tokenizer_dir(tmp_path / "tok", EX.CHATML)
    lengths = [len(ids) for ids, m in _marks(convs) if sum(m[1:])]
    over = sum(n > 41 for n in lengths)
    cut = prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "t.bin"), str(tok), seq_len=40)
    skip = prepare_chat(
        [str(tmp_path / "c.jsonl")], str(tmp_path / "s.bin"), str(tok), seq_len=40, too_long="skip"
    )
    assert 0 < over < len(lengths)
    assert skip.too_long == over and skip.samples == len(lengths) - over and skip.truncated == 0
    assert cut.truncated + cut.untrained - 1 == over and cut.samples + cut.untrained == len(convs)
    assert "truncated to a row of 41 tokens (--seq-len 40)" in " ".join(cut.lines("t.bin"))
    tf = open_tokens(tmp_path / "t.bin")
    assert np.diff(np.append(tf.starts, len(tf.tokens))).max() == 41
    with pytest.raises(DataError, match="longer than a row of train.seq_len = 32.*--seq-len 32"):
        Packed(tf.tokens, tf.starts, tf.mask, 32, "t.bin")


def _readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(
        r"<!-- the conversations example: tests/test_chat.py runs it -->\n```bash\n(.*?)```", text, re.S
    )
    assert m, "README's conversations example"
    return m.group(1)


def test_the_readme_conversations_example_runs_as_written(tmp_path):
    """The README's fine-tuning example on a conversation file, line by line, in a copy of the repository's
    examples/ (pip lines skipped: the environment has what they install)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, mod in (("tiertrain", "-m tiertrain "), ("python", "")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {sys.executable} {mod}"$@"\n')
        (bin_dir / name).chmod(0o755)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
    }
    script = "\n".join(x for x in _readme_block().splitlines() if not x.startswith("pip "))
    r = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = read_metrics(next(tmp_path.glob("runs/*/metrics.jsonl")))
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5


def test_named_chat_templates_render_with_default_or_the_one_named(tmp_path):
    """A tokenizer with several named templates (transformers loads them as a dict): prepare renders with the one
    named "default", as transformers does, or with the one --chat-template names; without a default, or with a
    name it lacks, one line lists the names."""
    convs = _conversations(tmp_path / "c.jsonl")
    plain = prepare_chat(
        [str(tmp_path / "c.jsonl")],
        str(tmp_path / "plain.bin"),
        str(chat_tokenizer_dir(tmp_path / "tok", EX.CHATML)),
    )
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    tok.chat_template = {"default": EX.CHATML, "training": EX.CHATML_TRAINING}
    tok.save_pretrained(tmp_path / "named")
    assert isinstance(transformers.AutoTokenizer.from_pretrained(tmp_path / "named").chat_template, dict)
    by_default = prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "d.bin"), str(tmp_path / "named"))
    by_name = prepare_chat(
        [str(tmp_path / "c.jsonl")],
        str(tmp_path / "n.bin"),
        str(tmp_path / "named"),
        chat_template="training",
    )
    assert by_default.samples == by_name.samples == plain.samples and len(convs) > plain.samples
    want = open_tokens(tmp_path / "plain.bin")
    for name in ("d.bin", "n.bin"):
        got = open_tokens(tmp_path / name)
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.mask, want.mask), name
    with pytest.raises(
        DataError, match="cannot read it .*or one of .*named templates \\(default, training\\)"
    ):
        prepare_chat(
            [str(tmp_path / "c.jsonl")],
            str(tmp_path / "x.bin"),
            str(tmp_path / "named"),
            chat_template="tools",
        )
    tok.chat_template = {"tools": EX.CHATML, "training": EX.CHATML_TRAINING}
    tok.save_pretrained(tmp_path / "nodefault")
    with pytest.raises(
        DataError, match="named chat templates \\(tools, training\\) and none is named default"
    ):
        prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "y.bin"), str(tmp_path / "nodefault"))
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["d.bin", "n.bin", "plain.bin"]


def test_flags_prepare_would_ignore_are_refused(tmp_path):
    """A flag that would do nothing in this command says so in one line, before anything is written: the
    documents' --eot and --text-field with --chat, --too-long without --seq-len, --messages-field without --chat."""
    _conversations(tmp_path / "c.jsonl")
    out = str(tmp_path / "c.bin")
    chat = [
        "prepare",
        str(tmp_path / "c.jsonl"),
        "--chat",
        "--tokenizer",
        str(tmp_path / "tok"),
        "--out",
        out,
    ]
    refused(cli(*chat, "--eot", "<|endoftext|>"), "--eot: only for documents, not with --chat")
    refused(cli(*chat, "--text-field", "text"), "--text-field: only for documents")
    refused(cli(*chat, "--too-long", "skip"), "--too-long skip: only with --seq-len")
    refused(
        cli("prepare", str(tmp_path / "c.jsonl"), "--messages-field", "m", "--out", out),
        "--messages-field: only with --chat",
    )
    assert not list(tmp_path.glob("*.bin"))


# Phi-3's ending: the end-of-text token after the last message, where no generation prompt follows
ENDED = "{%- if not add_generation_prompt %}{{- eos_token }}{%- endif %}"


def test_a_template_that_ends_the_conversation_with_eos_marks_every_turn(tmp_path):
    """A template that puts eos_token after the last message only (Phi-3's): each turn's render up to an
    assistant message ends with it and the whole conversation's goes on, so the prefixes differ there. The
    assistant's tokens are marked as transformers marks them with the same template in {% generation %} blocks,
    multi-turn conversations included; the closing eos_token is not a turn's."""
    convs = _conversations(tmp_path / "c.jsonl")
    tok = chat_tokenizer_dir(tmp_path / "tok", EX.CHATML + ENDED)
    report = prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c.bin"), str(tok))
    assert "prefixes" in report.method
    ref = EX.chat_tokenizer(EX.conversation_texts(), EX.CHATML_TRAINING + ENDED)
    want = [ref.apply_chat_template(c, return_dict=True, return_assistant_tokens_mask=True) for c in convs]
    want = [(o["input_ids"], o["assistant_masks"]) for o in want if sum(o["assistant_masks"][1:])]
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in convs)  # several turns, each checked
    tf = open_tokens(tmp_path / "c.bin")
    assert report.samples == len(want)
    for (ids, mask), a, e in zip(want, tf.starts, np.append(tf.starts[1:], len(tf.tokens))):
        assert (
            ids[-1] == ref.eos_token_id and tf.tokens[a:e].tolist() == ids and tf.mask[a:e].tolist() == mask
        )


# gpt-oss's turns (its released template, tools and thinking left out): the last assistant turn ends with its own
# <|return|>, which the template writes as <|end|> where the conversation goes on
HARMONY = (
    "{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|start|>assistant' }}"
    "{%- if loop.last and not add_generation_prompt -%}"
    "{%- generation -%}{{- '<|channel|>final<|message|>' + m.content + '<|return|>' }}{%- endgeneration -%}"
    "{%- else -%}{%- generation -%}{{- '<|channel|>final<|message|>' + m.content }}{%- endgeneration -%}"
    "{{- '<|end|>' }}{%- endif -%}"
    "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def test_a_template_whose_last_turn_ends_with_its_own_eos_trains_it(tmp_path):
    """gpt-oss: eos_token <|return|> ends the last assistant turn (the model learns to stop), and the template
    writes <|end|> there where the conversation goes on. The <|return|> is trained, with or without earlier turns,
    as transformers marks it with the same template in {% generation %} blocks; the history's <|end|> is not a
    token the model emits after a final answer, and is not trained."""
    convs = _conversations(tmp_path / "c.jsonl")
    specials = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>"]
    toks = []
    for name, template in (("tok", re.sub(r"\{%- (end)?generation -%\}", "", HARMONY)), ("ref", HARMONY)):
        t = EX.chat_tokenizer(EX.conversation_texts(), template)
        t.add_special_tokens({"eos_token": "<|return|>", "additional_special_tokens": specials})
        t.save_pretrained(tmp_path / name)
        toks.append(t)
    report = prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c.bin"), str(tmp_path / "tok"))
    assert "prefixes" in report.method
    want = [
        toks[1].apply_chat_template(c, return_dict=True, return_assistant_tokens_mask=True) for c in convs
    ]
    want = [(o["input_ids"], o["assistant_masks"]) for o in want if sum(o["assistant_masks"][1:])]
    assert any(sum(m["role"] == "assistant" for m in c) > 1 for c in convs)
    tf = open_tokens(tmp_path / "c.bin")
    assert report.samples == len(want)
    ret = toks[1].convert_tokens_to_ids("<|return|>")
    for (ids, mask), a, e in zip(want, tf.starts, np.append(tf.starts[1:], len(tf.tokens))):
        assert ids[-1] == ret and mask[-1] == 1
        assert tf.tokens[a:e].tolist() == ids and tf.mask[a:e].tolist() == mask


# the example's ChatML, with the tools' schemas in a system turn and a template variable, as Qwen's templates take
TOOLS_HEAD = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- if terse %}{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_records_tools_and_template_variables_are_rendered_as_trl_renders_them(tmp_path, template):
    """A record's `tools` and `chat_template_kwargs` were dropped: a tool-calling conversation trained without the
    schemas its model sees at inference. TRL's SFTTrainer passes both to apply_chat_template (a JSON string of
    tools decoded); so does prepare --chat, each record its own, in a file with records without them."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    conv = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Sunny."}]
    recs = [
        {"messages": conv, "tools": tools},
        {"messages": conv, "tools": json.dumps(tools), "chat_template_kwargs": {"terse": True}},
        {"messages": conv},
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = chat_tokenizer_dir(tmp_path / "tok", TOOLS_HEAD + TEMPLATES[template])
    prepare_chat([str(tmp_path / "c.jsonl")], str(tmp_path / "c.bin"), str(tok))
    tf = open_tokens(tmp_path / "c.bin")
    ref = EX.chat_tokenizer(EX.conversation_texts(), TOOLS_HEAD + EX.CHATML_TRAINING)
    ends = np.append(tf.starts[1:], len(tf.tokens))
    for a, e, kw in zip(tf.starts, ends, [{"tools": tools}, {"tools": tools, "terse": True}, {}]):
        want = ref.apply_chat_template(conv, return_dict=True, return_assistant_tokens_mask=True, **kw)
        assert (
            tf.tokens[a:e].tolist() == want["input_ids"] and tf.mask[a:e].tolist() == want["assistant_masks"]
        )
    assert "Tools: " in ref.decode(tf.tokens[: ends[0]].tolist()) and len(tf.starts) == 3
    import pyarrow as pa
    import pyarrow.parquet as pq

    # a parquet file's columns: tools as JSON strings (a datasets column holds one schema type), a null where none
    pq.write_table(
        pa.table({"messages": [conv] * 3, "tools": [json.dumps(tools), None, None]}), tmp_path / "c.pq"
    )
    (tmp_path / "c.parquet").write_bytes((tmp_path / "c.pq").read_bytes())
    prepare_chat([str(tmp_path / "c.parquet")], str(tmp_path / "p.bin"), str(tok))
    pf = open_tokens(tmp_path / "p.bin")
    assert pf.tokens[: pf.starts[1]].tolist() == tf.tokens[: ends[0]].tolist()
    assert pf.tokens[pf.starts[1] :].tolist() == 2 * tf.tokens[tf.starts[2] :].tolist()
    for bad, words in (
        ({"tools": {"a": 1}}, "'tools' is not a list"),
        ({"chat_template_kwargs": {"tokenize": 1}}, "tokenize"),
    ):
        (tmp_path / "b.jsonl").write_text(json.dumps({"messages": conv, **bad}) + "\n")
        with pytest.raises(DataError, match=words):
            prepare_chat([str(tmp_path / "b.jsonl")], str(tmp_path / "b.bin"), str(tok))
