/* kimi_patchify: a Triton backend (C API) that pads, normalises and patchifies decoded RGB images.
 *
 * The last step of the kimi_*_vision ensembles on CPU hosts (kimi_vision_server/render/repository.py renders it as
 * kimi_*_patchify). It runs inside tritonserver: no Python stub, so the decoded image is read
 * where the decode step's output lies and the pixels are written straight into the buffer Triton
 * hands out (the ensemble's, or the client's shared-memory region), where the Python preprocess
 * step copied its input into and its 37 MiB float32 output out of the stub's shared memory
 * (BENCHMARKS.md, "patchify").
 *
 * Inputs (one request = one batch row, max_batch_size >= 1):
 *   IMAGE         uint8 [1, L]: K RGB images, flat (kimi_vision_server/models/requests.py: the decode step's layout)
 *   IMAGE_SHAPES  int64 [1, K, 4]: height, width, channels (3), offset into IMAGE; the K images
 *                 tile IMAGE in order without gaps or overlap (kimi_check_images), else the
 *                 request is refused before any output exists
 * Outputs, each computed only when requested:
 *   PIXEL_VALUES  float32 [1, N, 3, p, p]: normalize_table(mean, std)[pixel, c], zero pixels as
 *                 padding to a multiple of merge_kernel_size * patch_size (normalize.write_patches)
 *   PIXEL_PATCHES uint8 [1, N, 3, p, p]: the same patches before the lookup
 *   GRID_THW      int64 [1, K, 3]: (1, grid_h, grid_w);  NUM_TOKENS int32 [1, K]
 * Parameters (read from the model config's JSON, all rendered from the Python definitions): the
 * preset block every kimi model gets (patch_size, merge_kernel_size, image_mean, image_std,
 * patch_limit_on_one_side) and the settings kimi_vision_server/settings.py gives this step:
 * max_images_per_request, max_patches_per_request (the request's patch budget, docs/security.md)
 * and max_patches_per_image (kimi_vision_common.sizing.navit_patch_bound).
 *
 * The images are taken at the size they come in (the decode step sends their NaViT size; this
 * step does not resize). Bounds, so that no request can make it write more than a preset's
 * budget allows: each side at most patch_limit_on_one_side patches after padding, and at most
 * max_patches_per_image patches an image. A bad request gets its own error, tagged with the class of
 * kimi_vision_common.errors that error_from_served turns it back into, with that class's Triton code.
 *
 * The Triton API is declared here (the functions this file calls, as tritonserver.h and
 * tritonbackend.h of API 1.x declare them) and weak: the shared object then also loads outside
 * tritonserver (ctypes, for the kernel tests), and TRITONBACKEND_Initialize refuses a server
 * that lacks any of them, by name (TRITON_API). Inside tritonserver they bind to its libtritonserver.
 */

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kimi_json.h"     /* the strict JSON reader of the model config (kimi_json.c) */
#include "kimi_errors.h"   /* generated at build time from kimi_vision_common/errors.py */
#include "kimi_messages.h" /* generated at build time from kimi_vision_common/messages.py */

/* The messages' fields are %ld (kimi_vision_common/messages.py): a long must hold an int64_t. */
_Static_assert(sizeof(long) == sizeof(int64_t), "kimi_patchify builds on LP64 hosts (64-bit long)");

/* ----------------------------------------------------------------------- the Triton C API (1.x) */

typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Message TRITONSERVER_Message;
typedef struct TRITONBACKEND_Backend TRITONBACKEND_Backend;
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;
typedef struct TRITONBACKEND_ModelInstance TRITONBACKEND_ModelInstance;
typedef struct TRITONBACKEND_Request TRITONBACKEND_Request;
typedef struct TRITONBACKEND_Response TRITONBACKEND_Response;
typedef struct TRITONBACKEND_Input TRITONBACKEND_Input;
typedef struct TRITONBACKEND_Output TRITONBACKEND_Output;
typedef struct TRITONBACKEND_ResponseFactory TRITONBACKEND_ResponseFactory;
typedef struct TRITONSERVER_MetricFamily TRITONSERVER_MetricFamily;
typedef struct TRITONSERVER_Metric TRITONSERVER_Metric;
typedef struct TRITONSERVER_Parameter TRITONSERVER_Parameter;

typedef enum { TYPE_UINT8 = 2, TYPE_INT32 = 8, TYPE_INT64 = 9, TYPE_FP32 = 11 } DataType;
typedef enum { MEMORY_CPU = 0, MEMORY_CPU_PINNED = 1, MEMORY_GPU = 2 } MemoryType;
typedef enum { LOG_INFO = 0, LOG_ERROR = 2 } LogLevel;
enum { REQUEST_RELEASE_ALL = 1, RESPONSE_COMPLETE_FINAL = 1, BACKEND_API_MAJOR = 1 };
enum { METRIC_KIND_COUNTER = 0, PARAMETER_STRING = 0 };

#define WEAK __attribute__((weak))
WEAK TRITONSERVER_Error *TRITONSERVER_ErrorNew(int code, const char *msg);
WEAK void TRITONSERVER_ErrorDelete(TRITONSERVER_Error *error);
WEAK const char *TRITONSERVER_ErrorMessage(TRITONSERVER_Error *error);
WEAK TRITONSERVER_Error *TRITONSERVER_MessageSerializeToJson(TRITONSERVER_Message *message, const char **base,
                                                             size_t *byte_size);
WEAK TRITONSERVER_Error *TRITONSERVER_MessageDelete(TRITONSERVER_Message *message);
WEAK TRITONSERVER_Error *TRITONSERVER_LogMessage(int level, const char *filename, int line, const char *msg);
WEAK TRITONSERVER_Error *TRITONBACKEND_ApiVersion(uint32_t *major, uint32_t *minor);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelName(TRITONBACKEND_Model *model, const char **name);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelConfig(TRITONBACKEND_Model *model, uint32_t config_version,
                                                   TRITONSERVER_Message **model_config);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelState(TRITONBACKEND_Model *model, void **state);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelSetState(TRITONBACKEND_Model *model, void *state);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceModel(TRITONBACKEND_ModelInstance *instance,
                                                          TRITONBACKEND_Model **model);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestInput(TRITONBACKEND_Request *request, const char *name,
                                                    TRITONBACKEND_Input **input);
WEAK TRITONSERVER_Error *TRITONBACKEND_InputProperties(TRITONBACKEND_Input *input, const char **name,
                                                       int *datatype, const int64_t **shape, uint32_t *dims_count,
                                                       uint64_t *byte_size, uint32_t *buffer_count);
WEAK TRITONSERVER_Error *TRITONBACKEND_InputBuffer(TRITONBACKEND_Input *input, uint32_t index, const void **buffer,
                                                   uint64_t *buffer_byte_size, int *memory_type,
                                                   int64_t *memory_type_id);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestOutputCount(TRITONBACKEND_Request *request, uint32_t *count);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestOutputName(TRITONBACKEND_Request *request, uint32_t index,
                                                         const char **output_name);
WEAK TRITONSERVER_Error *TRITONBACKEND_RequestRelease(TRITONBACKEND_Request *request, uint32_t release_flags);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseNew(TRITONBACKEND_Response **response, TRITONBACKEND_Request *request);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseFactoryNew(TRITONBACKEND_ResponseFactory **factory,
                                                         TRITONBACKEND_Request *request);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseFactoryDelete(TRITONBACKEND_ResponseFactory *factory);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseNewFromFactory(TRITONBACKEND_Response **response,
                                                             TRITONBACKEND_ResponseFactory *factory);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseOutput(TRITONBACKEND_Response *response, TRITONBACKEND_Output **output,
                                                      const char *name, int datatype, const int64_t *shape,
                                                      uint32_t dims_count);
WEAK TRITONSERVER_Error *TRITONBACKEND_OutputBuffer(TRITONBACKEND_Output *output, void **buffer,
                                                    uint64_t buffer_byte_size, int *memory_type,
                                                    int64_t *memory_type_id);
WEAK TRITONSERVER_Error *TRITONBACKEND_ResponseSend(TRITONBACKEND_Response *response, uint32_t send_flags,
                                                    TRITONSERVER_Error *error);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceName(TRITONBACKEND_ModelInstance *instance, const char **name);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceState(TRITONBACKEND_ModelInstance *instance, void **state);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceSetState(TRITONBACKEND_ModelInstance *instance, void *state);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricFamilyNew(TRITONSERVER_MetricFamily **family, int kind, const char *name,
                                                      const char *description);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricNew(TRITONSERVER_Metric **metric, TRITONSERVER_MetricFamily *family,
                                                const TRITONSERVER_Parameter **labels, uint64_t label_count);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricDelete(TRITONSERVER_Metric *metric);
