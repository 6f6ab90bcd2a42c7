/* kimi_patchify's kernels: the normalise tables, the patch writers (float32 through the tables, uint8
 * as they are; an SSSE3 split for the presets' 14-pixel side) and the checks of one request's image
 * layout. Pure functions, exported for the tests and the fuzzer (ctypes). */

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "kimi_messages.h" /* generated at build time from kimi_vision_common/messages.py */
#include "kimi_patchify.h"

/* The messages' fields are %ld (kimi_vision_common/messages.py): a long must hold an int64_t. */
_Static_assert(sizeof(long) == sizeof(int64_t), "kimi_patchify builds on LP64 hosts (64-bit long)");

/* ----------------------------------------------------------------------------------- the kernels */

/* The reference's normalised value of every (value, channel), channel-major (tables[c * 256 + v]):
 * x = float32(v / 255.0), then x -= mean and x *= 1 / std with float64 operands, each stored
 * back to float32 (normalize.normalize_table, the same operations in the same order). */
void kimi_normalize_tables(const double mean[3], const double std[3], float tables[3 * 256]) {
  for (int c = 0; c < 3; c++) {
    const double scale = 1.0 / std[c];
    for (int v = 0; v < 256; v++) {
      float x = (float)(v / 255.0);
      x = (float)((double)x - mean[c]);
      tables[c * 256 + v] = (float)((double)x * scale);
    }
  }
}

/* Inlined where called: a call per patch measured 1.6x slower (float32). */
#define INLINE static inline __attribute__((always_inline))

/* One patch of the float32 output: patch[c, y, x] = tables[c][image[y, x, c]] for the ``rows`` x
 * ``cols`` pixels inside the image (``image`` at the patch's top-left pixel, ``stride`` bytes a
 * row), tables[c][0] past its edge. One channel plane after the other, so the patch is written as
 * one ascending stream; the inner loops are branch-free (as normalize._patch_row_by_plane). */
INLINE void lookup_patch(const uint8_t *image, size_t stride, size_t rows, size_t cols, const float *tables,
                         float *patch, size_t p) {
  for (size_t c = 0; c < 3; c++) {
    const float *table = tables + c * 256;
    for (size_t y = 0; y < p; y++) {
      float *o = patch + (c * p + y) * p;
      const size_t filled = y < rows ? cols : 0;
      const uint8_t *src = image + (y < rows ? y : 0) * stride + c;
      for (size_t x = 0; x < filled; x++) o[x] = table[src[3 * x]];
      for (size_t x = filled; x < p; x++) o[x] = table[0];
    }
  }
}

/* One patch of the uint8 output: patch[c, y, x] = image[y, x, c], 0 past the edge (no lookup). */
INLINE void split_patch(const uint8_t *image, size_t stride, size_t rows, size_t cols, uint8_t *patch, size_t p) {
  for (size_t c = 0; c < 3; c++) {
    for (size_t y = 0; y < p; y++) {
      uint8_t *o = patch + (c * p + y) * p;
      const size_t filled = y < rows ? cols : 0;
      const uint8_t *src = image + (y < rows ? y : 0) * stride + c;
      for (size_t x = 0; x < filled; x++) o[x] = src[3 * x];
      for (size_t x = filled; x < p; x++) o[x] = 0;
    }
  }
}

#if defined(__x86_64__)
#include <tmmintrin.h>
#define SPLIT_SIDE 14 /* the Kimi presets' patch_size: the one side with a vector kernel */

/* The pshufb masks of split_patch14: masks[c][v] picks channel c's bytes of a 14-pixel row (42
 * bytes) from its v-th 16-byte load (at bytes 0, 16 and 26), into lanes 0-13; 0x80 zeroes a lane. */
static void split_masks(__m128i masks[3][3]) {
  static const int starts[3] = {0, 16, 26};
  for (int c = 0; c < 3; c++) {
    uint8_t picks[3][16];
    for (int x = 0; x < 16; x++) {
      const int byte = 3 * x + c, part = byte < 16 ? 0 : byte < 32 ? 1 : 2;
      for (int v = 0; v < 3; v++) picks[v][x] = x < SPLIT_SIDE && v == part ? (uint8_t)(byte - starts[v]) : 0x80;
    }
    for (int v = 0; v < 3; v++) masks[c][v] = _mm_loadu_si128((const __m128i *)picks[v]);
  }
}

