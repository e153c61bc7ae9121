/* PIL's bicubic resize of RGB uint8 pixels, the same arithmetic vectorised (energon_tasks.resize).
 *
 * Pillow resizes in two separable passes (libImaging/Resample.c): the weights of each output
 * position come from the bicubic kernel (a = -0.5) in double precision, normalised, then rounded
 * to 22-bit fixed point; each output value is clip8((0.5 << 22 + sum(pixel * weight)) >> 22),
 * summed in int32, and the first pass is rounded to uint8 before the second reads it. Integer
 * sums do not depend on their order, so this module computes the same values several lanes at a
 * time: the vertical pass along a row (every value of a row has the same weights), the horizontal
 * pass over blocks of ROWS rows transposed so that one output column of the block is contiguous.
 * Sources may be packed RGB or PIL's own RGBX rows (4 bytes a pixel, read without a copy).
 * With AVX2 the block transposes run 8 pixels at a time too (two 8 x 8 transposes of 32-bit
 * pixels and byte shuffles: RGBX sources into a block, every block's columns back to rows).
 * Which pass runs first is the caller's (Pillow changed its rule in 13.0); the coefficient code
 * is compiled without FMA contraction (-ffp-contract=off) so its doubles round as Pillow's do.
 * energon_tasks.resize checks the result against the installed Pillow before it is used.
 *
 * patch_rows: the Qwen ViT's normalised patch rows (energon_tasks/families/qwen_vl/geometry.py,
 * ``pixel_rows``) in one pass: each uint8 value looked up in the caller's per-channel table of
 * its normalised float32 value, in the processors' row order: each patch's values of one channel
 * built in a small buffer and written with non-temporal stores (x86-64), once per temporal slot
 * that shows that frame (an image's two slots, a video's padding).
 *
 * normalize_rows: Nemotron-Omni's patch rows of float32 frames (resized in float32 as its image
 * processor does; energon_tasks/families/nemotron_omni/geometry.py, ``pixel_rows``) in one pass:
 * each value ((x / pre) - sub) / div in float32 with the caller's per-channel constants (the
 * processors' float ops, each rounded as numpy rounds it), each patch's p values of a row
 * computed in a small buffer and streamed out as patch_rows does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PRECISION_BITS (32 - 8 - 2)
#define ROWS 16             /* rows per block of the horizontal pass */
#define LANES (ROWS * 3)    /* values per output column of a block */
#define SPAN 512            /* values per chunk of the vertical pass */

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define AVX2_DISPATCH 1
#include <immintrin.h>
#else
#define AVX2_DISPATCH 0
#endif

static double bicubic_weight(double x) {
    const double a = -0.5;
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

/* One axis: for each output position its first input and input count (bounds) and its
   fixed-point weights (ksize per position). Returns ksize, 0 when out of memory. */
static int axis_weights(int in_size, int out_size, int **bounds_out, int32_t **weights_out) {
    double scale = (double)in_size / out_size;
    double filterscale = scale < 1.0 ? 1.0 : scale;
    double support = 2.0 * filterscale, inverse = 1.0 / filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    double *row = malloc(sizeof(double) * ksize);
    int32_t *weights = malloc(sizeof(int32_t) * (size_t)out_size * ksize);
    int *bounds = malloc(sizeof(int) * 2 * (size_t)out_size);
    if (!row || !weights || !bounds) {
        free(row); free(weights); free(bounds);
        return 0;
    }
    for (int o = 0; o < out_size; o++) {
        double center = (o + 0.5) * scale, total = 0.0;
        int first = (int)(center - support + 0.5), count;
        if (first < 0) first = 0;
        count = (int)(center + support + 0.5);
        if (count > in_size) count = in_size;
        count -= first;
        for (int i = 0; i < count; i++) {
            row[i] = bicubic_weight((i + first - center + 0.5) * inverse);
            total += row[i];
        }
        for (int i = 0; i < ksize; i++) {
            double w = i < count ? (total != 0.0 ? row[i] / total : row[i]) : 0.0;
            weights[(size_t)o * ksize + i] = w < 0 ? (int32_t)(-0.5 + w * (1 << PRECISION_BITS))
                                                   : (int32_t)(0.5 + w * (1 << PRECISION_BITS));
        }
        bounds[2 * o] = first;
        bounds[2 * o + 1] = count;
    }
    free(row);
    *bounds_out = bounds;
    *weights_out = weights;
    return ksize;
}

static inline uint8_t clip8(int32_t sum) {
    int32_t v = sum >> PRECISION_BITS;
    return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v;
}

/* Rows [y0, y1) of src (w pixels pixel_bytes apart, rows src_stride bytes apart) resampled to
   w2 pixels into dst's rows 0.. (w2 * 3 bytes each). Returns -1 when out of memory. */
/* Rows [y, y + rows) of src transposed into block: pixel x's values of the block's rows are
   LANES contiguous bytes (row r at r * 3). */
static void fill_block(const uint8_t *src, Py_ssize_t src_stride, int pixel_bytes, int w, int y,
                       int rows, uint8_t *block, int from) {
    for (int r = 0; r < rows; r++) {
        const uint8_t *line = src + (size_t)(y + r) * src_stride;
        uint8_t *lane = block + r * 3;
        int x = from;
        /* 4-byte moves: the 4th byte lands in the next row's lane, written after it */
        if (r + 1 < ROWS)
            for (; x < w - 1; x++)
                memcpy(lane + (size_t)x * LANES, line + (size_t)x * pixel_bytes, 4);
        for (; x < w; x++) memcpy(lane + (size_t)x * LANES, line + (size_t)x * pixel_bytes, 3);
    }
}

/* The block's output columns (done: LANES bytes per output pixel) back into rows of dst. */
static void empty_block(const uint8_t *done, int rows, int w2, uint8_t *dst, int from) {
    for (int r = 0; r < rows; r++) {
        uint8_t *line = dst + (size_t)r * w2 * 3;
        int o = from;
        /* 4-byte moves: the 4th byte lands on the next pixel, written after it */
        for (; o < w2 - 1; o++) memcpy(line + (size_t)o * 3, done + (size_t)o * LANES + r * 3, 4);
        if (o < w2) memcpy(line + (size_t)o * 3, done + (size_t)o * LANES + r * 3, 3);
    }
}

/* One block's output columns, plainly (the compiler vectorises what it can). */
static void columns_plain(const uint8_t *block, uint8_t *done, int w2, int ksize,
                          const int *bounds, const int32_t *weights) {
    int32_t acc[LANES];
    for (int o = 0; o < w2; o++) {
        const int32_t *k = weights + (size_t)o * ksize;
        const uint8_t *in = block + (size_t)bounds[2 * o] * LANES;
        int count = bounds[2 * o + 1];
        for (int l = 0; l < LANES; l++) acc[l] = 1 << (PRECISION_BITS - 1);
        for (int t = 0; t < count; t++) {
            int32_t weight = k[t];
            const uint8_t *tap = in + (size_t)t * LANES;
            for (int l = 0; l < LANES; l++) acc[l] += tap[l] * weight;
        }
        uint8_t *column = done + (size_t)o * LANES;
        for (int l = 0; l < LANES; l++) column[l] = clip8(acc[l]);
    }
}

#if AVX2_DISPATCH
/* The same sums with AVX2, the block's 48 lanes in six registers over all taps: int32 products
   and sums as above (the same integers), then PIL's shift and clip (packs with saturation). */
__attribute__((target("avx2")))
static void columns_avx2(const uint8_t *block, uint8_t *done, int w2, int ksize,
                         const int *bounds, const int32_t *weights) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int o = 0; o < w2; o++) {
        const int32_t *k = weights + (size_t)o * ksize;
        const uint8_t *tap = block + (size_t)bounds[2 * o] * LANES;
        int count = bounds[2 * o + 1];
        __m256i a0 = _mm256_set1_epi32(1 << (PRECISION_BITS - 1));
        __m256i a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
        for (int t = 0; t < count; t++, tap += LANES) {
            __m256i weight = _mm256_set1_epi32(k[t]);
#define MAC8(acc, at) acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(_mm256_cvtepu8_epi32( \
                          _mm_loadl_epi64((const __m128i *)(at))), weight))
            MAC8(a0, tap); MAC8(a1, tap + 8); MAC8(a2, tap + 16);
            MAC8(a3, tap + 24); MAC8(a4, tap + 32); MAC8(a5, tap + 40);
        }
        a0 = _mm256_srai_epi32(a0, PRECISION_BITS); a1 = _mm256_srai_epi32(a1, PRECISION_BITS);
        a2 = _mm256_srai_epi32(a2, PRECISION_BITS); a3 = _mm256_srai_epi32(a3, PRECISION_BITS);
        a4 = _mm256_srai_epi32(a4, PRECISION_BITS); a5 = _mm256_srai_epi32(a5, PRECISION_BITS);
        __m256i low = _mm256_packus_epi16(_mm256_packs_epi32(a0, a1), _mm256_packs_epi32(a2, a3));
        __m256i high = _mm256_packs_epi32(a4, a5);
        high = _mm256_packus_epi16(high, high);
        uint8_t *column = done + (size_t)o * LANES;
        _mm256_storeu_si256((__m256i *)column, _mm256_permutevar8x32_epi32(low, order));
        _mm_storeu_si128((__m128i *)(column + 32),
                         _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(high, order)));
    }
}

