/* The model config's parameters, read with a strict JSON reader (kimi_json.h). No Triton, no state:
 * the C step (backend.c) asks it for each parameter it needs, and the tests and the fuzzer
 * call it through ctypes. */

#include "kimi_json.h"

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

/* A strict JSON reader over the model config Triton serializes (RFC 8259: objects, arrays, strings
 * with every escape, numbers, literals, nesting at most JSON_MAX_DEPTH), enough to find
 * config["parameters"][key]["string_value"]. A document it cannot read is refused, never guessed. */
enum { JSON_MAX_DEPTH = 64 };

typedef struct {
  const char *at, *end;
} Json;

static void json_space(Json *json) {
  while (json->at < json->end && (*json->at == ' ' || *json->at == '\n' || *json->at == '\r' || *json->at == '\t'))
    json->at++;
}

static bool json_take(Json *json, char c) {
  json_space(json);
  if (json->at < json->end && *json->at == c) {
    json->at++;
    return true;
  }
  return false;
}

static int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* Four hex digits at the reader as a code unit; 0xFFFFFFFF where they are not. */
static uint32_t json_hex4(Json *json) {
  uint32_t code = 0;
  for (int i = 0; i < 4; i++) {
    int digit = json->at < json->end ? hex_digit(*json->at++) : -1;
    if (digit < 0) return 0xFFFFFFFFu;
    code = code * 16 + (uint32_t)digit;
  }
  return code;
}

enum { STRING_BAD = 0, STRING_OK = 1, STRING_WITH_NUL = 2 };

/* A string at the reader (after spaces), decoded as UTF-8 into out[capacity] (NULL: only checked):
 * STRING_OK; STRING_WITH_NUL where it holds a \u0000 (no C string can: out is then unusable);
 * STRING_BAD if it is not a string, malformed (a lone surrogate included), or does not fit. */
