"""Tokenizers of the task encoders: the real one by hub id / path, and a tiny local one for tests.

This module owns how a tokenizer is obtained (``load_tokenizer``, which checks the special tokens
of the model family and gives a tokenizer without a chat template the ChatML one the task encoder
writes, ``chat_template``, so checkpoints and exports carry it) and the test tokenizer
(``build_test_tokenizer``; the name ``test``): a byte-level BPE trained on a few strings, with
the Qwen special tokens (ids 0-6) and the
Nemotron-Omni ones (``<img>``, ``</img>``, ``<image>``, appended after training: ids 418-420, 421
tokens in all), saved as a folder ``transformers.AutoTokenizer`` loads without any network
access. One test tokenizer serves both families.

A hub id is looked up in the local Hugging Face cache first; only when it is not there is the
hub asked, after a quick reachability check (``hub_reachable``: a TCP connection to
``HF_ENDPOINT`` within a few seconds; ``HF_HUB_OFFLINE=1`` skips it), so an offline machine gets
a one-line error within seconds instead of transformers' retries.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlparse

from contract.families import QWEN2_5_VL
from energon_tasks.profiles import PROFILES, get_profile

_TRAINING_TEXT = [
    "user\nassistant\nsystem\nYou are a helpful assistant.",
    "What is shown in the image? Describe the video in detail. Which bird has a longer beak?",
    "The left one. The right image shows two dogs. Yes. No. The answer is 42 percent.",
    "<0.5 seconds> <1.0 seconds> <12.3 seconds> 0123456789 .,:;!?()[]{}'\"-+*/=%$#@&",
]


#: The name of the small local tokenizer (``task_encoder.tokenizer: test``).
TEST_TOKENIZER = "test"
#: What to pass instead of an unreachable hub id (appended to the error).
LOCAL_HINT = "pass a local tokenizer folder, or `test` (the small local tokenizer of the tests)"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (``HF_ENDPOINT``) accepts a TCP connection within
    ``timeout`` seconds (name resolution included); False under ``HF_HUB_OFFLINE=1``."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    address = (url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443))
    result = []

    def connect():
        try:
            socket.create_connection(address, timeout=timeout).close()
            result.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout + 0.5)
    return bool(result)


def load_tokenizer(name_or_path: str, model: str | None = None, *, hint: str = LOCAL_HINT):
    """The tokenizer of a model for real runs (``AutoTokenizer.from_pretrained``).

    Args:
        name_or_path: hub id (e.g. ``Qwen/Qwen2.5-VL-7B-Instruct``), a local folder, or ``test``
            (the test tokenizer, built in a temporary folder).
        model: the ``TaskEncoderConfig.model`` whose profile's special tokens are checked (its
            hooks' ``REQUIRED_TOKENS``); None checks those of ``qwen2_5_vl`` (the config's
            default model).
        hint: what the caller's user should pass instead of an unreachable hub id.

    Raises:
        ValueError: the id / folder cannot be loaded (one line: transformers' first line, or
            that the hub is unreachable, with ``hint``), the tokenizer lacks one of the family's
            special tokens, or an unknown model.
    """
    from transformers import AutoTokenizer

    required = get_profile(model or QWEN2_5_VL).hooks.REQUIRED_TOKENS
    if name_or_path == TEST_TOKENIZER:
        with tempfile.TemporaryDirectory() as folder:
            return load_tokenizer(str(build_test_tokenizer(folder)), model)
    try:
        if Path(name_or_path).is_dir():
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        else:
            tokenizer = _from_cache_or_hub(name_or_path)
    except (OSError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"cannot load tokenizer {name_or_path!r}: {first} ({hint}, or a "
                         "reachable hub id)") from None
    vocab = tokenizer.get_vocab()
    missing = [token for token in required if token not in vocab]
    if missing:
        raise ValueError(f"tokenizer {name_or_path!r} lacks special tokens {missing}")
    if not tokenizer.chat_template:  # the layout the task encoder trains on, so exports keep it
        tokenizer.chat_template = chat_template(model or QWEN2_5_VL)
    return tokenizer


def chat_template(model: str) -> str:
    """The ChatML chat template of the conversations the task encoder of ``model`` writes
    (``<|im_start|>role\\n ... <|im_end|>\\n``), for a tokenizer that has none (the test one):
    string contents, or lists of ``{"type": "text"}`` / ``{"type": "image"}`` /
    ``{"type": "video"}`` items, media written as the profile's hooks say
    (``CHAT_MEDIA``: where transformers' processor of the family expands them)."""
    media = get_profile(model).hooks.CHAT_MEDIA
    item = ("{%- if item['type'] == 'text' %}{{ item['text'] }}"
            + "".join(f"{{%- elif item['type'] == '{kind}' %}}{token}"
                      for kind, token in media.items())
            + "{%- endif %}")
    return ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- if message['content'] is string %}{{ message['content'] }}"
            "{%- else %}{%- for item in message['content'] %}" + item + "{%- endfor %}"
            "{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def _from_cache_or_hub(hub_id: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(hub_id, local_files_only=True)
    except (OSError, ValueError):
        pass
    if not hub_reachable():
        raise ValueError(f"not a local folder, not in the Hugging Face cache, and the hub "
                           f"({os.environ.get('HF_ENDPOINT') or 'huggingface.co'}) is "
                           "unreachable")
    return AutoTokenizer.from_pretrained(hub_id)


def build_test_tokenizer(directory: str | Path, *, vocab_size: int = 600) -> Path:
    """Train a small byte-level BPE with every profile's special tokens; save it for
    AutoTokenizer.

    The first profile's tokens (Qwen's) are the trainer's (ids 0-6, so Qwen tokenization is the
    same as before other families existed); the other profiles' tokens are appended after
    training, in registry order (Nemotron-Omni's: ids 418, 419, 420 for ``<img>``, ``</img>``,
    ``<image>`` with the default training text).

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
    first, *others = [profile.hooks.REQUIRED_TOKENS for profile in PROFILES.values()]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(first),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT * 4, trainer=trainer)
    extra = [t for t in dict.fromkeys(t for tokens in others for t in tokens) if t not in first]
    tokenizer.add_special_tokens(extra)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=[*first[1:], *extra],
    )
    wrapped.save_pretrained(str(directory))
    return directory
