"""The generated inputs of ``python -m models.convert verify`` (and of the tests that compare our
models with transformers' through them), in our batch contract, and their translation to the
arguments of transformers' forward: each family's own (``verify_inputs`` / ``hf_inputs`` of its
package, ``models.families``).
"""

from __future__ import annotations

from models.families import family_of


def make_inputs(cfg, seed: int = 0) -> dict[str, dict]:
    """Single-row inputs of ``cfg``'s family (named cases: one image, several images with text, a
    video, ...), our batch-contract fields."""
    return family_of(cfg).verify_inputs(cfg, seed)


def hf_inputs(cfg, inputs: dict) -> dict:
    """Our inputs as transformers' forward of the family takes them."""
    return family_of(cfg).hf_inputs(cfg, inputs)