WEAK TRITONSERVER_Error *TRITONSERVER_MetricIncrement(TRITONSERVER_Metric *metric, double value);
WEAK TRITONSERVER_Parameter *TRITONSERVER_ParameterNew(const char *name, int type, const void *value);
WEAK void TRITONSERVER_ParameterDelete(TRITONSERVER_Parameter *parameter);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportStatistics(TRITONBACKEND_ModelInstance *instance,
                                                                     TRITONBACKEND_Request *request, bool success,
                                                                     uint64_t exec_start_ns, uint64_t compute_start_ns,
                                                                     uint64_t compute_end_ns, uint64_t exec_end_ns);
WEAK TRITONSERVER_Error *TRITONBACKEND_ModelInstanceReportBatchStatistics(TRITONBACKEND_ModelInstance *instance,
                                                                          uint64_t batch_size, uint64_t exec_start_ns,
                                                                          uint64_t compute_start_ns,
                                                                          uint64_t compute_end_ns,
                                                                          uint64_t exec_end_ns);

/* Every function declared above, by name: TRITONBACKEND_Initialize refuses a server that lacks
 * one (weak, it would be NULL), naming it, before any is called (tests/test_patchify_backend.py
 * checks that this table and the declarations name the same functions). */
#define API(function) {#function, (const void *)function}
static const struct {
  const char *name;
  const void *address;
} TRITON_API[] = {
    API(TRITONSERVER_ErrorNew),
    API(TRITONSERVER_ErrorDelete),
    API(TRITONSERVER_ErrorMessage),
    API(TRITONSERVER_MessageSerializeToJson),
    API(TRITONSERVER_MessageDelete),
    API(TRITONSERVER_LogMessage),
    API(TRITONBACKEND_ApiVersion),
    API(TRITONBACKEND_ModelName),
    API(TRITONBACKEND_ModelConfig),
    API(TRITONBACKEND_ModelState),
    API(TRITONBACKEND_ModelSetState),
    API(TRITONBACKEND_ModelInstanceModel),
    API(TRITONBACKEND_RequestInput),
    API(TRITONBACKEND_InputProperties),
    API(TRITONBACKEND_InputBuffer),
    API(TRITONBACKEND_RequestOutputCount),
    API(TRITONBACKEND_RequestOutputName),
    API(TRITONBACKEND_RequestRelease),
    API(TRITONBACKEND_ResponseNew),
    API(TRITONBACKEND_ResponseFactoryNew),
    API(TRITONBACKEND_ResponseFactoryDelete),
    API(TRITONBACKEND_ResponseNewFromFactory),
    API(TRITONBACKEND_ResponseOutput),
    API(TRITONBACKEND_OutputBuffer),
    API(TRITONBACKEND_ResponseSend),
    API(TRITONBACKEND_ModelInstanceName),
    API(TRITONBACKEND_ModelInstanceState),
    API(TRITONBACKEND_ModelInstanceSetState),
    API(TRITONSERVER_MetricFamilyNew),
    API(TRITONSERVER_MetricNew),
    API(TRITONSERVER_MetricDelete),
    API(TRITONSERVER_MetricIncrement),
    API(TRITONSERVER_ParameterNew),
    API(TRITONSERVER_ParameterDelete),
    API(TRITONBACKEND_ModelInstanceReportStatistics),
    API(TRITONBACKEND_ModelInstanceReportBatchStatistics),
};
#undef API

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
static void write_patches(const uint8_t *image, size_t height, size_t width, const float *tables, void *out,
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
  write_patches(image, height, width, tables, out, grid_h, grid_w, p, true);
}

void kimi_write_patches_u8(const uint8_t *image, size_t height, size_t width, uint8_t *out, size_t grid_h,
                           size_t grid_w, size_t p) {
  write_patches(image, height, width, NULL, out, grid_h, grid_w, p, false);
}

/* -------------------------------------------------------------------------------- the model state */

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

static TRITONSERVER_Error *error_new(int code, const char *tag, const char *format, ...)
    __attribute__((format(printf, 3, 4)));

/* An error whose message starts with ``tag: `` (a class of kimi_vision_prep.errors). */
static TRITONSERVER_Error *error_new(int code, const char *tag, const char *format, ...) {
  char message[1024];
  int used = snprintf(message, sizeof message, "%s: ", tag);
  va_list args;
  va_start(args, format);
  vsnprintf(message + used, sizeof message - (size_t)used, format, args);
  va_end(args);
  return TRITONSERVER_ErrorNew(code, message);
}

