"""Tokenizers of the task encoders: the real one by hub id / path, and a tiny local one for tests.

This module owns how a tokenizer is obtained (``load_tokenizer``) and the test tokenizer
(``build_test_tokenizer``): a byte-level BPE trained on a few strings, with the Qwen special tokens,
saved as a folder ``transformers.AutoTokenizer`` loads without any network access.
"""

from __future__ import annotations

from pathlib import Path

#: The special tokens the Qwen-VL ChatML template uses, in the order they are added.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

_TRAINING_TEXT = [
    "user\nassistant\nsystem\nYou are a helpful assistant.",
    "What is shown in the image? Describe the video in detail. Which bird has a longer beak?",
    "The left one. The right image shows two dogs. Yes. No. The answer is 42 percent.",
    "<0.5 seconds> <1.0 seconds> <12.3 seconds> 0123456789 .,:;!?()[]{}'\"-+*/=%$#@&",
]


def load_tokenizer(name_or_path: str):
    """The tokenizer of a model for real runs (``AutoTokenizer.from_pretrained``).

    Args:
        name_or_path: hub id (e.g. ``Qwen/Qwen2.5-VL-7B-Instruct``) or a local folder.

    Raises:
        ValueError: the tokenizer lacks one of the Qwen special tokens.
        OSError: the id / folder cannot be loaded (transformers' error).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    vocab = tokenizer.get_vocab()
    missing = [token for token in QWEN_SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise ValueError(f"tokenizer {name_or_path!r} lacks special tokens {missing}")
    return tokenizer


def build_test_tokenizer(directory: str | Path, *, vocab_size: int = 600) -> Path:
    """Train a small byte-level BPE with the Qwen special tokens and save it for AutoTokenizer.

    Args:
        directory: output folder (created; files overwritten).
        vocab_size: target vocabulary size including the 256 byte symbols.

    Returns:
        The folder, loadable with ``load_tokenizer(str(folder))``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(QWEN_SPECIAL_TOKENS[1:]),
    )
    wrapped.save_pretrained(str(directory))
    return directory