/* The vertical pass with AVX2: 32 values of a row at a time, in four registers over all taps. */
__attribute__((target("avx2")))
static void vertical_avx2(const uint8_t *src, Py_ssize_t src_stride, Py_ssize_t row_bytes,
                          uint8_t *dst, int h2, int ksize, const int *bounds,
                          const int32_t *weights) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int y = 0; y < h2; y++) {
        const int32_t *k = weights + (size_t)y * ksize;
        int count = bounds[2 * y + 1];
        const uint8_t *base = src + (size_t)bounds[2 * y] * src_stride;
        uint8_t *line = dst + (size_t)y * row_bytes;
        Py_ssize_t i = 0;
        for (; i + 32 <= row_bytes; i += 32) {
            __m256i a0 = _mm256_set1_epi32(1 << (PRECISION_BITS - 1)), a1 = a0, a2 = a0, a3 = a0;
            const uint8_t *tap = base + i;
            for (int t = 0; t < count; t++, tap += src_stride) {
                __m256i weight = _mm256_set1_epi32(k[t]);
                MAC8(a0, tap); MAC8(a1, tap + 8); MAC8(a2, tap + 16); MAC8(a3, tap + 24);
            }
            a0 = _mm256_srai_epi32(a0, PRECISION_BITS); a1 = _mm256_srai_epi32(a1, PRECISION_BITS);
            a2 = _mm256_srai_epi32(a2, PRECISION_BITS); a3 = _mm256_srai_epi32(a3, PRECISION_BITS);
            __m256i out = _mm256_packus_epi16(_mm256_packs_epi32(a0, a1),
                                              _mm256_packs_epi32(a2, a3));
            _mm256_storeu_si256((__m256i *)(line + i), _mm256_permutevar8x32_epi32(out, order));
        }
        for (; i < row_bytes; i++) {
            int32_t sum = 1 << (PRECISION_BITS - 1);
            for (int t = 0; t < count; t++) sum += base[(size_t)t * src_stride + i] * k[t];
            line[i] = clip8(sum);
        }
    }
}
#undef MAC8
#endif

#if AVX2_DISPATCH
/* r[i] (8 32-bit values each) -> r[j] holding the j-th value of every r[i], in order. */
__attribute__((target("avx2")))
static inline void transpose8x8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
    }
}

/* fill_block for a whole block (ROWS = 16 rows) of RGBX pixels, 8 pixels at a time: the 16 x 8
   pixels transposed as two 8 x 8 blocks of 32-bit values, then each pixel's 16 RGBX values
   packed to its 48 RGB bytes with a byte shuffle and four 16-byte stores, in order (each one's
   last 4 bytes are written again by the next; the last pixel's land in the block's slack).
   Returns the first pixel left to fill_block. */
__attribute__((target("avx2")))
static int fill_block_avx2(const uint8_t *src, Py_ssize_t src_stride, int w, int y,
                           uint8_t *block) {
    const __m256i pack = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                          0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    int x = 0;
    for (; x + 8 <= w; x += 8) {
        __m256i top[8], bottom[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *at = src + (size_t)(y + i) * src_stride + (size_t)x * 4;
            top[i] = _mm256_loadu_si256((const __m256i *)at);
            bottom[i] = _mm256_loadu_si256((const __m256i *)(at + 8 * src_stride));
        }
        transpose8x8(top);
        transpose8x8(bottom);
        for (int j = 0; j < 8; j++) {
            uint8_t *lane = block + (size_t)(x + j) * LANES;
            __m256i a = _mm256_shuffle_epi8(top[j], pack), b = _mm256_shuffle_epi8(bottom[j], pack);
            _mm_storeu_si128((__m128i *)lane, _mm256_castsi256_si128(a));
            _mm_storeu_si128((__m128i *)(lane + 12), _mm256_extracti128_si256(a, 1));
            _mm_storeu_si128((__m128i *)(lane + 24), _mm256_castsi256_si128(b));
            _mm_storeu_si128((__m128i *)(lane + 36), _mm256_extracti128_si256(b, 1));
        }
    }
    return x;
}

/* empty_block for a whole block, 8 output pixels at a time: each pixel's 48 bytes widened to 16
   RGBX values (two 16-byte loads per 8 rows; the last one reads 4 bytes into the next pixel or
   the slack), transposed back to rows, packed to 24 bytes a row and stored exactly (16 + 8).
   Returns the first output pixel left to empty_block. */
