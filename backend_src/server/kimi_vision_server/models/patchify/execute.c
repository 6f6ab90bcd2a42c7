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
 * The Triton API is declared in triton_api.h (weak: the shared object then also loads outside
 * tritonserver, ctypes, for the kernel tests), and TRITONBACKEND_Initialize (backend.c) refuses a server
 * that lacks any of them, by name (TRITON_API). Inside tritonserver they bind to its libtritonserver.
 */

/* This file: one request (TRITONBACKEND_ModelInstanceExecute): the inputs in host memory, the
 * images checked (kernels.c), the requested outputs written straight into Triton's buffers. The
 * declarations of the Triton API: triton_api.h; the lifecycle: backend.c; README.md. */


#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kimi_messages.h" /* generated at build time from kimi_vision_common/messages.py */
#include "kimi_patchify.h"

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
      kimi_write_patches(pixels, at->height, at->width, state->value_tables, (uint8_t *)out + row * per_patch * item,
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
