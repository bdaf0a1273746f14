"""Byte-level BPE tokenizer for the embedded models, trained with Hugging Face `tokenizers`."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "[MASK]"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, IM_START, IM_END]

# ChatML, as Qwen uses; ends each assistant turn with <|im_end|>, which is also a stop token.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE and save it as a `PreTrainedTokenizerFast` in `out_dir`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast
