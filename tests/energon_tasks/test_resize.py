"""The exact uint8 resize (energon_tasks.resize): PIL's bicubic pixels bit for bit, from the
native kernel where it is built and agrees with the installed Pillow, else from PIL."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from PIL import Image

from contract.errors import MediaError
from energon_tasks import resize
from energon_tasks.decode import decode_image, pil_in_one_block, pil_pixels


def pil_bicubic(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(np.ascontiguousarray(pixels)).resize(
        (width, height), Image.BICUBIC))


#: the property tests' sources: sizes from 1 to 90 resized to 1 to 120 a side, kinds, seeds, and
#: whether the pixels are 4 bytes apart (RGBX, as PIL keeps them: ``decode.pil_pixels``)
SOURCES = {"height": st.integers(1, 90), "width": st.integers(1, 90),
           "new_height": st.integers(1, 120), "new_width": st.integers(1, 120),
           "kind": st.sampled_from(["noise", "edges", "smooth"]), "seed": st.integers(0, 2**16),
           "rgbx": st.booleans()}


def source_of(kind: str, height: int, width: int, seed: int, rgbx: bool) -> np.ndarray:
    pixels = pixels_of(kind, height, width, seed)
    if not rgbx:
        return pixels
    padded = np.full((height, width, 4), 7, np.uint8)
    padded[..., :3] = pixels
    return padded[..., :3]


def pixels_of(kind: str, height: int, width: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    if kind == "edges":  # black / white: bicubic overshoot is clipped at both ends
        return (255 * (noise > 127)).astype(np.uint8)
    if kind == "smooth":
        ramp = np.add.outer(np.arange(height), 2 * np.arange(width))[..., None] * [1, 3, 7]
        return (ramp % 256).astype(np.uint8)
    return noise


@pytest.fixture
def fresh_kernel(monkeypatch):
    """resize's per-process check run again (and its result restored after the test)."""
    monkeypatch.setattr(resize, "_checks", {})
    return resize


def torch_float(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """What the Nemotron-Omni processor computes: one ``F.interpolate`` on the float32 tensor."""
    return resize.torch_resized(np.ascontiguousarray(pixels), height, width, banded=False)


#: each resize, what says which kernel runs, and its reference
RESIZES = {"uint8": (resize.resize_rgb, resize.kernel, pil_bicubic),
           "float32": (resize.resize_rgb_float, resize.float_kernel, torch_float)}


@pytest.mark.parametrize("which", RESIZES)
def test_the_native_kernels_are_built_and_agree_with_this_pillow_and_torch(which):
    says = RESIZES[which][1]()
    assert says.startswith("native ("), says


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info
                         if line.startswith("flags")), set())
    except OSError:
        return set()


def test_a_cpu_with_avx2_and_fma_runs_the_float_kernels_vector_code():
    """The vector code is chosen by the CPU's features: GCC's target_clones("arch=haswell")
    chose by CPU model, and an AMD EPYC ran the plain code (fmaf a libm call, 2-7x slower)."""
    if resize._bicubic_float is None or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no native float kernel, or a CPU without AVX2 and FMA (or not Linux)")
    assert resize.float_kernel().startswith("native (avx2+fma, "), resize.float_kernel()


def test_a_cpu_with_avx2_runs_the_uint8_kernels_vector_code():
    """The uint8 kernel's AVX2 code (sums held in registers over all taps) is chosen by the
    CPU's features, as the float kernel's is."""
    if resize._bicubic is None or "avx2" not in cpu_flags():
        pytest.skip("no native kernel, or a CPU without AVX2 (or not Linux)")
    assert resize.kernel().startswith("native (") and ", avx2 code," in resize.kernel(), \
        resize.kernel()


@settings(max_examples=60, deadline=None)
@given(**SOURCES)
def test_the_uint8_kernels_plain_code_gives_pils_pixels_too(height, width, new_height,
                                                            new_width, kind, seed, rgbx):
    """The code a CPU without AVX2 runs computes the same integers as the vector code."""
    rule = resize._checked("uint8", resize._checked_rule)[0]
    if rule is None:
        pytest.skip(resize.kernel())
    pixels = source_of(kind, height, width, seed, rgbx)
    assert np.array_equal(resize._native(pixels, new_width, new_height, rule, None, plain=True),
                          pil_bicubic(pixels, new_width, new_height))


@pytest.mark.parametrize("which", RESIZES)
@settings(max_examples=200, deadline=None)
@given(**SOURCES)
def test_both_resizes_are_their_references_bit_for_bit(which, height, width, new_height,
                                                       new_width, kind, seed, rgbx):
    ours, _, reference = RESIZES[which]
    pixels = source_of(kind, height, width, seed, rgbx)
    assert np.array_equal(ours(pixels, new_width, new_height),
                          reference(pixels, new_width, new_height))


@pytest.mark.parametrize("source, target", [
    ((5000, 1400, 3), (1568, 448, 3)),   # an InfoVQA page to Qwen's budget: both passes shrink
    ((3000, 200, 3), (300, 260, 3)),     # height shrinks > 2x the width: Pillow 13 vertical first
    ((360, 640, 3), (336, 616, 3)),      # a video frame
    ((400, 300, 3), (400, 300, 3)),      # the same size: a copy
    ((1, 1, 3), (33, 47, 3)),
])
def test_resize_on_the_sizes_the_loader_meets(source, target):
    pixels = pixels_of("smooth", *source[:2], seed=1)
    pixels[::7] = 255 - pixels[::7]  # stripes: strokes
    assert np.array_equal(resize.resize_rgb(pixels, target[1], target[0]),
                          pil_bicubic(pixels, target[1], target[0]))


def test_rows_with_padding_in_and_rows_of_a_larger_array_out():
    source = pixels_of("noise", 50, 90, seed=2)[:, 10:80]  # rows 90 pixels apart
    out = np.zeros((4, 21, 33, 3), np.uint8)
    resized = resize.resize_rgb(source, 33, 21, out=out[2])
    assert np.shares_memory(resized, out[2])
    assert np.array_equal(out[2], pil_bicubic(source, 33, 21))
    assert not out[[0, 1, 3]].any()


def test_an_output_of_another_size_is_refused():
    with pytest.raises(ValueError, match="expected"):
        resize.resize_rgb(pixels_of("noise", 20, 20, seed=9), 10, 12,
                          out=np.empty((10, 12, 3), np.uint8))


def test_pixels_the_kernel_cannot_read_are_resized_by_pil():
    source = pixels_of("noise", 30, 40, seed=3)[:, ::2]  # pixels 6 bytes apart
    assert np.array_equal(resize.resize_rgb(source, 11, 13), pil_bicubic(source, 11, 13))


def test_the_kernel_refuses_what_it_cannot_write_in_one_line():
    if resize._bicubic is None:
        pytest.skip(resize.kernel())
    source = pixels_of("noise", 20, 20, seed=4)
    bad = {"a float source": (source.astype(np.float32), np.empty((5, 5, 3), np.uint8)),
           "4 channels": (np.empty((20, 20, 4), np.uint8), np.empty((5, 5, 4), np.uint8)),
           "2 dimensions": (source[..., 0], np.empty((5, 5), np.uint8)),
           "an empty target": (source, np.empty((0, 5, 3), np.uint8)),
           "a read-only target": (source, np.empty((5, 5, 3), np.uint8)),
           "a strided target": (source, np.empty((5, 10, 3), np.uint8)[:, ::2]),
           "the source's own memory": (source, source.reshape(-1)[:75].reshape(5, 5, 3))}
    bad["a read-only target"][1].flags.writeable = False
    for what, (src, dst) in bad.items():
        with pytest.raises(ValueError) as caught:
            resize._bicubic(src, dst, False)
        assert "\n" not in str(caught.value), what
    with pytest.raises(TypeError):
        resize._bicubic([[[0, 0, 0]]], np.empty((1, 1, 3), np.uint8), False)


def test_without_the_compiled_kernel_pil_resizes(fresh_kernel, monkeypatch):
    monkeypatch.setattr(fresh_kernel, "_bicubic", None)
    assert fresh_kernel.kernel().startswith("PIL (the native kernel is"), fresh_kernel.kernel()
    pixels = pixels_of("edges", 61, 97, seed=5)
    assert np.array_equal(fresh_kernel.resize_rgb(pixels, 13, 80), pil_bicubic(pixels, 13, 80))


def test_a_pillow_whose_pixels_differ_is_not_trusted_to_the_kernel(fresh_kernel, monkeypatch):
    """Only the rule of another Pillow known (the order that Pillow 13 no longer uses where the
    height shrinks most): the check finds pixels that differ and PIL resizes."""
    if resize._bicubic is None:
        pytest.skip(resize.kernel())
    used = fresh_kernel.kernel()
    wrong = [rule for rule in resize._ORDER_RULES if not used.startswith(f"native ({rule[0]} ")]
    assert len(wrong) == len(resize._ORDER_RULES) - 1
    monkeypatch.setattr(fresh_kernel, "_ORDER_RULES", tuple(wrong))
    monkeypatch.setattr(fresh_kernel, "_checks", {})
    assert fresh_kernel.kernel().startswith("PIL (the native kernel's pixels differ"), \
        fresh_kernel.kernel()
    pixels = pixels_of("noise", 97, 61, seed=6)
    assert np.array_equal(fresh_kernel.resize_rgb(pixels, 80, 13), pil_bicubic(pixels, 80, 13))


def test_pils_own_rgbx_rows_are_read_in_place_and_resized_as_pil_does():
    image = Image.fromarray(pixels_of("smooth", 300, 200, seed=7))
    with pil_in_one_block():
        decoded = Image.open(io.BytesIO(_png(image)))
        decoded.load()
        view = pil_pixels(decoded)
    assert view.strides[1] == 4, "PIL's memory is read in place (Pillow >= 11.2)"
    assert np.array_equal(view, np.asarray(image))
    for width, height in ((120, 90), (200, 77), (64, 300), (200, 300), (500, 20)):
        assert np.array_equal(resize.resize_rgb(view, width, height),
                              pil_bicubic(np.asarray(image), width, height)), (width, height)


def test_an_image_in_several_blocks_is_copied_and_the_block_size_restored():
    before = Image.core.get_block_size()
    pixels = pixels_of("noise", 3000, 2000, seed=8)  # 24 MB of RGBX: two of PIL's 16 MB blocks
    image = Image.fromarray(pixels)
    copied = pil_pixels(image)
    assert copied.strides[1] == 3 and np.array_equal(copied, pixels)
    with pytest.raises(MediaError):
        decode_image(b"not an image", size=(10, 10), max_source_pixels=10**9)
    decode_image(_png(Image.fromarray(pixels[:40, :30])), size=(10, 10), max_source_pixels=10**9)
    assert Image.core.get_block_size() == before


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


# ---- torch's antialiased bicubic in float32 ------------------------------------------------------


@pytest.mark.parametrize("source, target", [
    ((2300, 1100), (1536, 736)),   # an InfoVQA page to Nemotron-Omni's budget
    ((600, 800), (448, 608)),      # a photo
    ((200, 3000), (64, 1024)),     # a steep shrink of a wide strip
    ((40, 30), (300, 200)),        # enlarged
    ((77, 90), (77, 1)),           # one pixel wide: torch's other loop, resized by torch
])
def test_float_resize_on_the_sizes_the_loader_meets(source, target):
    pixels = pixels_of("smooth", *source, seed=10)
    pixels[::5] = 255 - pixels[::5]
    assert np.array_equal(resize.resize_rgb_float(pixels, target[1], target[0]),
                          torch_float(pixels, target[1], target[0]))


@settings(max_examples=40, deadline=None)
@given(**SOURCES)
def test_the_float_kernels_plain_code_gives_torchs_values_too(height, width, new_height,
                                                              new_width, kind, seed, rgbx):
    """The code a CPU without AVX2 + FMA runs (fmaf a libm call) sums as the vector code does."""
    if resize._bicubic_float is None:
        pytest.skip(resize.float_kernel())
    assume(new_width > 1)  # torch's other loop: torch resizes those
    group = resize._checked("float32", resize._checked_float_rule)[0]
    pixels = source_of(kind, height, width, seed, rgbx)
    assert np.array_equal(resize._native_float(pixels, new_width, new_height, group, plain=True),
                          torch_float(pixels, new_width, new_height))


def test_a_torch_that_sums_otherwise_is_not_trusted_to_the_kernel(fresh_kernel, monkeypatch):
    if resize._bicubic_float is None:
        pytest.skip(resize.float_kernel())
    used = int(resize.float_kernel().split("groups of ")[1].split(",")[0])
    monkeypatch.setattr(resize, "_FLOAT_GROUPS", tuple(g for g in resize._FLOAT_GROUPS
                                                       if g != used))
    monkeypatch.setattr(resize, "_checks", {})
    assert resize.float_kernel().startswith("torch (the native kernel's values differ"), \
        resize.float_kernel()
    pixels = pixels_of("noise", 97, 61, seed=11)
    assert np.array_equal(resize.resize_rgb_float(pixels, 80, 13), torch_float(pixels, 80, 13))


def test_the_float_kernel_refuses_taps_outside_the_source_in_one_line():
    if resize._bicubic_float is None:
        pytest.skip(resize.float_kernel())
    source = pixels_of("noise", 20, 30, seed=12)
    out = np.empty((3, 20, 10), np.float32)
    first, count, weights = resize._torch_taps(30, 10)
    bad = {"a tap past the end": (first + 30, count, weights),
           "no tap": (first, count * 0, weights),
           "int64 starts": (first.astype(np.int64), count, weights),
           "float64 weights": (first, count, weights.astype(np.float64)),
           "one output short": (first[:-1], count[:-1], weights[:-1])}
    for what, taps in bad.items():
        with pytest.raises(ValueError) as caught:
            resize._bicubic_float(source, out, *taps, None, None, None, 4)
        assert "\n" not in str(caught.value), what
    with pytest.raises(ValueError):  # a resized side without its taps
        resize._bicubic_float(source, out, None, None, None, None, None, None, 4)
