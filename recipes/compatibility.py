"""Whether a model and a task encoder (+ its tokenizer) belong together: the one check of
train.py, eval.py and ``model.hf``.

This module owns ``check_compatible``: the task encoder's profile must feed the model's family
(``contract.families.TASK_ENCODER_MODELS``), its patch geometry must be the model tower's
(``models.families.family_of(cfg).vision_geometry``) and, for ``model.hf``, its HF processors'
(``processor``); then, once the tokenizer is built, the token ids the model's weights were
trained with must be the tokenizer's and its vocabulary must hold the tokenizer's tokens.
``compatibility_problems`` is its first part as a list (what ``recipes.run_config`` collects
with the config's other problems); ``profile_for`` picks the task encoder of an HF model's
family. Messages name where the model comes from (``weights``: ``checkpoint X``,
``model.hf X``; nothing for a model built from the run config).
"""

from __future__ import annotations

from contract.errors import ConfigError, UsageError
from contract.families import TASK_ENCODER_MODELS, profile_name
from models.families import family_of

#: model config field -> the task encoder attribute holding that token's id
TOKEN_IDS = {"image_token_id": "image_pad", "video_token_id": "video_pad",
             "vision_start_token_id": "vision_start", "vision_end_token_id": "vision_end"}
#: model config field -> the HF config.json keys that set it, the first one present wins (the
#: families' ``from_hf_config`` read these; Nemotron-Omni's config names its image token
#: ``img_context_token_id``); a field none sets holds the HF config class's default
HF_TOKEN_KEYS = {"image_token_id": ("image_token_id", "img_context_token_id"),
                 "video_token_id": ("video_token_id",),
                 "vision_start_token_id": ("vision_start_token_id",),
                 "vision_end_token_id": ("vision_end_token_id",)}


def profile_for(family: str, configured) -> str:
    """The configured task encoder profile (an alias allowed) when it feeds ``family``, else
    the family's own (its first profile)."""
    try:
        profile = profile_name(configured)
    except (ValueError, AttributeError):
        profile = None
    feeds = TASK_ENCODER_MODELS[family]
    return profile if profile in feeds else feeds[0]


def compatibility_problems(model, task_encoder, *, weights: str | None = None,
                           processor: dict[str, int] | None = None) -> list[str]:
    """What of ``task_encoder`` (a ``TaskEncoderConfig``) does not fit ``model`` (a model
    config), one line each: the profile does not feed the family (then nothing else is
    compared), the sequence length is more than the model's positions, the tower's patch
    geometry differs, or (``processor``: the HF processors' ``patch_size`` / ``merge_size`` /
    ...) the processors' does."""
    prefix = f"{weights}: " if weights else ""
    feeds = TASK_ENCODER_MODELS.get(model.family, (model.family,))
    if task_encoder.model not in feeds:
        return [f"{prefix}task_encoder.model {task_encoder.model!r} does not feed model.family "
                f"{model.family!r} (use {' or '.join(feeds)})"]
    positions = model.lm.max_position_embeddings
    problems = [f"{prefix}task_encoder.seq_length {task_encoder.seq_length} is more than the "
                f"model's {positions} positions (model.lm.max_position_embeddings): lower it"]\
        if task_encoder.seq_length > positions else []
    geometry = task_encoder.resolve().geometry
    problems += [f"{prefix}model vision {name} is {ours}, task_encoder.model "
                f"{task_encoder.model!r} uses {getattr(geometry, name)}"
                for name, ours in family_of(model).vision_geometry(model).items()
                if getattr(geometry, name) != ours]
    problems += [f"{prefix}its processor's {name} is {value}, task_encoder.model "
                 f"{task_encoder.model!r} uses {getattr(geometry, name)}"
                 for name, value in (processor or {}).items()
                 if getattr(geometry, name) != value]
    return problems


def check_compatible(model, task_encoder, *, weights: str | None = None,
                     processor: dict[str, int] | None = None, tokenizer=None, encoder=None,
                     token_ids: tuple[str, ...] = ()) -> None:
    """``model`` (a model config) and ``task_encoder`` (a ``TaskEncoderConfig``) belong
    together; with ``tokenizer`` and its ``encoder`` (``energon_tasks.task_encoder_for``) also
    the tokens: each of ``token_ids`` (model config fields, ``TOKEN_IDS``: those the model's
    weights were trained with) equals the tokenizer's, and the tokenizer fits in
    ``model.lm.vocab_size``.

    Args:
        weights: where the model's weights come from, as messages name it (``"checkpoint X"``,
            ``"model.hf X"``); None for a model built from the run config.
        processor: the HF processors' geometry (``models.hf.source.task_encoder_settings``).

    Raises:
        ConfigError: every problem of ``compatibility_problems``.
        UsageError: token ids or vocabulary that do not match the tokenizer (one line).
    """
    problems = compatibility_problems(model, task_encoder, weights=weights, processor=processor)
    if problems:
        raise ConfigError("; ".join(problems), problems)
    if tokenizer is None:
        return
    who = f"{weights}: its" if weights else "model"
    problems = [f"{who} {name} is {getattr(model, name)}, task_encoder.tokenizer gives "
                f"{getattr(encoder, TOKEN_IDS[name])}: they do not belong together"
                for name in token_ids if getattr(model, name) != getattr(encoder, TOKEN_IDS[name])]
    if len(tokenizer) > model.lm.vocab_size:
        problems.append(f"{weights + ': ' if weights else ''}tokenizer has {len(tokenizer)} "
                        f"tokens, model.lm.vocab_size is {model.lm.vocab_size}")
    if problems:
        raise UsageError("; ".join(problems))


def hf_token_problems(config_file, hf_config: dict, model, encoder) -> list[str]:
    """Each special-token id an HF model was trained with (``model``: its config, built from
    ``hf_config``, the ``config_file``'s JSON) that its tokenizer's ``encoder`` gives another id
    for, one line each naming the config.json key, its value and the tokenizer's (training
    would use the tokenizer's id and the export ship the config's). An id the model does not
    use (``-1``: Nemotron-Omni's ``<img>`` / ``</img>`` markers) is not compared."""
    problems = []
    for name, attr in TOKEN_IDS.items():
        ours, theirs = getattr(model, name), getattr(encoder, attr)
        key = next((k for k in HF_TOKEN_KEYS[name] if k in hf_config), None)
        if ours == theirs or (key is None and ours < 0):
            continue
        said = f"{key} {hf_config[key]}" if key else f"{name} (not set: the default {ours})"
        problems.append(f"{config_file}: {said}, but its tokenizer's {attr} token is {theirs}: "
                        "a tokenizer of another model (give the model's own, or none)")
    return problems
