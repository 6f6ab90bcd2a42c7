/* kimi_config_parameter: one string parameter of a Triton model config (kimi_json.c). */
#pragma once

#include <stddef.h>

/* config["parameters"][key]["string_value"] of the model config's JSON into value[capacity]:
 * 1 found, 0 the config has no such parameter, -1 the JSON is malformed or the value too long.
 * Exported for the tests (ctypes), which compare it with Python's json module. */
int kimi_config_parameter(const char *text, size_t size, const char *key, char *value, size_t capacity);