__attribute__((target("avx2")))
static int empty_block_avx2(const uint8_t *done, int w2, uint8_t *dst) {
    const __m256i widen = _mm256_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1,
                                           0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    const __m256i pack = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                          0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i order = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7);  /* 24 bytes to the front */
    int o = 0;
    for (; o + 8 <= w2; o += 8) {
        __m256i top[8], bottom[8];
        for (int j = 0; j < 8; j++) {
            const uint8_t *at = done + (size_t)(o + j) * LANES;
            top[j] = _mm256_shuffle_epi8(_mm256_loadu2_m128i((const __m128i *)(at + 12),
                                                             (const __m128i *)at), widen);
            bottom[j] = _mm256_shuffle_epi8(_mm256_loadu2_m128i((const __m128i *)(at + 36),
                                                                (const __m128i *)(at + 24)),
                                            widen);
        }
        transpose8x8(top);
        transpose8x8(bottom);
        for (int r = 0; r < ROWS; r++) {
            __m256i row = _mm256_permutevar8x32_epi32(
                _mm256_shuffle_epi8(r < 8 ? top[r] : bottom[r - 8], pack), order);
            uint8_t *line = dst + ((size_t)r * w2 + o) * 3;
            _mm_storeu_si128((__m128i *)line, _mm256_castsi256_si128(row));
            _mm_storel_epi64((__m128i *)(line + 16), _mm256_extracti128_si256(row, 1));
        }
    }
    return o;
}
#endif

static int uint8_vector(void) {
#if AVX2_DISPATCH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* Rows [y0, y1) of src (w pixels pixel_bytes apart, rows src_stride bytes apart) resampled to
   w2 pixels into dst's rows 0.. (w2 * 3 bytes each). Returns -1 when out of memory. */
static int horizontal(const uint8_t *src, Py_ssize_t src_stride, int pixel_bytes, int w, int y0,
                      int y1, uint8_t *dst, int w2, int ksize, const int *bounds,
                      const int32_t *weights, int vector) {
    /* 16 bytes of slack after each: the vector transposes' overlapping stores and loads */
    uint8_t *block = malloc((size_t)w * LANES + 16), *done = malloc((size_t)w2 * LANES + 16);
    if (!block || !done) {
        free(block); free(done);
        return -1;
    }
    for (int y = y0; y < y1; y += ROWS) {
        int rows = y1 - y < ROWS ? y1 - y : ROWS, filled = 0, emptied = 0;
        uint8_t *out = dst + (size_t)(y - y0) * w2 * 3;
#if AVX2_DISPATCH
        if (vector && rows == ROWS && pixel_bytes == 4)
            filled = fill_block_avx2(src, src_stride, w, y, block);
#endif
        fill_block(src, src_stride, pixel_bytes, w, y, rows, block, filled);
#if AVX2_DISPATCH
        if (vector)
            columns_avx2(block, done, w2, ksize, bounds, weights);
        else
#endif
            columns_plain(block, done, w2, ksize, bounds, weights);
#if AVX2_DISPATCH
        if (vector && rows == ROWS)
            emptied = empty_block_avx2(done, w2, out);
#endif
        empty_block(done, rows, w2, out, emptied);
    }
    free(block);
    free(done);
    return 0;
}

/* h2 output rows of row_bytes values each into dst, output row y from src's rows
   bounds[2y] .. (rows src_stride bytes apart). */
static void vertical_plain(const uint8_t *src, Py_ssize_t src_stride, Py_ssize_t row_bytes,
                     uint8_t *dst, int h2, int ksize, const int *bounds, const int32_t *weights) {
    int32_t acc[SPAN];
    for (int y = 0; y < h2; y++) {
        const int32_t *k = weights + (size_t)y * ksize;
        int first = bounds[2 * y], count = bounds[2 * y + 1];
        for (Py_ssize_t i0 = 0; i0 < row_bytes; i0 += SPAN) {
            int len = row_bytes - i0 < SPAN ? (int)(row_bytes - i0) : SPAN;
            for (int i = 0; i < len; i++) acc[i] = 1 << (PRECISION_BITS - 1);
            for (int t = 0; t < count; t++) {
                int32_t weight = k[t];
                const uint8_t *tap = src + (size_t)(first + t) * src_stride + i0;
                for (int i = 0; i < len; i++) acc[i] += tap[i] * weight;
            }
            uint8_t *line = dst + (size_t)y * row_bytes + i0;
            for (int i = 0; i < len; i++) line[i] = clip8(acc[i]);
        }
    }
}

static void vertical(const uint8_t *src, Py_ssize_t src_stride, Py_ssize_t row_bytes,
                     uint8_t *dst, int h2, int ksize, const int *bounds, const int32_t *weights,
                     int vector) {
#if AVX2_DISPATCH
    if (vector) {
        vertical_avx2(src, src_stride, row_bytes, dst, h2, ksize, bounds, weights);
        return;
    }
#endif
    vertical_plain(src, src_stride, row_bytes, dst, h2, ksize, bounds, weights);
}

/* Pillow's ImagingResampleInner for bicubic on RGB uint8: src pixels are pixel_bytes (3, or 4:
   RGBX, PIL's own layout) apart, dst is packed RGB. Returns -1 when out of memory. */
static int resize(const uint8_t *src, Py_ssize_t src_stride, int pixel_bytes, int h, int w,
                  uint8_t *dst, int h2, int w2, int vertical_first, int vector) {
    int *hb = NULL, *vb = NULL, status = 0;
    int32_t *hw = NULL, *vw = NULL;
    uint8_t *tmp = NULL;
    Py_ssize_t src_values = (Py_ssize_t)w * pixel_bytes;  /* values per source row */
    int hk = axis_weights(w, w2, &hb, &hw), vk = axis_weights(h, h2, &vb, &vw);
    if (!hk || !vk) {
        status = -1;
    } else if (w == w2 && h == h2) {
        for (int y = 0; y < h; y++)
            for (int x = 0; x < w; x++)
                memcpy(dst + ((size_t)y * w + x) * 3,
                       src + (size_t)y * src_stride + (size_t)x * pixel_bytes, 3);
    } else if (h == h2) {
        status = horizontal(src, src_stride, pixel_bytes, w, 0, h, dst, w2, hk, hb, hw, vector);
    } else if (w != w2 && vertical_first) {
        /* the vertical pass over every value of a row (RGBX: the X too), then the horizontal
           one, a band of ROWS output rows at a time (the band's rows stay in the cache) */
        if (!(tmp = malloc((size_t)ROWS * src_values))) status = -1;
        for (int y = 0; !status && y < h2; y += ROWS) {
            int rows = h2 - y < ROWS ? h2 - y : ROWS;
            vertical(src, src_stride, src_values, tmp, rows, vk, vb + 2 * y,
                     vw + (size_t)y * vk, vector);
            status = horizontal(tmp, src_values, pixel_bytes, w, 0, rows,
                                dst + (size_t)y * w2 * 3, w2, hk, hb, hw, vector);
        }
    } else if (w == w2) {
        /* the vertical pass alone; for RGBX, into a copy whose X is then dropped */
        uint8_t *target = dst;
        if (pixel_bytes != 3) target = tmp = malloc((size_t)h2 * src_values);
        if (!target) {
            status = -1;
        } else {
            vertical(src, src_stride, src_values, target, h2, vk, vb, vw, vector);
            if (pixel_bytes != 3)
                for (size_t i = 0; i < (size_t)h2 * w; i++)
                    memcpy(dst + i * 3, tmp + i * pixel_bytes, 3);
        }
    } else {
        int first = vb[0], last = vb[2 * h2 - 2] + vb[2 * h2 - 1];
        if (!(tmp = malloc((size_t)(last - first) * w2 * 3))) {
            status = -1;
        } else if (!(status = horizontal(src, src_stride, pixel_bytes, w, first, last, tmp, w2,
                                         hk, hb, hw, vector))) {
            for (int y = 0; y < h2; y++) vb[2 * y] -= first;
            vertical(tmp, (Py_ssize_t)w2 * 3, (Py_ssize_t)w2 * 3, dst, h2, vk, vb, vw, vector);
        }
    }
    free(tmp); free(hb); free(hw); free(vb); free(vw);
    return status;
}

/* ---- torch's antialiased bicubic in float32 (F.interpolate on a float32 tensor) ----
 * The weights are torch's own, passed in (energon_tasks.resize reads them off F.interpolate's
 * impulse responses). Each output value is torch's sum: the first tap's product, then the
 * others in order, the first `group` * k of them as a product and an add, the rest fused
 * (what torch's build runs on x86-64 with FMA: group 4; group 1 = never fused). The caller
 * checks the result against F.interpolate before it uses the kernel. */

/* The float code is compiled twice: with AVX2 + FMA (fmaf one instruction, 8 lanes a vector)
 * and plain, picked at run time by the CPU's features. (GCC's target_clones("arch=haswell")
 * dispatches on the CPU model, not its features: an AMD EPYC with AVX2 and FMA ran the plain
 * clone, fmaf a libm call per value: 0.4-1.5x torch's speed against 2.7-3.4x.) */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define FMA_DISPATCH 1
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define FMA_DISPATCH 0
#define ALWAYS_INLINE static inline
#endif

typedef struct {
    const int32_t *first, *count;  /* per output: first input, inputs summed */
    const float *weights;          /* per output: ksize weights */
    int ksize, group;
} float_taps;

/* acc[0..n) = the taps of output o, over inputs `lanes` values apart, input i at in[i - origin] */
ALWAYS_INLINE void float_sum(
        float *restrict acc, const float *restrict in, size_t lanes, int n, const float_taps *t,
        int o, int origin) {
    const float *w = t->weights + (size_t)o * t->ksize;
    const float *tap = in + (size_t)(t->first[o] - origin) * lanes;
    int count = t->count[o], plain = (count - 1) / t->group * t->group;
    for (int l = 0; l < n; l++) acc[l] = tap[l] * w[0];
    for (int j = 1; j < count; j++) {
        const float *v = tap + (size_t)j * lanes;
        float weight = w[j];
        if (j <= plain)
            for (int l = 0; l < n; l++) acc[l] = acc[l] + v[l] * weight;
        else
            for (int l = 0; l < n; l++) acc[l] = fmaf(v[l], weight, acc[l]);
    }
}

#if AVX2_DISPATCH
/* float_block's conversion of a whole block (ROWS rows) of RGBX pixels, 8 pixels at a time: the
   16 x 8 pixels transposed as fill_block_avx2 does, each pixel's 8 rows' RGB packed to 24 bytes
   and widened to floats at its lanes 3r + c. Returns the first pixel left to the plain loop. */
__attribute__((target("avx2")))
static int float_fill_avx2(const uint8_t *src, Py_ssize_t src_stride, int w, int y,
                           float *block) {
    const __m256i pack = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                          0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i order = _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 3, 7);  /* 24 bytes to the front */
    int x = 0;
    for (; x + 8 <= w; x += 8) {
        __m256i half[2][8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *at = src + (size_t)(y + i) * src_stride + (size_t)x * 4;
            half[0][i] = _mm256_loadu_si256((const __m256i *)at);
            half[1][i] = _mm256_loadu_si256((const __m256i *)(at + 8 * src_stride));
        }
        transpose8x8(half[0]);
        transpose8x8(half[1]);
        for (int j = 0; j < 8; j++) {
            float *lane = block + (size_t)(x + j) * LANES;
            for (int k = 0; k < 2; k++, lane += 24) {
                __m256i rgb = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(half[k][j], pack),
                                                          order);
                __m128i low = _mm256_castsi256_si128(rgb), high = _mm256_extracti128_si256(rgb, 1);
                _mm256_storeu_ps(lane, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)));
                _mm256_storeu_ps(lane + 8, _mm256_cvtepi32_ps(
                    _mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))));
                _mm256_storeu_ps(lane + 16, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)));
            }
        }
    }
    return x;
}