/* The classes of kimi_vision_common/errors.py and their Triton codes (kimi_errors.h, generated). */
#define INVALID_REQUEST(...) error_new(KIMI_INVALID_REQUEST_CODE, KIMI_INVALID_REQUEST_TAG, __VA_ARGS__)
#define TOO_LARGE(...) error_new(KIMI_TOO_LARGE_CODE, KIMI_TOO_LARGE_TAG, __VA_ARGS__)
#define INTERNAL(...) error_new(KIMI_INTERNAL_CODE, KIMI_INTERNAL_TAG, "internal error: " __VA_ARGS__)
#define RETURN_IF_ERROR(expr)                \
  do {                                       \
    TRITONSERVER_Error *error_ = (expr);     \
    if (error_ != NULL) return error_;       \
  } while (0)

/* ------------------------------------------------------------------ the model config */

/* The string value of parameter ``key`` into text[capacity], or the error that says why not. */
static TRITONSERVER_Error *text_parameter(const char *json, size_t size, const char *key, char *text, size_t capacity) {
  switch (kimi_config_parameter(json, size, key, text, capacity)) {
    case 1:
      return NULL;
    case 0:
      return INTERNAL("the model config has no parameter %s (render it with kimi-prep render-repository)", key);
    default:
      return INTERNAL("the model config's JSON is malformed, or parameter %s is longer than %zu bytes", key,
                      capacity - 1);
  }
}

static TRITONSERVER_Error *int_parameter(const char *json, size_t size, const char *key, int64_t *value) {
  char text[64], *parsed_end;
  RETURN_IF_ERROR(text_parameter(json, size, key, text, sizeof text));
  errno = 0;
  long long parsed = strtoll(text, &parsed_end, 10);
  if (parsed_end == text || *parsed_end != '\0' || errno == ERANGE || parsed < 1)
    return INTERNAL("parameter %s=%s is not a positive 64-bit integer", key, text);
  *value = parsed;
  return NULL;
}

static TRITONSERVER_Error *triple_parameter(const char *json, size_t size, const char *key, double values[3]) {
  char text[256];
  RETURN_IF_ERROR(text_parameter(json, size, key, text, sizeof text));
  const char *at = text;
  for (int c = 0; c < 3; c++) {
    char *parsed_end;
    values[c] = strtod(at, &parsed_end);
    if (parsed_end == at || !isfinite(values[c])) return INTERNAL("parameter %s=%s is not 3 floats", key, text);
    at = parsed_end;
    while (*at == ',' || *at == ' ') at++;
  }
  if (*at != '\0') return INTERNAL("parameter %s=%s is not 3 floats", key, text);
  return NULL;
}

static TRITONSERVER_Error *read_state(const char *json, size_t size, ModelState *state) {
  int64_t merge, side_patches;
  double mean[3], std[3];
  RETURN_IF_ERROR(int_parameter(json, size, "patch_size", &state->limits.patch_size));
  RETURN_IF_ERROR(int_parameter(json, size, "merge_kernel_size", &merge));
  RETURN_IF_ERROR(int_parameter(json, size, "patch_limit_on_one_side", &side_patches));
  RETURN_IF_ERROR(int_parameter(json, size, "max_patches_per_image", &state->limits.image_patches));
  RETURN_IF_ERROR(int_parameter(json, size, "max_images_per_request", &state->limits.max_images));
  RETURN_IF_ERROR(int_parameter(json, size, "max_patches_per_request", &state->limits.max_patches));
  RETURN_IF_ERROR(triple_parameter(json, size, "image_mean", mean));
  RETURN_IF_ERROR(triple_parameter(json, size, "image_std", std));
  for (int c = 0; c < 3; c++)
    if (std[c] == 0.0) return INTERNAL("parameter image_std has a zero");
  /* Every product kimi_check_images forms from these must fit in int64: limits that do not are refused. */
  int64_t side_px, side_squared, padded;
  if (__builtin_mul_overflow(merge, state->limits.patch_size, &state->limits.factor) ||
      __builtin_mul_overflow(side_patches, state->limits.patch_size, &side_px) ||
      __builtin_add_overflow(side_px, state->limits.factor, &padded) ||
      __builtin_mul_overflow(side_patches, side_patches, &side_squared))
    return INTERNAL("parameters patch_size, merge_kernel_size and patch_limit_on_one_side overflow 64-bit sizes");
  state->limits.side_limit = side_patches;
  kimi_normalize_tables(mean, std, state->value_tables);
  return NULL;
}

/* ------------------------------------------------------------------------------ backend entries */

