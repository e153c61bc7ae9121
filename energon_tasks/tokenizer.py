"""Tokenizers of the task encoders: the real one by hub id / path, and a tiny local one for tests.

This module owns how a tokenizer is obtained (``load_tokenizer``, which checks the special tokens
of the model family) and the test tokenizer (``build_test_tokenizer``): a byte-level BPE trained on
a few strings, with the Qwen special tokens (ids 0-6) and the Nemotron-Omni ones (``<img>``,
``</img>``, ``<image>``, appended after training: ids 418-420, 421 tokens in all), saved as a
folder ``transformers.AutoTokenizer`` loads without any network access. One test tokenizer serves
both families.
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
#: The special tokens the Nemotron-Omni encoder needs: the ChatML markers and the image span
#: markers / context token of transformers' ``NemotronH_Omni_Reasoning_V3Processor`` (videos use
#: ``<image>`` too: the tokenizer has no video context token).
NEMOTRON_OMNI_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<img>", "</img>", "<image>")
#: Special tokens a tokenizer must have, per model family (``energon_tasks.geometry.model_family``).
SPECIAL_TOKENS = {"qwen-vl": QWEN_SPECIAL_TOKENS, "nemotron-omni": NEMOTRON_OMNI_SPECIAL_TOKENS}

_TRAINING_TEXT = [
    "user\nassistant\nsystem\nYou are a helpful assistant.",
    "What is shown in the image? Describe the video in detail. Which bird has a longer beak?",
    "The left one. The right image shows two dogs. Yes. No. The answer is 42 percent.",
    "<0.5 seconds> <1.0 seconds> <12.3 seconds> 0123456789 .,:;!?()[]{}'\"-+*/=%$#@&",
]


def load_tokenizer(name_or_path: str, model: str | None = None):
    """The tokenizer of a model for real runs (``AutoTokenizer.from_pretrained``).

    Args:
        name_or_path: hub id (e.g. ``Qwen/Qwen2.5-VL-7B-Instruct``) or a local folder.
        model: the ``TaskEncoderConfig.model`` whose family's special tokens are checked
            (``SPECIAL_TOKENS``); None checks the Qwen ones.

    Raises:
        ValueError: the id / folder cannot be loaded (one line: transformers' first line), the
            tokenizer lacks one of the family's special tokens, or an unknown model.
    """
    from transformers import AutoTokenizer

    from energon_tasks.geometry import model_family

    required = SPECIAL_TOKENS[model_family(model) if model else "qwen-vl"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"cannot load tokenizer {name_or_path!r}: {first} (pass a local "
                         "tokenizer folder or a reachable hub id)") from None
    vocab = tokenizer.get_vocab()
    missing = [token for token in required if token not in vocab]
    if missing:
        raise ValueError(f"tokenizer {name_or_path!r} lacks special tokens {missing}")
    return tokenizer


def build_test_tokenizer(directory: str | Path, *, vocab_size: int = 600) -> Path:
    """Train a small byte-level BPE with the Qwen and Nemotron-Omni special tokens; save it for
    AutoTokenizer.

    The Qwen tokens are the trainer's (ids 0-6, so Qwen tokenization is the same as before the
    Nemotron tokens existed); the Nemotron-only ones are appended after training (ids after the
    merges: 418, 419, 420 for ``<img>``, ``</img>``, ``<image>`` with the default training text).

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
    extra = [t for t in NEMOTRON_OMNI_SPECIAL_TOKENS if t not in QWEN_SPECIAL_TOKENS]
    tokenizer.add_special_tokens(extra)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[*QWEN_SPECIAL_TOKENS[1:], *extra],
    )
    wrapped.save_pretrained(str(directory))
    return directory