/* float_unpack_row of every lane of a whole block, 8 columns at a time: 8 columns' values of 8
   lanes transposed (8 x 8 floats), each lane's 8 stored in its row (rows[l]: lane l's row).
   Returns the first column left to float_unpack_row. */
__attribute__((target("avx2")))
static int float_unpack_avx2(const float *done, float *const *rows, int w2) {
    int o = 0;
    for (; o + 8 <= w2; o += 8)
        for (int g = 0; g < LANES; g += 8) {
            __m256i v[8];
            for (int j = 0; j < 8; j++)
                v[j] = _mm256_castps_si256(_mm256_loadu_ps(done + (size_t)(o + j) * LANES + g));
            transpose8x8(v);
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(rows[g + i] + o, _mm256_castsi256_ps(v[i]));
        }
    return o;
}
#endif

/* Source rows [y, y + rows) (rows <= ROWS) resampled horizontally (t; NULL: only converted) into
   done: w2 columns of LANES values (row r, channel c at lane 3r + c). block: w * LANES floats.
   vector: a whole block of RGBX pixels is converted by float_fill_avx2. */
ALWAYS_INLINE void float_block(const uint8_t *src, Py_ssize_t src_stride, int pixel_bytes,
                               int w, int y, int rows, float *block, float *done, int w2,
                               const float_taps *t, int vector) {
    int from = 0;
#if AVX2_DISPATCH
    if (vector && rows == ROWS && pixel_bytes == 4)
        from = float_fill_avx2(src, src_stride, w, y, t ? block : done);
#else
    (void)vector;
#endif
    for (int r = 0; r < rows; r++) {
        const uint8_t *line = src + (size_t)(y + r) * src_stride + (size_t)from * pixel_bytes;
        float *lane = (t ? block : done) + (size_t)from * LANES + r * 3;
        for (int x = from; x < w; x++, lane += LANES, line += pixel_bytes) {
            lane[0] = line[0];
            lane[1] = line[1];
            lane[2] = line[2];
        }
    }
    if (t)
        for (int o = 0; o < w2; o++)
            float_sum(done + (size_t)o * LANES, block, LANES, LANES, t, o, 0);  /* all lanes */
}

/* row r, channel c of done from column `from` on into its row (w2 values) */
ALWAYS_INLINE void float_unpack_row(const float *done, int r, int c, float *row, int from,
                                    int w2) {
    const float *value = done + r * 3 + c;
    for (int o = from; o < w2; o++) row[o] = value[(size_t)o * LANES];
}