TRITONSERVER_Error *TRITONBACKEND_Initialize(TRITONBACKEND_Backend *backend) {
  (void)backend;
  if (TRITONSERVER_ErrorNew == NULL) return NULL; /* not inside tritonserver: nothing can be reported */
  for (size_t i = 0; i < sizeof TRITON_API / sizeof TRITON_API[0]; i++)
    if (TRITON_API[i].address == NULL)
      return INTERNAL("kimi_patchify: this tritonserver lacks %s of the Triton C API 1.x, which this backend calls",
                      TRITON_API[i].name);
  uint32_t major, minor;
  RETURN_IF_ERROR(TRITONBACKEND_ApiVersion(&major, &minor));
  if (major != BACKEND_API_MAJOR)
    return INTERNAL("kimi_patchify needs Triton backend API %d.x, this tritonserver has %u.%u", BACKEND_API_MAJOR,
                    major, minor);
  return NULL;
}

TRITONSERVER_Error *TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model *model) {
  const char *name, *json;
  size_t size;
  TRITONSERVER_Message *config;
  RETURN_IF_ERROR(TRITONBACKEND_ModelName(model, &name));
  RETURN_IF_ERROR(TRITONBACKEND_ModelConfig(model, 1, &config));
  TRITONSERVER_Error *error = TRITONSERVER_MessageSerializeToJson(config, &json, &size);
  ModelState *state = calloc(1, sizeof *state);
  if (error == NULL && state == NULL) error = INTERNAL("out of memory");
  if (error == NULL) error = read_state(json, size, state);
  TRITONSERVER_Error *deleted = TRITONSERVER_MessageDelete(config);
  if (deleted != NULL) TRITONSERVER_ErrorDelete(deleted);
  if (error == NULL) error = TRITONBACKEND_ModelSetState(model, state);
  if (error != NULL) {
    free(state);
    return error;
  }
  snprintf(state->name, sizeof state->name, "%s", name);
  char line[256];
  snprintf(line, sizeof line, "%s: patch_size %lld, padding to %lld px, at most %lld patches a side (C backend)",
           state->name, (long long)state->limits.patch_size, (long long)state->limits.factor, (long long)state->limits.side_limit);
  TRITONSERVER_Error *logged = TRITONSERVER_LogMessage(LOG_INFO, __FILE__, __LINE__, line);
  if (logged != NULL) TRITONSERVER_ErrorDelete(logged);
  return NULL;
}

/* kimi_prep_stage_seconds_total{model, instance, stage="patchify"}: the family, name and help the
 * Python models use (kimi_vision_server/models/metrics.py), so Triton merges them into one family. The family is
 * never deleted here: the Python models' series live in it too. */
static const char STAGE_FAMILY[] = "kimi_prep_stage_seconds_total";
static const char STAGE_HELP[] = "Cumulative wall time per stage in seconds";

static TRITONSERVER_Error *stage_metric(const char *model, const char *instance, TRITONSERVER_Metric **metric) {
  TRITONSERVER_MetricFamily *family;
  RETURN_IF_ERROR(TRITONSERVER_MetricFamilyNew(&family, METRIC_KIND_COUNTER, STAGE_FAMILY, STAGE_HELP));
  const TRITONSERVER_Parameter *labels[3] = {
      TRITONSERVER_ParameterNew("model", PARAMETER_STRING, model),
      TRITONSERVER_ParameterNew("instance", PARAMETER_STRING, instance),
      TRITONSERVER_ParameterNew("stage", PARAMETER_STRING, "patchify"),
  };
  TRITONSERVER_Error *error = TRITONSERVER_MetricNew(metric, family, labels, 3);
  for (int i = 0; i < 3; i++) TRITONSERVER_ParameterDelete((TRITONSERVER_Parameter *)labels[i]);
  return error;
}

/* An instance's state: its stage counter (NULL where the server has no metrics). */
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceInitialize(TRITONBACKEND_ModelInstance *instance) {
  const char *instance_name, *model_name;
  TRITONBACKEND_Model *model;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceName(instance, &instance_name));
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  RETURN_IF_ERROR(TRITONBACKEND_ModelName(model, &model_name));
  TRITONSERVER_Metric *metric = NULL;
  TRITONSERVER_Error *error = stage_metric(model_name, instance_name, &metric);
  if (error != NULL) { /* metrics off (--allow-metrics=false): serve without the counter */
    TRITONSERVER_ErrorDelete(error);
    metric = NULL;
  }
  return TRITONBACKEND_ModelInstanceSetState(instance, metric);
}

TRITONSERVER_Error *TRITONBACKEND_ModelInstanceFinalize(TRITONBACKEND_ModelInstance *instance) {
  void *metric;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceState(instance, &metric));
  if (metric != NULL) RETURN_IF_ERROR(TRITONSERVER_MetricDelete(metric));
  return NULL;
}

