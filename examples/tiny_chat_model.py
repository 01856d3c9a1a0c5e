"""A tiny chat model to try fine-tuning on conversations offline: `python examples/tiny_chat_model.py DIR` writes a
randomly initialized Llama (2 blocks, hidden size 64) and a byte-level BPE tokenizer trained on
examples/conversations.jsonl, with a ChatML chat template like Qwen2.5's, as a Hugging Face directory. It stands in
for a released model's directory (`hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`) in the
README's example; the tests build their tokenizers with it too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML as Qwen2.5 renders it (without its default system prompt and tools): no {% generation %} blocks, so
# `prepare --chat` finds the assistant's tokens by rendering each conversation's prefixes
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# the same rendering with the assistant's content and its <|im_end|> in {% generation %} blocks (as TRL's training
# templates mark them): transformers' return_assistant_tokens_mask gives the marks
CHATML_TRAINING = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CONVERSATIONS = Path(__file__).with_name("conversations.jsonl")


def chat_tokenizer(texts: list[str], template: str = CHATML, vocab_size: int = 400):
    """A byte-level BPE trained on `texts` (any text encodes), ChatML's special tokens, `template` its chat
    template: a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets: the characters each token covers
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    return hf


def conversation_texts(path: Path = CONVERSATIONS) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [m["content"] for line in lines if line.strip() for m in json.loads(line)["messages"]]


def tiny_llama(vocab_size: int, eos: int, pad: int, seed: int = 0):
    """A random LlamaForCausalLM in fp32: GQA 4/2, 2 blocks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    return LlamaForCausalLM(cfg).float()


def main(out: str) -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()
    tok = chat_tokenizer(conversation_texts())
    model = tiny_llama(len(tok), tok.eos_token_id, tok.pad_token_id)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(
        f"wrote {out}: a tiny random Llama ({sum(p.numel() for p in model.parameters()):,} parameters) and its chat tokenizer"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/tiny_chat_model.py OUT_DIR")
    main(sys.argv[1])