/* src (h x w) -> out planes (3, h2, w2): the horizontal pass (ht; NULL: width kept) in blocks of
   ROWS rows, the vertical one (vt; NULL: height kept) as soon as its rows exist, from a ring of
   the last `cap` horizontal rows kept twice (any window of them contiguous); the intermediate
   rows never leave the cache. Returns -1 when out of memory. */
ALWAYS_INLINE int float_resize_body(const uint8_t *src, Py_ssize_t src_stride, int pixel_bytes,
                                    int h, int w, float *out, int h2, int w2,
                                    const float_taps *ht, const float_taps *vt, int vector) {
    int cap = (vt ? vt->ksize : 0) + ROWS;
    /* zeroed: a last block of fewer than ROWS rows sums its unused lanes too */
    float *block = calloc((size_t)w * LANES, sizeof(float));
    float *done = calloc((size_t)w2 * LANES, sizeof(float));  /* w2 == w when ht is NULL */
    float *ring = vt ? malloc(sizeof(float) * 3 * 2 * (size_t)cap * w2) : NULL;
    int status = -1;
    if (!block || !done || (vt && !ring)) goto end;
    size_t plane = (size_t)h2 * w2, ring_plane = 2 * (size_t)cap * w2;
    int made = 0;  /* horizontal rows made so far */
    for (int y = 0; y < h2; y++) {  /* without vt, h2 == h and output row y is horizontal row y */
        int need = vt ? vt->first[y] + vt->count[y] : y + 1;
        while (made < need) {
            int rows = h - made < ROWS ? h - made : ROWS;
            float_block(src, src_stride, pixel_bytes, w, made, rows, block, done, w2, ht, vector);
            float *row_of[LANES];  /* each lane's row: the output's, or its ring slot */
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < 3; c++)
                    row_of[3 * r + c] = vt ? ring + c * ring_plane + (size_t)((made + r) % cap) * w2
                                           : out + c * plane + (size_t)(made + r) * w2;
            int from = 0;
#if AVX2_DISPATCH
            if (vector && rows == ROWS) from = float_unpack_avx2(done, row_of, w2);
#endif
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < 3; c++) {
                    float *row = row_of[3 * r + c];
                    float_unpack_row(done, r, c, row, from, w2);
                    if (vt) memcpy(row + (size_t)cap * w2, row, sizeof(float) * w2);
                }
            made += rows;
        }
        if (!vt) continue;
        int first = vt->first[y];
        for (int c = 0; c < 3; c++) {
            const float *window = ring + c * ring_plane + (size_t)(first % cap) * w2;
            for (int x0 = 0; x0 < w2; x0 += SPAN) {
                float acc[SPAN];
                int len = w2 - x0 < SPAN ? w2 - x0 : SPAN;
                float_sum(acc, window + x0, (size_t)w2, len, vt, y, first);
                memcpy(out + c * plane + (size_t)y * w2 + x0, acc, sizeof(float) * len);
            }
        }
    }
    status = 0;
end:
    free(block);
    free(done);
    free(ring);
    return status;
}

#define FLOAT_RESIZE_ARGS const uint8_t *src, Py_ssize_t src_stride, int pixel_bytes, int h, \
    int w, float *out, int h2, int w2, const float_taps *ht, const float_taps *vt
#define FLOAT_RESIZE_PASS src, src_stride, pixel_bytes, h, w, out, h2, w2, ht, vt
#define FLOAT_RESIZE_CALL(fn) fn(FLOAT_RESIZE_PASS)

static int float_resize_plain(FLOAT_RESIZE_ARGS) { return float_resize_body(FLOAT_RESIZE_PASS, 0); }

#if FMA_DISPATCH
__attribute__((target("avx2,fma")))
static int float_resize_fma(FLOAT_RESIZE_ARGS) { return float_resize_body(FLOAT_RESIZE_PASS, 1); }
#endif

/* whether this CPU runs the AVX2 + FMA code */
static int float_vector(void) {
#if FMA_DISPATCH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static int float_resize(FLOAT_RESIZE_ARGS, int plain) {
#if FMA_DISPATCH
    if (!plain && float_vector()) return FLOAT_RESIZE_CALL(float_resize_fma);
#endif
    return FLOAT_RESIZE_CALL(float_resize_plain);
}

/* (H, W, 3) uint8, each pixel's 3 values contiguous, pixels 3 (packed) or 4 (RGBX) bytes apart
   along a row; dst (writable) C-contiguous */