static int json_string(Json *json, char *out, size_t capacity) {
  size_t used = 0;
  bool nul = false;
  if (!json_take(json, '"')) return STRING_BAD;
  while (json->at < json->end) {
    unsigned char c = (unsigned char)*json->at++;
    uint32_t code = c;
    if (c == '"') {
      if (out != NULL) out[used] = '\0';
      return nul ? STRING_WITH_NUL : STRING_OK;
    }
    if (c < 0x20) return STRING_BAD;
    if (c == '\\') {
      if (json->at >= json->end) return STRING_BAD;
      char escape = *json->at++;
      const char *simple = strchr("\"\\/bfnrt", escape);
      if (escape != '\0' && simple != NULL) {
        code = (uint32_t)"\"\\/\b\f\n\r\t"[simple - "\"\\/bfnrt"];
      } else if (escape == 'u') {
        code = json_hex4(json);
        if (code == 0xFFFFFFFFu) return STRING_BAD;
        if (code >= 0xD800 && code <= 0xDBFF) { /* a surrogate pair: \uD8xx\uDCxx */
          if (json->end - json->at < 2 || json->at[0] != '\\' || json->at[1] != 'u') return STRING_BAD;
          json->at += 2;
          uint32_t low = json_hex4(json);
          if (low < 0xDC00 || low > 0xDFFF) return STRING_BAD;
          code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
        } else if (code >= 0xDC00 && code <= 0xDFFF) {
          return STRING_BAD; /* a lone low surrogate */
        }
        nul |= code == 0;
      } else {
        return STRING_BAD;
      }
    }
    char bytes[4];
    size_t n = 0;
    if (code < 0x80 || c >= 0x80) {
      bytes[n++] = (char)code; /* ASCII, or a byte of a UTF-8 sequence copied as it is */
    } else if (code < 0x800) {
      bytes[n++] = (char)(0xC0 | (code >> 6));
      bytes[n++] = (char)(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      bytes[n++] = (char)(0xE0 | (code >> 12));
      bytes[n++] = (char)(0x80 | ((code >> 6) & 0x3F));
      bytes[n++] = (char)(0x80 | (code & 0x3F));
    } else {
      bytes[n++] = (char)(0xF0 | (code >> 18));
      bytes[n++] = (char)(0x80 | ((code >> 12) & 0x3F));
      bytes[n++] = (char)(0x80 | ((code >> 6) & 0x3F));
      bytes[n++] = (char)(0x80 | (code & 0x3F));
    }
    if (out != NULL) {
      if (used + n >= capacity) return STRING_BAD;
      memcpy(out + used, bytes, n);
    }
    used += n;
  }
  return STRING_BAD;
}

static bool json_skip(Json *json, int depth);

/* An object at the reader: for each member, ``member(key, json, context)`` reads or skips its
 * value (false: refuse the document); a key that holds a NUL is passed as NULL (no lookup matches
 * it). Keys longer than 255 bytes are refused. */
static bool json_object(Json *json, int depth, bool (*member)(const char *, Json *, int, void *), void *context) {
  if (depth > JSON_MAX_DEPTH || !json_take(json, '{')) return false;
  if (json_take(json, '}')) return true;
  do {
    char key[256];
    int read = json_string(json, key, sizeof key);
    if (read == STRING_BAD || !json_take(json, ':')) return false;
    if (!member(read == STRING_OK ? key : NULL, json, depth + 1, context)) return false;
  } while (json_take(json, ','));
  return json_take(json, '}');
}

static bool skip_member(const char *key, Json *json, int depth, void *context) {
  (void)key, (void)context;
  return json_skip(json, depth);
}

/* Past any value at the reader, checking its syntax. */
static bool json_skip(Json *json, int depth) {
  json_space(json);
  if (depth > JSON_MAX_DEPTH || json->at >= json->end) return false;
  char c = *json->at;
  if (c == '{') return json_object(json, depth, skip_member, NULL);
  if (c == '"') return json_string(json, NULL, 0) != STRING_BAD;
  if (c == '[') {
    json->at++;
    if (json_take(json, ']')) return true;
    do {
      if (!json_skip(json, depth + 1)) return false;
    } while (json_take(json, ','));
    return json_take(json, ']');
  }
  for (int i = 0; i < 3; i++) {
    const char *literal = (const char *[]){"true", "false", "null"}[i];
    size_t length = strlen(literal);
    if ((size_t)(json->end - json->at) >= length && memcmp(json->at, literal, length) == 0) {
      json->at += length;
      return true;
    }
  }
  /* A number: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? */
  const char *start = json->at;
  if (json->at < json->end && *json->at == '-') json->at++;
  if (json->at < json->end && *json->at == '0') {
    json->at++;
  } else {
    if (json->at >= json->end || *json->at < '1' || *json->at > '9') return false;
    while (json->at < json->end && *json->at >= '0' && *json->at <= '9') json->at++;
  }
  if (json->at < json->end && *json->at == '.') {
    const char *digits = ++json->at;
    while (json->at < json->end && *json->at >= '0' && *json->at <= '9') json->at++;
    if (json->at == digits) return false;
  }
  if (json->at < json->end && (*json->at == 'e' || *json->at == 'E')) {
    json->at++;
    if (json->at < json->end && (*json->at == '+' || *json->at == '-')) json->at++;
    const char *digits = json->at;
    while (json->at < json->end && *json->at >= '0' && *json->at <= '9') json->at++;
    if (json->at == digits) return false;
  }
  return json->at > start;
}

typedef struct {
  const char *key;
  char *value;
  size_t capacity;
  bool found;
} ParameterQuery;

static bool string_value_member(const char *key, Json *json, int depth, void *context) {
  ParameterQuery *query = context;
  if (key == NULL || strcmp(key, "string_value") != 0) return json_skip(json, depth);
  query->found = true;
  return json_string(json, query->value, query->capacity) == STRING_OK; /* a NUL: refused, not cut */
}

static bool parameter_member(const char *key, Json *json, int depth, void *context) {
  ParameterQuery *query = context;
  if (key == NULL || strcmp(key, query->key) != 0) return json_skip(json, depth);
  return json_object(json, depth, string_value_member, query);
}

static bool config_member(const char *key, Json *json, int depth, void *context) {
  if (depth != 1 || key == NULL || strcmp(key, "parameters") != 0) return json_skip(json, depth);
  return json_object(json, depth, parameter_member, context);
}

/* config["parameters"][key]["string_value"] of the model config's JSON into value[capacity]:
 * 1 found, 0 the config has no such parameter, -1 the JSON is malformed or the value too long.
 * Exported for the tests (ctypes), which compare it with Python's json module. */
int kimi_config_parameter(const char *text, size_t size, const char *key, char *value, size_t capacity) {
  ParameterQuery query = {key, value, capacity, false};
  Json json = {text, text + size};
  if (capacity == 0 || !json_object(&json, 0, config_member, &query)) return -1;
  json_space(&json);
  if (json.at != json.end) return -1;
  return query.found ? 1 : 0;
}