TRITONSERVER_Error *TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model *model) {
  void *state;
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, &state));
  free(state);
  return NULL;
}

/* ----------------------------------------------------------------------------------- a request */

typedef struct {
  const void *data; /* host memory, contiguous */
  void *owned;      /* the gathered copy, when the input came in several buffers */
  const int64_t *shape;
  uint32_t dims;
  uint64_t bytes;
} HostInput;

/* Input ``name`` of ``datatype`` and ``dims`` dimensions in host memory, in one piece (an input
 * that arrives in several buffers, as HTTP may hand it over, is gathered into a copy). */
static TRITONSERVER_Error *host_input(TRITONBACKEND_Request *request, const char *name, int datatype, uint32_t dims,
                                      HostInput *input) {
  TRITONBACKEND_Input *handle;
  const char *input_name;
  int actual_type;
  uint32_t buffers;
  memset(input, 0, sizeof *input);
  TRITONSERVER_Error *missing = TRITONBACKEND_RequestInput(request, name, &handle);
  if (missing != NULL) {
    TRITONSERVER_ErrorDelete(missing);
    return INVALID_REQUEST("the request has no input %s", name);
  }
  RETURN_IF_ERROR(TRITONBACKEND_InputProperties(handle, &input_name, &actual_type, &input->shape, &input->dims,
                                                &input->bytes, &buffers));
  if (actual_type != datatype) return INVALID_REQUEST("%s must be %s", name, datatype == TYPE_UINT8 ? "uint8" : "int64");
  if (input->dims != dims) return INVALID_REQUEST("%s must have %u dimensions, got %u", name, dims, input->dims);
  if (input->shape[0] != 1)
    return INVALID_REQUEST("%s has %lld rows: send one request per batch element ([1, ...])", name,
                           (long long)input->shape[0]);
  const void *buffer;
  uint64_t size;
  int memory;
  int64_t memory_id;
  if (buffers == 1) {
    RETURN_IF_ERROR(TRITONBACKEND_InputBuffer(handle, 0, &buffer, &size, &memory, &memory_id));
    if (memory == MEMORY_GPU) return INVALID_REQUEST("%s is in GPU memory: kimi_patchify reads host memory", name);
    if (size != input->bytes) return INTERNAL("%s's buffer holds %llu of its %llu bytes", name,
                                              (unsigned long long)size, (unsigned long long)input->bytes);
    input->data = buffer;
    return NULL;
  }
  if ((input->owned = malloc(input->bytes ? input->bytes : 1)) == NULL)
    return INTERNAL("out of memory gathering %s", name);
  uint64_t at = 0;
  for (uint32_t index = 0; index < buffers; index++) {
    RETURN_IF_ERROR(TRITONBACKEND_InputBuffer(handle, index, &buffer, &size, &memory, &memory_id));
    if (memory == MEMORY_GPU) return INVALID_REQUEST("%s is in GPU memory: kimi_patchify reads host memory", name);
    if (size > input->bytes - at) return INTERNAL("%s's buffers exceed its size", name);
    memcpy((char *)input->owned + at, buffer, size);
    at += size;
  }
  if (at != input->bytes) return INTERNAL("%s's buffers fall short of its size", name);
  input->data = input->owned;
  return NULL;
}



enum { CHECK_OK = 0, CHECK_INVALID = 1, CHECK_TOO_LARGE = 2 };

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

/* The K images of a request's IMAGE and IMAGE_SHAPES (kimi_check_images); *images is malloc'd. */
static TRITONSERVER_Error *request_images(const ModelState *state, const HostInput *image, const HostInput *shapes,
                                          Image **images, size_t *count, size_t *total_patches) {
  const int64_t length = image->shape[1], k = shapes->shape[1];
  if (length < 0 || (uint64_t)length != image->bytes) return INVALID_REQUEST("IMAGE must have shape [1, L]");
  if (k < 1 || shapes->shape[2] != 4 || shapes->bytes != (uint64_t)k * 4 * sizeof(int64_t))
    return INVALID_REQUEST("IMAGE_SHAPES must have shape [1, K, 4], got [1, %lld, %lld]", (long long)k,
                           (long long)shapes->shape[2]);
  /* Before the allocation below (kimi_check_images says the same): K sizes it. */
  if (k > state->limits.max_images)
    return INVALID_REQUEST(KIMI_MSG_TOO_MANY_IMAGES, (long)k, (long)state->limits.max_images);
  *images = calloc((size_t)k, sizeof **images);
  if (*images == NULL) return INTERNAL("out of memory");
  *count = (size_t)k;
  char message[1024];
  switch (kimi_check_images(&state->limits, shapes->data, k, length, *images, total_patches, message, sizeof message)) {
    case CHECK_OK: return NULL;
    case CHECK_TOO_LARGE: return TOO_LARGE("%s", message);
    default: return INVALID_REQUEST("%s", message);
  }
}

