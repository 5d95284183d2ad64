"""Build the small byte-level BPE tokenizer shipped in ``assets/tiny-tokenizer``.

    python tools/make_tiny_tokenizer.py [--out assets/tiny-tokenizer] [--vocab 512]

Deterministic: trained on text generated here (the demo's arithmetic task plus some English), with
digits split one per token, ChatML special tokens and a ChatML chat template, so that
``AutoTokenizer.from_pretrained(out)`` and ``apply_chat_template`` work offline.
"""
from __future__ import annotations

import argparse
import os
import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# reasoning tags: added tokens that stay in decoded text (not special), as in Qwen3
THINK_TAGS = ["<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ENGLISH = """
The quick brown fox jumps over the lazy dog. Reinforcement learning trains a policy to maximise a
reward. A model reads a question, thinks step by step, and writes the final answer in a box.
Solve the problem and put your final answer within \\boxed{}. Natalia sold clips to 48 of her
friends in April, and then she sold half as many clips in May. How many clips did Natalia sell
altogether in April and May? Weng earns 12 dollars an hour for babysitting. Yesterday, she just did
50 minutes of babysitting. How much did she earn? The answer is #### 72. You are a helpful
assistant. Let us compute the sum, the difference and the product of two numbers.
"""


def corpus(seed: int = 0, n: int = 4000):
    from megaforge.data.synthetic import arithmetic_rows

    for row in arithmetic_rows(n, seed=seed, max_operand=99, ops="+-*"):
        yield row["prompt"]
        yield row["response"]
    for _ in range(20):
        yield ENGLISH


def build(vocab: int = 512) -> Tokenizer:
    """BPE of ``vocab - 2`` entries, then the two reasoning tags: ``vocab`` ids in all."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(THINK_TAGS),
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TAGS])
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/tiny-tokenizer")
    ap.add_argument("--vocab", type=int, default=512)
    args = ap.parse_args()
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build(args.vocab),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(args.out, exist_ok=True)
    fast.save_pretrained(args.out)
    print(f"wrote {args.out}: vocab {len(fast)}")


if __name__ == "__main__":
    random.seed(0)
    main()