/* A whole 14x14 patch of the uint8 output by byte shuffles (SSSE3, on every x86-64 CPU since 2006;
 * checked at run time): each image row of the patch is loaded as three 16-byte vectors that end
 * at the row's last byte, and each channel's 14 bytes are gathered from them by three pshufb. A
 * row is stored as 16 bytes, whose last two the plane's next row overwrites; the last row of
 * each plane goes through a buffer, so nothing outside the patch is written. */
__attribute__((target("ssse3"))) static void split_patch14(const uint8_t *image, size_t stride, uint8_t *patch,
                                                            const __m128i masks[3][3]) {
  __m128i m[3][3]; /* a local copy: the byte stores could alias masks, which would be reloaded each row */
  memcpy(m, masks, sizeof m);
  for (size_t y = 0; y < SPLIT_SIDE; y++) {
    const uint8_t *row = image + y * stride;
    const __m128i parts[3] = {_mm_loadu_si128((const __m128i *)row), _mm_loadu_si128((const __m128i *)(row + 16)),
                              _mm_loadu_si128((const __m128i *)(row + 26))};
    for (int c = 0; c < 3; c++) {
      const __m128i plane = _mm_or_si128(
          _mm_or_si128(_mm_shuffle_epi8(parts[0], m[c][0]), _mm_shuffle_epi8(parts[1], m[c][1])),
          _mm_shuffle_epi8(parts[2], m[c][2]));
      uint8_t *o = patch + (c * SPLIT_SIDE + y) * SPLIT_SIDE;
      if (y + 1 < SPLIT_SIDE) {
        _mm_storeu_si128((__m128i *)o, plane);
      } else {
        uint8_t last[16];
        _mm_storeu_si128((__m128i *)last, plane);
        memcpy(o, last, SPLIT_SIDE);
      }
    }
  }
}
#endif

/* Every patch of one image (height x width x 3) into out[gy * grid_w + gx]: float32 through the
 * tables when values, else the uint8 pixels (whole 14x14 patches by split_patch14 where the CPU
 * has SSSE3: 7x faster on a 7 MB answer, tests/test_patchify_backend.py checks both ways). */
void kimi_write_patches(const uint8_t *image, size_t height, size_t width, const float *tables, void *out,
                        size_t grid_h, size_t grid_w, size_t p, bool values) {
  const size_t stride = width * 3, per_patch = 3 * p * p;
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool vector = !values && p == SPLIT_SIDE && __builtin_cpu_supports("ssse3");
  __m128i masks[3][3];
  if (vector) split_masks(masks); /* read by split_patch14 only */
#endif
  for (size_t gy = 0; gy < grid_h; gy++) {
    const size_t y0 = gy * p;
    const size_t rows = height > y0 ? (height - y0 < p ? height - y0 : p) : 0;
    for (size_t gx = 0; gx < grid_w; gx++) {
      const size_t x0 = gx * p, index = gy * grid_w + gx;
      const size_t cols = width > x0 ? (width - x0 < p ? width - x0 : p) : 0;
      const uint8_t *corner = image + (rows && cols ? y0 * stride + x0 * 3 : 0);
      if (values) {
        lookup_patch(corner, stride, rows, cols, tables, (float *)out + index * per_patch, p);
        continue;
      }
#if defined(__x86_64__)
      if (vector && rows == p && cols == p) {
        split_patch14(corner, stride, (uint8_t *)out + index * per_patch, masks);
        continue;
      }
#endif
      split_patch(corner, stride, rows, cols, (uint8_t *)out + index * per_patch, p);
    }
  }
}

/* Exported for the tests (ctypes): the kernels on one uint8 (height, width, 3) image into
 * (grid_h * grid_w, 3, p, p); the caller guarantees height <= grid_h * p and width <= grid_w * p. */
void kimi_write_patches_f32(const uint8_t *image, size_t height, size_t width, const float *tables, float *out,
                            size_t grid_h, size_t grid_w, size_t p) {
  kimi_write_patches(image, height, width, tables, out, grid_h, grid_w, p, true);
}

void kimi_write_patches_u8(const uint8_t *image, size_t height, size_t width, uint8_t *out, size_t grid_h,
                           size_t grid_w, size_t p) {
  kimi_write_patches(image, height, width, NULL, out, grid_h, grid_w, p, false);
}