enum { WANT_VALUES = 1, WANT_PATCHES = 2, WANT_GRID = 4, WANT_TOKENS = 8 };

static TRITONSERVER_Error *requested_outputs(TRITONBACKEND_Request *request, unsigned *wanted) {
  uint32_t count;
  RETURN_IF_ERROR(TRITONBACKEND_RequestOutputCount(request, &count));
  static const char *names[] = {"PIXEL_VALUES", "PIXEL_PATCHES", "GRID_THW", "NUM_TOKENS"};
  *wanted = 0;
  for (uint32_t index = 0; index < count; index++) {
    const char *name;
    RETURN_IF_ERROR(TRITONBACKEND_RequestOutputName(request, index, &name));
    for (unsigned bit = 0; bit < 4; bit++)
      if (strcmp(name, names[bit]) == 0) *wanted |= 1u << bit;
  }
  return NULL;
}

/* A host buffer of output ``name`` in ``response``. */
static TRITONSERVER_Error *host_output(TRITONBACKEND_Response *response, const char *name, int datatype,
                                       const int64_t *shape, uint32_t dims, uint64_t bytes, void **buffer) {
  TRITONBACKEND_Output *output;
  int memory = MEMORY_CPU;
  int64_t memory_id = 0;
  RETURN_IF_ERROR(TRITONBACKEND_ResponseOutput(response, &output, name, datatype, shape, dims));
  RETURN_IF_ERROR(TRITONBACKEND_OutputBuffer(output, buffer, bytes, &memory, &memory_id));
  if (memory == MEMORY_GPU) return INVALID_REQUEST("%s was given GPU memory: kimi_patchify writes host memory", name);
  return NULL;
}