static int rgb_view(PyObject *object, Py_buffer *view, int writable, const char *name) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) return -1;
    int ok = view->ndim == 3 && view->itemsize == 1 && view->format &&
             (!strcmp(view->format, "B") || !strcmp(view->format, "<B") ||
              !strcmp(view->format, "=B")) &&
             view->shape[0] > 0 && view->shape[1] > 0 && view->shape[2] == 3 &&
             view->strides[2] == 1 &&
             (view->strides[1] == 3 || (!writable && view->strides[1] == 4)) &&
             view->strides[0] >= view->shape[1] * view->strides[1] &&
             view->shape[0] <= INT_MAX && view->shape[1] <= INT_MAX / 3 &&
             (!writable || view->strides[0] == view->shape[1] * 3);
    if (!ok) {
        PyErr_Format(PyExc_ValueError, "%s: expected (H, W, 3) uint8 pixels %s", name,
                     writable ? "C-contiguous" : "3 or 4 bytes apart, rows of ascending addresses");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *py_bicubic(PyObject *self, PyObject *args) {
    PyObject *src_object, *dst_object;
    int vertical_first, plain = 0, status, vector;
    Py_buffer src, dst;
    if (!PyArg_ParseTuple(args, "OOp|p", &src_object, &dst_object, &vertical_first, &plain))
        return NULL;
    vector = !plain && uint8_vector();
    if (rgb_view(src_object, &src, 0, "src") < 0) return NULL;
    if (rgb_view(dst_object, &dst, 1, "dst") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    const char *s0 = src.buf;
    const char *s1 = s0 + (src.shape[0] - 1) * src.strides[0] + src.shape[1] * src.strides[1];
    const char *d0 = dst.buf, *d1 = d0 + dst.len;
    if (s0 < d1 && d0 < s1) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        PyErr_SetString(PyExc_ValueError, "src and dst overlap");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    status = resize(src.buf, src.strides[0], (int)src.strides[1], (int)src.shape[0],
                    (int)src.shape[1], dst.buf, (int)dst.shape[0], (int)dst.shape[1],
                    vertical_first, vector);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* one axis's taps from Python: first, count (int32, out_size), weights (float32, out_size x k) */
static int taps_view(PyObject *first_o, PyObject *count_o, PyObject *weights_o, int in_size,
                     int out_size, int group, Py_buffer views[3], float_taps *t) {
    PyObject *objects[3] = {first_o, count_o, weights_o};
    for (int i = 0; i < 3; i++) {
        if (PyObject_GetBuffer(objects[i], &views[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            for (int j = 0; j < i; j++) PyBuffer_Release(&views[j]);
            return -1;
        }
    }
    int ok = views[0].itemsize == 4 && views[1].itemsize == 4 && views[2].itemsize == 4 &&
             views[0].format && views[1].format && views[2].format &&
             strchr("il", views[0].format[strlen(views[0].format) - 1]) &&
             strchr("il", views[1].format[strlen(views[1].format) - 1]) &&
             views[2].format[strlen(views[2].format) - 1] == 'f' &&
             views[0].len == 4 * (Py_ssize_t)out_size && views[1].len == views[0].len &&
             views[2].ndim == 2 && views[2].shape[0] == out_size && views[2].shape[1] >= 1 &&
             views[2].shape[1] <= INT_MAX && group >= 1;
    if (ok) {
        t->first = views[0].buf;
        t->count = views[1].buf;
        t->weights = views[2].buf;
        t->ksize = (int)views[2].shape[1];
        t->group = group;
        for (int o = 0; o < out_size && ok; o++)
            ok = t->first[o] >= 0 && t->count[o] >= 1 && t->count[o] <= t->ksize &&
                 t->first[o] <= in_size - t->count[o];
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "taps: expected int32 first and count per output, "
                        "float32 weights (outputs, k), inside the input");
        for (int i = 0; i < 3; i++) PyBuffer_Release(&views[i]);
        return -1;
    }
    return 0;
}

static PyObject *py_bicubic_float(PyObject *self, PyObject *args) {
    PyObject *src_o, *out_o, *hf, *hc, *hw, *vf, *vc, *vw;
    int group, plain = 0, status = 0, with_h, with_v;
    Py_buffer src, out, hv[3], vv[3];
    float_taps ht, vt;
    if (!PyArg_ParseTuple(args, "OOOOOOOOi|p", &src_o, &out_o, &hf, &hc, &hw, &vf, &vc, &vw,
                          &group, &plain))
        return NULL;
    if (rgb_view(src_o, &src, 0, "src") < 0) return NULL;
    if (PyObject_GetBuffer(out_o, &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    int h = (int)src.shape[0], w = (int)src.shape[1];
    if (out.ndim != 3 || out.shape[0] != 3 || out.shape[1] < 1 || out.shape[2] < 1 ||
        out.shape[1] > INT_MAX || out.shape[2] > INT_MAX || out.itemsize != 4 || !out.format ||
        out.format[strlen(out.format) - 1] != 'f') {
        PyErr_SetString(PyExc_ValueError, "out: expected (3, H2, W2) float32, C-contiguous");
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        return NULL;
    }
    int h2 = (int)out.shape[1], w2 = (int)out.shape[2];
    with_h = hf != Py_None;
    with_v = vf != Py_None;
    if ((!with_h && w != w2) || (!with_v && h != h2) ||
        (with_h && taps_view(hf, hc, hw, w, w2, group, hv, &ht) < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "taps missing for a resized side");
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        return NULL;
    }
    if (with_v && taps_view(vf, vc, vw, h, h2, group, vv, &vt) < 0) {
        if (with_h) for (int i = 0; i < 3; i++) PyBuffer_Release(&hv[i]);
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    status = float_resize(src.buf, src.strides[0], (int)src.strides[1], h, w, out.buf, h2, w2,
                          with_h ? &ht : NULL, with_v ? &vt : NULL, plain);
    Py_END_ALLOW_THREADS
    if (with_h) for (int i = 0; i < 3; i++) PyBuffer_Release(&hv[i]);
    if (with_v) for (int i = 0; i < 3; i++) PyBuffer_Release(&vv[i]);
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    if (status < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static int contiguous_view(PyObject *object, Py_buffer *view, int writable, int ndim,
                           const char *format, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0) return -1;
    const char *f = view->format ? view->format : "";
    if (*f == '<' || *f == '=') f++;
    if (view->ndim != ndim || strcmp(f, format)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a C-contiguous %d-D array of format %s",
                     name, ndim, format);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
/* count floats from the L1-resident cell to dst with non-temporal stores (the rows are written
 * once and read later: no read-for-ownership of their cache lines); dst 16-byte aligned, count a
 * multiple of 4 */
static void stream_floats(float *dst, const float *src, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
}
#define CAN_STREAM(dst, count) ((((uintptr_t)(dst)) & 15) == 0 && (count) % 4 == 0)
#define STREAM_FENCE() _mm_sfence()
#else
static void stream_floats(float *dst, const float *src, Py_ssize_t count) {
    memcpy(dst, src, (size_t)count * sizeof(float));
}
#define CAN_STREAM(dst, count) 1
#define STREAM_FENCE() ((void)0)
#endif

/* The cells of one patch of one frame, one per channel (cell c at cells + c * stride): each
   value lut[c][x] of the channel's uint8 x, the patch's rows in order. */
static void cells_lookup(const uint8_t *src, Py_ssize_t row_bytes, Py_ssize_t channels,
                         Py_ssize_t p, const float *table, float *cells, Py_ssize_t stride) {
    for (Py_ssize_t c = 0; c < channels; c++) {
        const float *lut = table + c * 256;
        const uint8_t *row = src + c;
        float *out = cells + c * stride;
        for (Py_ssize_t py = 0; py < p; py++, row += row_bytes)
            for (Py_ssize_t px = 0; px < p; px++) *out++ = lut[row[px * channels]];
    }
}

#if AVX2_DISPATCH
/* 16 channel values -> 16 floats ((float)x / divisor - mean) / std: the float32 ops of the Qwen
   processors' rescale and normalise, each rounded as a scalar op rounds (no FMA). */
__attribute__((target("avx2")))
static inline void normalized16(__m128i values, const float *k, float *out) {
    __m256 divisor = _mm256_set1_ps(k[0]), mean = _mm256_set1_ps(k[1]), std = _mm256_set1_ps(k[2]);
    __m256 low = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(values));
    __m256 high = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(values, 8)));
    _mm256_storeu_ps(out, _mm256_div_ps(_mm256_sub_ps(_mm256_div_ps(low, divisor), mean), std));
    _mm256_storeu_ps(out + 8,
                     _mm256_div_ps(_mm256_sub_ps(_mm256_div_ps(high, divisor), mean), std));
}

/* Whether normalized16 gives table[c] for every uint8 of every channel (3 channels), bit for
   bit: the table stays what the values are; the formula is only a faster way to them. */
__attribute__((target("avx2")))
static int formula_matches(const float *table, const float *constants) {
    float got[256];
    for (int c = 0; c < 3; c++) {
        const float k[3] = {constants[c], constants[3 + c], constants[6 + c]};
        for (int v = 0; v < 256; v += 16)
            normalized16(_mm_add_epi8(_mm_set1_epi8((char)v),
                                      _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                    14, 15)), k, got + v);
        if (memcmp(got, table + c * 256, sizeof(got))) return 0;
    }
    return 1;
}

/* cells_lookup for 3 channels and p <= 16, by the formula: each patch row's first 48 bytes (the
   caller checks they lie inside the frames) split into 16 values a channel with byte shuffles,
   16 floats stored at the row's place (the p < 16 rows' extra floats are overwritten by the
   next row, the last row's land in the cell's slack). */
__attribute__((target("avx2")))
static void cells_formula(const uint8_t *src, Py_ssize_t row_bytes, Py_ssize_t p,
                          const float *constants, float *cells, Py_ssize_t stride) {
    const __m128i r0 = _mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
                  r1 = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14, -1, -1, -1, -1, -1),
                  r2 = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1, 4, 7, 10, 13),
                  g0 = _mm_setr_epi8(1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
                  g1 = _mm_setr_epi8(-1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1),
                  g2 = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14),
                  b0 = _mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
                  b1 = _mm_setr_epi8(-1, -1, -1, -1, -1, 1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1),
                  b2 = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15);
    const float kr[3] = {constants[0], constants[3], constants[6]},
                kg[3] = {constants[1], constants[4], constants[7]},
                kb[3] = {constants[2], constants[5], constants[8]};
    for (Py_ssize_t py = 0; py < p; py++, src += row_bytes) {
        __m128i a = _mm_loadu_si128((const __m128i *)src),
                b = _mm_loadu_si128((const __m128i *)(src + 16)),
                c = _mm_loadu_si128((const __m128i *)(src + 32));
#define CHANNEL(m0, m1, m2) _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(a, m0), \
                                         _mm_shuffle_epi8(b, m1)), _mm_shuffle_epi8(c, m2))
        normalized16(CHANNEL(r0, r1, r2), kr, cells + py * p);
        normalized16(CHANNEL(g0, g1, g2), kg, cells + stride + py * p);
        normalized16(CHANNEL(b0, b1, b2), kb, cells + 2 * stride + py * p);
#undef CHANNEL
    }
}
#endif

