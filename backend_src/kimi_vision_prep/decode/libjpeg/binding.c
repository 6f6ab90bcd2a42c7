/* libjpeg's functions bound through Pillow's _imaging module (the very functions Pillow's JPEG
 * decoder calls), and the strict error manager every decode reports through (README.md). */

#include "libjpeg.h" /* first: Python.h defines _GNU_SOURCE, which dladdr needs */

#include <dlfcn.h>

jpeg_functions lib;
int bound = 0;

void on_error(j_common_ptr cinfo) {
  strict_error *err = (strict_error *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

/* Level -1 is a warning (corrupt data libjpeg would skip over): strict, like simplejpeg's
 * strict mode, so such a file goes on to the next route and keeps Pillow's verdict there. One
 * warning is let through: bytes discarded before a marker (JWRN_EXTRANEOUS_DATA, e.g. padding
 * after a restart interval's last MCU). libjpeg reports it once the bytes are skipped, and the
 * marker after them is read as in a clean stream, so no pixel depends on it; a restart marker out
 * of sequence warns again (JWRN_MUST_RESYNC) and refuses. Matched by the library's own message
 * text: message numbers are not fixed across libjpeg-turbo versions, this text is.
 *
 * Tolerant (a stream whose damage the caller knows of, jpeg_scan's verdict): every warning is let
 * through, as Pillow lets it (its decoder ignores warnings), but the end of the data before EOI.
 * libjpeg then conceals the damage (grey for a segment's missing codes, resynchronising at the
 * next restart marker) exactly as in Pillow's decode of the same bytes; the memory source's end
 * is where Pillow's would wait for more data and then call the file truncated. */
static const char EXTRANEOUS_DATA[] = "Corrupt JPEG data: %u extraneous bytes before marker 0x%02x";
static const char END_OF_DATA[] = "Premature end of JPEG file";

static int is_message(const struct jpeg_error_mgr *err, const char *text) {
  return err->msg_code > 0 && err->msg_code <= err->last_jpeg_message &&
         err->jpeg_message_table[err->msg_code] != NULL && strcmp(err->jpeg_message_table[err->msg_code], text) == 0;
}

void on_message(j_common_ptr cinfo, int level) {
  const strict_error *err = (const strict_error *)cinfo->err;
  if (level >= 0) return;
  if (err->tolerant ? is_message(&err->pub, END_OF_DATA) : !is_message(&err->pub, EXTRANEOUS_DATA)) on_error(cinfo);
}

#define RESOLVE(field, symbol)                                                      \
  do {                                                                              \
    *(void **)(&lib.field) = dlsym(handle, symbol);                                 \
    if (lib.field == NULL) {                                                        \
      PyErr_Format(PyExc_ImportError, "%s not found beside %s", symbol, imaging);   \
      return NULL;                                                                  \
    }                                                                               \
  } while (0)

/* Whether the library takes a decompressor of this build's JPEG_LIB_VERSION and struct size
 * (headers of another ABI, e.g. Ubuntu's version 80 against Pillow's 62, would fail every call). */
static int abi_matches(strict_error *err) {
  struct jpeg_decompress_struct probe;

  memset(&probe, 0, sizeof(probe));
  probe.err = lib.std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  err->tolerant = 0;
  if (setjmp(err->jump)) {
    lib.destroy_decompress(&probe);
    return 0;
  }
  lib.create_decompress(&probe, JPEG_LIB_VERSION, sizeof(probe));
  lib.destroy_decompress(&probe);
  return 1;
}

PyObject *bind(PyObject *self, PyObject *args) {
  const char *imaging;
  void *handle;
  Dl_info where;
  strict_error message;

  if (!PyArg_ParseTuple(args, "s", &imaging)) return NULL;
  /* Never closed: the module stays loaded for the life of the process, as Pillow's does. */
  handle = dlopen(imaging, RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) {
    PyErr_Format(PyExc_ImportError, "dlopen(%s): %s", imaging, dlerror());
    return NULL;
  }
  RESOLVE(std_error, "jpeg_std_error");
  RESOLVE(create_decompress, "jpeg_CreateDecompress");
  RESOLVE(mem_src, "jpeg_mem_src");
  RESOLVE(resync_to_restart, "jpeg_resync_to_restart");
  RESOLVE(read_header, "jpeg_read_header");
  RESOLVE(start_decompress, "jpeg_start_decompress");
  RESOLVE(skip_scanlines, "jpeg_skip_scanlines");
  RESOLVE(read_scanlines, "jpeg_read_scanlines");
  RESOLVE(read_coefficients, "jpeg_read_coefficients");
  RESOLVE(finish_decompress, "jpeg_finish_decompress");
  RESOLVE(destroy_decompress, "jpeg_destroy_decompress");
  if (!abi_matches(&message)) {
    PyErr_Format(PyExc_ImportError, "the libjpeg beside %s does not take these headers' ABI (%s)", imaging,
                 message.message);
    return NULL;
  }
  bound = 1;
  if (dladdr(*(void **)(&lib.read_scanlines), &where) == 0 || where.dli_fname == NULL) return PyUnicode_FromString(imaging);
  return PyUnicode_FromString(where.dli_fname);
}
