"""``python -m energon_tasks preview``: one sample as the model will see it, as an HTML page.

This module owns the preview page: the sample's media decoded at their planned size (embedded
base64 PNG; a video as a strip of its sampled frames) interleaved with the text of each turn, the
token count of every text piece and visual span, the turns the budget cut, and the budget's
actions or skip reason.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
from pathlib import Path

import click
import numpy as np
from PIL import Image

from energon_tasks.dataset_files import check_dataset_files
from energon_tasks.inspect_cmd import iter_samples, knob_options, make_encoder
from energon_tasks.sample_format import PLACEHOLDER_RE, CanonicalSample

_STYLE = """body{font-family:sans-serif;max-width:1100px;margin:auto}
.turn{border:1px solid #ccc;margin:8px 0;padding:6px}.cut{opacity:.45}
.role{font-weight:bold}.count{color:#777;font-size:.8em}img{max-width:100%;display:block}
.span{background:#eef;padding:4px;margin:4px 0}"""


def _png(pixels: np.ndarray) -> str:
    """(T, H, W, 3) uint8, or float32 0..255 (an image resized in float) -> data URL of one PNG
    (frames side by side, at most 16)."""
    strip = np.concatenate(list(pixels[:16]), axis=1)
    if strip.dtype != np.uint8:
        strip = np.clip(np.rint(strip), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(strip).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def render(key: str, sample: CanonicalSample, media_bytes: dict, encoder) -> str:
    """The HTML page of one sample under the encoder's budget."""
    turns = encoder.tokenize_turns(sample)
    plan = encoder.plan_sample(sample, key, turns)
    pixels, error = [], ""
    if not plan.skip:
        try:
            plan, pixels = encoder.decode_sample(plan, sample, media_bytes)
        except Exception as failure:  # noqa: BLE001 - shown on the page, like the loader skips
            error = f"decode failed: {failure}"
    planned = {item.index: (item, frames) for item, frames in zip(plan.media, pixels)}
    status = plan.skip and f"SKIPPED ({plan.skip}): {plan.detail}" or error or (
        f"kept {plan.kept_turns}/{len(turns)} turns; {plan.total_tokens} tokens = "
        f"{plan.text_tokens} text + {plan.visual_tokens} visual; actions: "
        f"{', '.join(plan.actions) or 'none'}")
    body = [f"<h2>{html.escape(key)}</h2><p>{html.escape(status)}</p>"]
    media_index = 0
    for number, (turn, tokens) in enumerate(zip(sample.conversation, turns, strict=True)):
        cut = number >= plan.kept_turns
        body.append(f"<div class='turn{' cut' if cut else ''}'><span class='role'>{turn.role}"
                    f"</span> <span class='count'>{tokens.count()} text tokens"
                    f"{' (cut)' if cut else ''}</span>")
        pieces = PLACEHOLDER_RE.split(turn.content)
        for position, piece in enumerate(pieces):
            if position:
                body.append(_media_html(sample, media_index, planned.get(media_index)))
                media_index += 1
            count = len(tokens.pieces[position])
            body.append(f"<div>{html.escape(piece)} <span class='count'>[{count} tokens]"
                        "</span></div>")
        body.append("</div>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(key)}"
            f"</title><style>{_STYLE}</style></head><body>{''.join(body)}</body></html>")


def _media_html(sample: CanonicalSample, index: int, planned) -> str:
    media = sample.media[index]
    source = f"{media.kind} {index} ({media.part}): stored {media.height}x{media.width} (HxW)"
    if planned is None:
        return f"<div class='span'>{html.escape(source)}, not encoded</div>"
    item, frames = planned
    grid = item.grid
    text = (f"{source} -> {grid.resized_height}x{grid.resized_width}, grid_thw "
            f"{tuple(grid.grid_thw)}, {grid.visual_tokens} visual tokens, span "
            f"{item.span_tokens} tokens")
    if item.frame_indices:
        text += f", frames {list(item.frame_indices)}"
    return f"<div class='span'>{html.escape(text)}<img src='{_png(frames)}'></div>"


@click.command("preview")
@click.argument("dataset_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--index", type=int, required=True, help="N-th sample of the split (from 0).")
@click.option("--split", default="train", show_default=True, help="Split part to read.")
@click.option("--out", type=click.Path(path_type=Path), help="HTML file (preview_KEY.html).")
@knob_options
def preview(dataset_dir, index, split, out, model, tokenizer, config, **knobs) -> None:
    """Write an HTML page of one sample: resized media interleaved with text and token counts.
    Sizes are HxW (height x width), as `grid --image HxW` takes them."""
    if index < 0:
        raise click.UsageError(f"--index must be >= 0, got {index}")
    check_dataset_files(dataset_dir)  # before anything else: the folder's YAML names no code
    found = next(itertools.islice(iter_samples(dataset_dir, split, with_media=True), index, None),
                 None)
    if found is None:
        raise click.UsageError(f"{dataset_dir} [{split}] has no sample {index}")
    key, doc, media = found
    encoder = make_encoder(model, tokenizer, knobs, config)
    page = render(key, CanonicalSample.from_json(doc), media, encoder)
    out = out or Path(f"preview_{key}.html")
    out.write_text(page, encoding="utf-8")
    click.echo(str(out))