/* cells: tp * channels cells of stride floats (p * p + 16). formula: cells_formula may run
   (AVX2, 3 channels, p <= 16, formula_matches). */
static void patch_rows(const uint8_t *frames, Py_ssize_t count, Py_ssize_t height,
                       Py_ssize_t width, Py_ssize_t channels, const float *table, float *dst,
                       Py_ssize_t p, Py_ssize_t m, Py_ssize_t tp, float *cells,
                       const float *constants, int formula) {
    Py_ssize_t grid_t = (count + tp - 1) / tp, block_h = height / (p * m),
               block_w = width / (p * m), row_bytes = width * channels, cell = p * p,
               stride = cell + 16;
    const uint8_t *frames_end = frames + count * height * row_bytes;
    int stream = CAN_STREAM(dst, cell);
#if !AVX2_DISPATCH
    (void)constants, (void)formula, (void)frames_end;
#endif
    for (Py_ssize_t gt = 0; gt < grid_t; gt++)
        for (Py_ssize_t by = 0; by < block_h; by++)
            for (Py_ssize_t bx = 0; bx < block_w; bx++)
                for (Py_ssize_t my = 0; my < m; my++)
                    for (Py_ssize_t mx = 0; mx < m; mx++) {
                        Py_ssize_t y0 = (by * m + my) * p, x0 = (bx * m + mx) * p;
                        /* each temporal slot's cells: its frame's, or the slot before's when
                           the frame is the same (an image's two slots, a video's padding) */
                        Py_ssize_t previous = -1, slot[tp];
                        for (Py_ssize_t t = 0; t < tp; t++) {
                            Py_ssize_t frame = gt * tp + t < count ? gt * tp + t : count - 1;
                            if (frame == previous) {
                                slot[t] = slot[t - 1];
                                continue;
                            }
                            previous = frame;
                            slot[t] = t;
                            const uint8_t *src = frames + (frame * height + y0) * row_bytes +
                                                 x0 * channels;
                            float *out = cells + t * channels * stride;
#if AVX2_DISPATCH
                            if (formula && src + (p - 1) * row_bytes + 48 <= frames_end) {
                                cells_formula(src, row_bytes, p, constants, out, stride);
                                continue;
                            }
#endif
                            cells_lookup(src, row_bytes, channels, p, table, out, stride);
                        }
                        for (Py_ssize_t c = 0; c < channels; c++)
                            for (Py_ssize_t t = 0; t < tp; t++, dst += cell) {
                                const float *from = cells + (slot[t] * channels + c) * stride;
                                if (stream)
                                    stream_floats(dst, from, cell);
                                else
                                    memcpy(dst, from, (size_t)cell * sizeof(float));
                            }
                    }
    if (stream) STREAM_FENCE();
}

static PyObject *py_patch_rows(PyObject *self, PyObject *args) {
    PyObject *frames_o, *table_o, *out_o, *constants_o = Py_None;
    Py_ssize_t p, m, tp;
    if (!PyArg_ParseTuple(args, "OOOnnn|O", &frames_o, &table_o, &out_o, &p, &m, &tp,
                          &constants_o))
        return NULL;
    Py_buffer fv, tv, ov, kv = {0};
    if (contiguous_view(frames_o, &fv, 0, 4, "B", "frames") < 0) return NULL;
    if (contiguous_view(table_o, &tv, 0, 2, "f", "table") < 0) {
        PyBuffer_Release(&fv);
        return NULL;
    }
    if (contiguous_view(out_o, &ov, 1, 2, "f", "out") < 0) {
        PyBuffer_Release(&fv);
        PyBuffer_Release(&tv);
        return NULL;
    }
    if (constants_o != Py_None && contiguous_view(constants_o, &kv, 0, 2, "f", "constants") < 0) {
        PyBuffer_Release(&fv);
        PyBuffer_Release(&tv);
        PyBuffer_Release(&ov);
        return NULL;
    }
    Py_ssize_t count = fv.shape[0], height = fv.shape[1], width = fv.shape[2],
               channels = fv.shape[3], side = p * m;
    int ok = p > 0 && m > 0 && tp > 0 && tp <= 64 && count > 0 && channels > 0 && height > 0 &&
             width > 0 && height % side == 0 && width % side == 0 && tv.shape[0] == channels &&
             tv.shape[1] == 256 && (!kv.buf || (kv.shape[0] == 3 && kv.shape[1] == channels));
    if (ok) {
        Py_ssize_t grid_t = (count + tp - 1) / tp;
        ok = ov.shape[0] == grid_t * (height / p) * (width / p) &&
             ov.shape[1] == channels * tp * p * p;
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "patch_rows: frames (T, H, W, C) with H, W multiples "
                        "of patch * merge, table (C, 256), out (rows, C * temporal * patch**2), "
                        "temporal <= 64, constants (3, C) or None");
    }
    float *cells = ok ? malloc((size_t)(tp * channels * (p * p + 16)) * sizeof(float)) : NULL;
    if (ok && !cells) {
        ok = 0;
        PyErr_NoMemory();
    }
    int formula = 0;
#if AVX2_DISPATCH
    formula = ok && kv.buf && channels == 3 && p <= 16 && uint8_vector() &&
              formula_matches(tv.buf, kv.buf);
#endif
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        patch_rows(fv.buf, count, height, width, channels, tv.buf, ov.buf, p, m, tp, cells,
                   kv.buf, formula);
        Py_END_ALLOW_THREADS
    }
    free(cells);
    PyBuffer_Release(&fv);
    PyBuffer_Release(&tv);
    PyBuffer_Release(&ov);
    if (kv.buf) PyBuffer_Release(&kv);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