static TRITONSERVER_Error *fill_response(const ModelState *state, TRITONBACKEND_Request *request,
                                         TRITONBACKEND_Response *response, Image **images) {
  HostInput image = {0}, shapes = {0};
  size_t count = 0, total = 0;
  unsigned wanted = 0;
  TRITONSERVER_Error *error = host_input(request, "IMAGE", TYPE_UINT8, 2, &image);
  if (error == NULL) error = host_input(request, "IMAGE_SHAPES", TYPE_INT64, 3, &shapes);
  if (error == NULL) error = request_images(state, &image, &shapes, images, &count, &total);
  if (error == NULL) error = requested_outputs(request, &wanted);
  const size_t p = (size_t)state->limits.patch_size, per_patch = 3 * p * p;
  const int64_t pixel_shape[5] = {1, (int64_t)total, 3, (int64_t)p, (int64_t)p};
  for (unsigned bit = WANT_VALUES; error == NULL && bit <= WANT_PATCHES; bit <<= 1) {
    if (!(wanted & bit)) continue;
    const bool values = bit == WANT_VALUES;
    const size_t item = values ? sizeof(float) : 1;
    void *out;
    error = host_output(response, values ? "PIXEL_VALUES" : "PIXEL_PATCHES", values ? TYPE_FP32 : TYPE_UINT8,
                        pixel_shape, 5, total * per_patch * item, &out);
    for (size_t k = 0, row = 0; error == NULL && k < count; row += (*images)[k].patches, k++) {
      const Image *at = &(*images)[k];
      const uint8_t *pixels = (const uint8_t *)image.data + at->offset;
      write_patches(pixels, at->height, at->width, state->value_tables, (uint8_t *)out + row * per_patch * item,
                    at->grid_h, at->grid_w, p, values);
    }
  }
  if (error == NULL && (wanted & WANT_GRID)) {
    const int64_t shape[3] = {1, (int64_t)count, 3};
    int64_t *grid;
    error = host_output(response, "GRID_THW", TYPE_INT64, shape, 3, count * 3 * sizeof(int64_t), (void **)&grid);
    for (size_t k = 0; error == NULL && k < count; k++) {
      grid[3 * k] = 1;
      grid[3 * k + 1] = (int64_t)(*images)[k].grid_h;
      grid[3 * k + 2] = (int64_t)(*images)[k].grid_w;
    }
  }
  if (error == NULL && (wanted & WANT_TOKENS)) {
    const int64_t shape[2] = {1, (int64_t)count};
    int32_t *tokens;
    const size_t merge = (size_t)(state->limits.factor / state->limits.patch_size);
    error = host_output(response, "NUM_TOKENS", TYPE_INT32, shape, 2, count * sizeof(int32_t), (void **)&tokens);
    for (size_t k = 0; error == NULL && k < count; k++)
      tokens[k] = (int32_t)((*images)[k].grid_h / merge * ((*images)[k].grid_w / merge));
  }
  free(image.owned);
  free(shapes.owned);
  return error;
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void log_error(const ModelState *state, const char *what, TRITONSERVER_Error *error) {
  char line[1200];
  snprintf(line, sizeof line, "%s: %s: %s", state->name, what, TRITONSERVER_ErrorMessage(error));
  TRITONSERVER_Error *logged = TRITONSERVER_LogMessage(LOG_ERROR, __FILE__, __LINE__, line);
  if (logged != NULL) TRITONSERVER_ErrorDelete(logged);
  TRITONSERVER_ErrorDelete(error);
}

/* A second way to a response where TRITONBACKEND_ResponseNew failed: through a response factory
 * of the request, so that the request's error still reaches its client; NULL if that fails too. */
static TRITONBACKEND_Response *fallback_response(const ModelState *state, TRITONBACKEND_Request *request) {
  TRITONBACKEND_ResponseFactory *factory = NULL;
  TRITONBACKEND_Response *response = NULL;
  TRITONSERVER_Error *error = TRITONBACKEND_ResponseFactoryNew(&factory, request);
  if (error == NULL) error = TRITONBACKEND_ResponseNewFromFactory(&response, factory);
  if (error != NULL) log_error(state, "creating a response through a factory", error);
  if (factory != NULL) {
    TRITONSERVER_Error *deleted = TRITONBACKEND_ResponseFactoryDelete(factory);
    if (deleted != NULL) log_error(state, "deleting a response factory", deleted);
  }
  return error == NULL ? response : NULL;
}

/* Every request gets its own response: its outputs, or its error; one request's error never
 * touches another's. */
TRITONSERVER_Error *TRITONBACKEND_ModelInstanceExecute(TRITONBACKEND_ModelInstance *instance,
                                                       TRITONBACKEND_Request **requests, const uint32_t count) {
  TRITONBACKEND_Model *model;
  ModelState *state;
  RETURN_IF_ERROR(TRITONBACKEND_ModelInstanceModel(instance, &model));
  RETURN_IF_ERROR(TRITONBACKEND_ModelState(model, (void **)&state));
  const uint64_t exec_start = now_ns();
  uint64_t compute_end = exec_start, compute_ns = 0;
  for (uint32_t r = 0; r < count; r++) {
    TRITONBACKEND_Request *request = requests[r];
    TRITONBACKEND_Response *response = NULL;
    Image *images = NULL;
    const uint64_t start = now_ns();
    TRITONSERVER_Error *error = TRITONBACKEND_ResponseNew(&response, request);
    if (error == NULL) error = fill_response(state, request, response, &images);
    free(images);
    const uint64_t end = compute_end = now_ns();
    compute_ns += end - start;
    const bool success = error == NULL;
    if (response == NULL) response = fallback_response(state, request);
    if (response != NULL) {
      TRITONSERVER_Error *sent = TRITONBACKEND_ResponseSend(response, RESPONSE_COMPLETE_FINAL, error);
      if (sent != NULL) log_error(state, "sending a response", sent);
      if (error != NULL) TRITONSERVER_ErrorDelete(error);
    } else {
      log_error(state, "creating a response (the request goes unanswered)", error);
    }
    TRITONSERVER_Error *reported =
        TRITONBACKEND_ModelInstanceReportStatistics(instance, request, success, exec_start, start, end, now_ns());
    if (reported != NULL) log_error(state, "reporting statistics", reported);
    TRITONSERVER_Error *released = TRITONBACKEND_RequestRelease(request, REQUEST_RELEASE_ALL);
    if (released != NULL) log_error(state, "releasing a request", released);
  }
  TRITONSERVER_Error *reported =
      TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, count, exec_start, exec_start, compute_end, now_ns());
  if (reported != NULL) log_error(state, "reporting batch statistics", reported);
  void *metric = NULL;
  TRITONSERVER_Error *found = TRITONBACKEND_ModelInstanceState(instance, &metric);
  if (found != NULL) log_error(state, "reading the instance state", found);
  if (metric != NULL) {
    TRITONSERVER_Error *counted = TRITONSERVER_MetricIncrement(metric, (double)compute_ns / 1e9);
    if (counted != NULL) log_error(state, "counting the stage seconds", counted);
  }
  return NULL;
}
