/* kimi_patchify's lifecycle, along Triton's backend API: TRITONBACKEND_Initialize (the server has
 * every function the step calls: TRITON_API), ModelInitialize (the model state read from the model
 * config's parameters with kimi_json.c), ModelInstanceInitialize (the stage counter), the
 * finalizers. One request: execute.c. */

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kimi_json.h" /* the strict JSON reader of the model config (kimi_json.c) */
#include "kimi_patchify.h"

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

/* An error whose message starts with ``tag: `` (a class of kimi_vision_prep.errors). */
KIMI_INTERNAL TRITONSERVER_Error *kimi_error_new(int code, const char *tag, const char *format, ...) {
  char message[1024];
  int used = snprintf(message, sizeof message, "%s: ", tag);
  va_list args;
  va_start(args, format);
  vsnprintf(message + used, sizeof message - (size_t)used, format, args);
  va_end(args);
  return TRITONSERVER_ErrorNew(code, message);
}

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