#define NORMALIZE_ARGS const float *planes, Py_ssize_t count, Py_ssize_t channels, \
    Py_ssize_t height, Py_ssize_t width, const float *pre, const float *sub, const float *div, \
    float *dst, Py_ssize_t p, Py_ssize_t tp, float *line
#define NORMALIZE_CALL(fn) fn(planes, count, channels, height, width, pre, sub, div, dst, p, tp, \
                              line)

/* compiled twice as the float resize is: plain, and with AVX2 (8 lanes a vector; the same
   IEEE float32 subtract and divide, no FMA: -ffp-contract=off) */
ALWAYS_INLINE void normalize_rows_body(NORMALIZE_ARGS) {
    Py_ssize_t grid_t = (count + tp - 1) / tp, grid_h = height / p, grid_w = width / p,
               plane = height * width;
    int stream = CAN_STREAM(dst, p);
    for (Py_ssize_t gt = 0; gt < grid_t; gt++)
        for (Py_ssize_t gy = 0; gy < grid_h; gy++)
            for (Py_ssize_t gx = 0; gx < grid_w; gx++)
                for (Py_ssize_t t = 0; t < tp; t++) {
                    Py_ssize_t frame = gt * tp + t < count ? gt * tp + t : count - 1;
                    for (Py_ssize_t c = 0; c < channels; c++) {
                        const float *src = planes + (frame * channels + c) * plane +
                                           gy * p * width + gx * p;
                        const float a = pre[c], b = sub[c], d = div[c];
                        for (Py_ssize_t py = 0; py < p; py++, src += width, dst += p) {
                            if (a == 1.0f)  /* x / 1 is x: one division less */
                                for (Py_ssize_t px = 0; px < p; px++)
                                    line[px] = (src[px] - b) / d;
                            else
                                for (Py_ssize_t px = 0; px < p; px++)
                                    line[px] = ((src[px] / a) - b) / d;
                            if (stream)
                                stream_floats(dst, line, p);
                            else
                                memcpy(dst, line, (size_t)p * sizeof(float));
                        }
                    }
                }
    if (stream) STREAM_FENCE();
}

static void normalize_rows_plain(NORMALIZE_ARGS) { NORMALIZE_CALL(normalize_rows_body); }

#if FMA_DISPATCH
__attribute__((target("avx2")))
static void normalize_rows_avx2(NORMALIZE_ARGS) { NORMALIZE_CALL(normalize_rows_body); }
#endif

static void normalize_rows(NORMALIZE_ARGS) {
#if FMA_DISPATCH
    if (uint8_vector()) {
        NORMALIZE_CALL(normalize_rows_avx2);
        return;
    }
#endif
    NORMALIZE_CALL(normalize_rows_plain);
}

static PyObject *py_normalize_rows(PyObject *self, PyObject *args) {
    PyObject *objects[5];
    Py_ssize_t p, tp;
    if (!PyArg_ParseTuple(args, "OOOOOnn", &objects[0], &objects[1], &objects[2], &objects[3],
                          &objects[4], &p, &tp))
        return NULL;
    static const char *names[5] = {"planes", "pre", "sub", "div", "out"};
    static const int dims[5] = {4, 1, 1, 1, 2};
    Py_buffer views[5];
    int held = 0;
    for (; held < 5; held++)
        if (contiguous_view(objects[held], &views[held], held == 4, dims[held], "f",
                            names[held]) < 0)
            break;
    int ok = held == 5;
    if (ok) {
        Py_ssize_t count = views[0].shape[0], channels = views[0].shape[1],
                   height = views[0].shape[2], width = views[0].shape[3];
        ok = p > 0 && tp > 0 && count > 0 && channels > 0 && height > 0 && width > 0 &&
             height % p == 0 && width % p == 0 && views[1].shape[0] == channels &&
             views[2].shape[0] == channels && views[3].shape[0] == channels &&
             views[4].shape[0] == (count + tp - 1) / tp * (height / p) * (width / p) &&
             views[4].shape[1] == tp * channels * p * p;
        if (!ok)
            PyErr_SetString(PyExc_ValueError, "normalize_rows: planes (T, C, H, W) with H, W "
                            "multiples of patch, pre / sub / div (C,), out (rows, temporal * C "
                            "* patch**2), all float32 C-contiguous");
        float *line = ok ? malloc((size_t)p * sizeof(float)) : NULL;
        if (ok && !line) {
            ok = 0;
            PyErr_NoMemory();
        }
        if (ok) {
            Py_BEGIN_ALLOW_THREADS
            normalize_rows(views[0].buf, count, channels, height, width, views[1].buf,
                           views[2].buf, views[3].buf, views[4].buf, p, tp, line);
            Py_END_ALLOW_THREADS
        }
        free(line);
    }
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_float_isa(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(float_vector() ? "avx2+fma" : "plain");
}

static PyObject *py_uint8_isa(PyObject *self, PyObject *args) {
    return PyUnicode_FromString(uint8_vector() ? "avx2" : "plain");
}

static PyMethodDef methods[] = {
    {"bicubic", py_bicubic, METH_VARARGS,
     "bicubic(src, dst, vertical_first, plain=False): PIL's bicubic resize of src (H, W, 3) "
     "uint8, pixels 3 or 4 bytes apart, into dst (H2, W2, 3) uint8, C-contiguous; "
     "vertical_first: the vertical pass runs first; plain: the plain code even where the CPU "
     "has AVX2."},
    {"bicubic_float", py_bicubic_float, METH_VARARGS,
     "bicubic_float(src, out, h_first, h_count, h_weights, v_first, v_count, v_weights, group, "
     "plain=False): torch's antialiased bicubic of src (H, W, 3) uint8 in float32 into out "
     "(3, H2, W2) float32 with the given taps (None: that side kept); group: the summing rule; "
     "plain: the plain code even where the CPU has AVX2 and FMA."},
    {"patch_rows", py_patch_rows, METH_VARARGS,
     "patch_rows(frames, table, out, patch, merge, temporal): the Qwen ViT's patch rows of frames "
     "(T, H, W, C) uint8 into out (rows, C * temporal * patch**2) float32, each value table[c, "
     "x] of table (C, 256) float32; all C-contiguous; the last frame fills the temporal padding."},
    {"normalize_rows", py_normalize_rows, METH_VARARGS,
     "normalize_rows(planes, pre, sub, div, out, patch, temporal): Nemotron-Omni's patch rows of "
     "planes (T, C, H, W) float32 into out (rows, temporal * C * patch**2) float32, each value "
     "((x / pre[c]) - sub[c]) / div[c] in float32; all C-contiguous; the last frame fills the "
     "temporal padding."},
    {"uint8_isa", py_uint8_isa, METH_NOARGS,
     "uint8_isa(): which bicubic code this CPU runs, \"avx2\" or \"plain\"."},
    {"float_isa", py_float_isa, METH_NOARGS,
     "float_isa(): which bicubic_float code this CPU runs, \"avx2+fma\" or \"plain\"."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_resample", NULL, -1, methods};

PyMODINIT_FUNC PyInit__resample(void) { return PyModule_Create(&module); }