static int verdict(char *message, size_t capacity, int code, const char *format, ...)
    __attribute__((format(printf, 4, 5)));

static int verdict(char *message, size_t capacity, int code, const char *format, ...) {
  va_list args;
  va_start(args, format);
  vsnprintf(message, capacity, format, args);
  va_end(args);
  return code;
}

/* The layout of one request (kimi_vision_server/models/requests.py, check_image_layout: the same rules and words,
 * kimi_messages.h): K rows of
 * IMAGE_SHAPES (height, width, channels, offset) that tile an IMAGE of `length` bytes in order,
 * without gaps or overlap; RGB; each image within the preset's bounds, all of them within
 * max_patches_per_request. Fills images[k] (where images is not NULL) and *total_patches; returns
 * CHECK_OK, or CHECK_INVALID / CHECK_TOO_LARGE with the reason in `message`. Pure: exported for the
 * tests and the fuzzer (ctypes). */
int kimi_check_images(const Limits *limits, const int64_t *rows, int64_t k, int64_t length, Image *images,
                      size_t *total_patches, char *message, size_t capacity) {
  *total_patches = 0;
  if (length < 0) return verdict(message, capacity, CHECK_INVALID, "IMAGE must have shape [1, L]");
  if (k < 1) return verdict(message, capacity, CHECK_INVALID, "IMAGE_SHAPES must have shape [1, K, 4] with K >= 1");
  if (k > limits->max_images)
    return verdict(message, capacity, CHECK_INVALID, KIMI_MSG_TOO_MANY_IMAGES, (long)k, (long)limits->max_images);
  const int64_t p = limits->patch_size, f = limits->factor, side_px = limits->side_limit * p;
  int64_t expected = 0; /* where image `index` must start: right after the one before it */
  for (int64_t index = 0; index < k; index++) {
    const int64_t *row = rows + 4 * index;
    const int64_t h = row[0], w = row[1], c = row[2], offset = row[3];
    if (h < 1 || w < 1 || c < 1)
      return verdict(message, capacity, CHECK_INVALID, KIMI_MSG_ROW_BELOW_ONE, (long)index, (long)h, (long)w, (long)c,
                     (long)offset);
    if (offset != expected)
      return verdict(message, capacity, CHECK_INVALID, KIMI_MSG_ROW_NOT_NEXT, (long)index, (long)h, (long)w, (long)c,
                     (long)offset, (long)index, (long)expected);
    if (c != 3) return verdict(message, capacity, CHECK_INVALID, KIMI_MSG_NOT_RGB, (long)index, (long)c);
    const int64_t grid_h = h > side_px ? 0 : (h + f - 1) / f * f / p;
    const int64_t grid_w = w > side_px ? 0 : (w + f - 1) / f * f / p;
    if (h > side_px || w > side_px || grid_h > limits->side_limit || grid_w > limits->side_limit ||
        grid_h * grid_w > limits->image_patches)
      return verdict(message, capacity, CHECK_TOO_LARGE, KIMI_MSG_GRID_TOO_LARGE, (long)index, (long)w, (long)h,
                     (long)grid_w, (long)grid_h, (long)limits->side_limit, (long)limits->image_patches);
    int64_t bytes;
    if (__builtin_mul_overflow(h, w, &bytes) || __builtin_mul_overflow(bytes, (int64_t)3, &bytes) ||
        bytes > length - offset)
      return verdict(message, capacity, CHECK_INVALID, KIMI_MSG_ROW_OUTSIDE_IMAGE, (long)index, (long)h, (long)w,
                     (long)c, (long)offset, (long)length);
    expected = offset + bytes;
    if (images != NULL)
      images[index] = (Image){(size_t)h, (size_t)w, (size_t)offset, (size_t)grid_h, (size_t)grid_w,
                              (size_t)(grid_h * grid_w)};
    *total_patches += (size_t)(grid_h * grid_w);
  }
  if (expected != length)
    return verdict(message, capacity, CHECK_INVALID, KIMI_MSG_IMAGE_HAS_GAPS, (long)length, (long)k, (long)expected);
  if (*total_patches > (size_t)limits->max_patches)
    return verdict(message, capacity, CHECK_TOO_LARGE, KIMI_MSG_PATCHES_OVER_BUDGET, (long)*total_patches,
                   (long)limits->max_patches);
  return CHECK_OK;
}

