/* What the C step's files share: the model state and a request's limits, the errors (tagged with a
 * class of kimi_vision_common.errors), the kernels' entry points (kernels.c). */

#ifndef KIMI_PATCHIFY_H
#define KIMI_PATCHIFY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kimi_errors.h" /* generated at build time from kimi_vision_common/errors.py */
#include "triton_api.h"

/* Shared between the step's files, not exported from the shared object. */
#define KIMI_INTERNAL __attribute__((visibility("hidden")))

/* A request's limits (the model's parameters), in this order for kimi_check_images' callers. */
typedef struct {
  int64_t patch_size, factor, side_limit, image_patches, max_images, max_patches;
} Limits;

typedef struct {
  size_t height, width, offset, grid_h, grid_w, patches;
} Image;

typedef struct {
  char name[128];
  Limits limits;
  float value_tables[3 * 256];
} ModelState;

/* An error whose message starts with ``tag: `` (a class of kimi_vision_prep.errors); backend.c. */
KIMI_INTERNAL TRITONSERVER_Error *kimi_error_new(int code, const char *tag, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

/* The classes of kimi_vision_common/errors.py and their Triton codes (kimi_errors.h, generated). */
#define INVALID_REQUEST(...) kimi_error_new(KIMI_INVALID_REQUEST_CODE, KIMI_INVALID_REQUEST_TAG, __VA_ARGS__)
#define TOO_LARGE(...) kimi_error_new(KIMI_TOO_LARGE_CODE, KIMI_TOO_LARGE_TAG, __VA_ARGS__)
#define INTERNAL(...) kimi_error_new(KIMI_INTERNAL_CODE, KIMI_INTERNAL_TAG, "internal error: " __VA_ARGS__)
#define RETURN_IF_ERROR(expr)                \
  do {                                       \
    TRITONSERVER_Error *error_ = (expr);     \
    if (error_ != NULL) return error_;       \
  } while (0)


enum { CHECK_OK = 0, CHECK_INVALID = 1, CHECK_TOO_LARGE = 2 };

/* kernels.c (exported: the tests and the fuzzer call them through ctypes) */
void kimi_normalize_tables(const double mean[3], const double std[3], float tables[3 * 256]);
void kimi_write_patches_f32(const uint8_t *image, size_t height, size_t width, const float *tables, float *out,
                            size_t grid_h, size_t grid_w, size_t p);
void kimi_write_patches_u8(const uint8_t *image, size_t height, size_t width, uint8_t *out, size_t grid_h,
                           size_t grid_w, size_t p);
/* The patches of one image into out (float32 through tables where values, else uint8), padded. */
KIMI_INTERNAL void kimi_write_patches(const uint8_t *image, size_t height, size_t width, const float *tables, void *out,
                                      size_t grid_h, size_t grid_w, size_t p, bool values);
int kimi_check_images(const Limits *limits, const int64_t *rows, int64_t k, int64_t length, Image *images,
                      size_t *total_patches, char *message, size_t capacity);

#endif
