/* Rows of a JPEG decoded by the libjpeg-turbo that Pillow itself decodes with.
 *
 * kimi_vision_prep.jpeg_bands drives it; this file only talks to libjpeg:
 *
 *   bind(imaging_path) -> str   resolve libjpeg's functions through Pillow's _imaging module
 *                               (dlsym on its handle searches the libraries it links, so these are
 *                               the very functions Pillow's JPEG decoder calls); returns the path
 *                               of the library they live in.
 *   decode_rows(data, out, width, height, row_begin, row_end)
 *                               decode rows [row_begin, row_end) of `data` as RGB into `out`, a
 *                               writable C-contiguous buffer of height * width * 3 bytes (row r at
 *                               offset r * width * 3); the rows above row_begin are skipped with
 *                               jpeg_skip_scanlines (entropy-decoded only). Pillow's settings:
 *                               accurate integer IDCT, fancy upsampling. Strict: any libjpeg
 *                               error *or warning* raises JpegError (a ValueError) with
 *                               libjpeg's message; bad arguments raise a plain ValueError.
 *                               The GIL is released while libjpeg runs.
 *
 * The headers are the system's libjpeg-turbo (Debian libjpeg62-turbo-dev); only the
 * JPEG_LIB_VERSION 62 ABI they describe is used, and jpeg_CreateDecompress checks it against the
 * library at every call (a mismatch is an error, never a wrong struct layout).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

static struct {
  __typeof__(&jpeg_std_error) std_error;
  __typeof__(&jpeg_CreateDecompress) create_decompress;
  __typeof__(&jpeg_mem_src) mem_src;
  __typeof__(&jpeg_read_header) read_header;
  __typeof__(&jpeg_start_decompress) start_decompress;
  __typeof__(&jpeg_skip_scanlines) skip_scanlines;
  __typeof__(&jpeg_read_scanlines) read_scanlines;
  __typeof__(&jpeg_finish_decompress) finish_decompress;
  __typeof__(&jpeg_destroy_decompress) destroy_decompress;
} lib;

static int bound = 0;
static PyObject *JpegError = NULL;

typedef struct {
  struct jpeg_error_mgr pub;
  jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
} strict_error;

static void on_error(j_common_ptr cinfo) {
  strict_error *err = (strict_error *)cinfo->err;
  (*cinfo->err->format_message)(cinfo, err->message);
  longjmp(err->jump, 1);
}

/* Level -1 is a warning (corrupt data libjpeg would skip over): strict, like simplejpeg's
 * strict mode, so such a file goes on to the next route and keeps Pillow's verdict there. */
static void on_message(j_common_ptr cinfo, int level) {
  if (level < 0) on_error(cinfo);
}

#define ROWS_PER_CALL 16

/* 0 on success; -1 with err->message set. Runs without the GIL. */
static int decode_rows_nogil(const unsigned char *data, size_t size, unsigned char *out, JDIMENSION width,
                             JDIMENSION height, JDIMENSION row_begin, JDIMENSION row_end, strict_error *err) {
  struct jpeg_decompress_struct cinfo;
  JSAMPROW rows[ROWS_PER_CALL];
  const size_t stride = (size_t)width * 3;

  memset(&cinfo, 0, sizeof(cinfo)); /* a failed create leaves nothing for destroy to free */
  cinfo.err = lib.std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  if (setjmp(err->jump)) {
    lib.destroy_decompress(&cinfo);
    return -1;
  }
  lib.create_decompress(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
  lib.mem_src(&cinfo, data, (unsigned long)size);
  lib.read_header(&cinfo, TRUE);
  cinfo.out_color_space = JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  lib.start_decompress(&cinfo);
  if (cinfo.output_width != width || cinfo.output_height != height || cinfo.output_components != 3) {
    snprintf(err->message, sizeof(err->message), "libjpeg decodes %ux%ux%d, expected %ux%ux3",
             cinfo.output_width, cinfo.output_height, cinfo.output_components, width, height);
    lib.destroy_decompress(&cinfo);
    return -1;
  }
  if (row_begin > 0) lib.skip_scanlines(&cinfo, row_begin);
  while (cinfo.output_scanline < row_end) {
    JDIMENSION count = row_end - cinfo.output_scanline, i;
    if (count > ROWS_PER_CALL) count = ROWS_PER_CALL;
    for (i = 0; i < count; i++) rows[i] = out + (size_t)(cinfo.output_scanline + i) * stride;
    lib.read_scanlines(&cinfo, rows, count);
  }
  /* The last band reads on to EOI, so a warning after the last row still refuses the file. */
  if (row_end == height) lib.finish_decompress(&cinfo);
  lib.destroy_decompress(&cinfo);
  return 0;
}

static PyObject *decode_rows(PyObject *self, PyObject *args) {
  Py_buffer data, out;
  unsigned int width, height, row_begin, row_end;
  strict_error err;
  int status;

  if (!bound) {
    PyErr_SetString(PyExc_RuntimeError, "libjpeg is not bound: call bind() first");
    return NULL;
  }
  if (!PyArg_ParseTuple(args, "y*w*IIII", &data, &out, &width, &height, &row_begin, &row_end)) return NULL;
  if (!PyBuffer_IsContiguous(&out, 'C') || (size_t)out.len != (size_t)width * height * 3 || width == 0 ||
      row_begin >= row_end || row_end > height) {
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    PyErr_Format(PyExc_ValueError, "out must be a C-contiguous %ux%ux3 buffer and rows [%u, %u) within %u",
                 height, width, row_begin, row_end, height);
    return NULL;
  }
  Py_BEGIN_ALLOW_THREADS
  status = decode_rows_nogil(data.buf, (size_t)data.len, out.buf, width, height, row_begin, row_end, &err);
  Py_END_ALLOW_THREADS
  PyBuffer_Release(&data);
  PyBuffer_Release(&out);
  if (status != 0) {
    PyErr_SetString(JpegError, err.message);
    return NULL;
  }
  Py_RETURN_NONE;
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
  if (setjmp(err->jump)) {
    lib.destroy_decompress(&probe);
    return 0;
  }
  lib.create_decompress(&probe, JPEG_LIB_VERSION, sizeof(probe));
  lib.destroy_decompress(&probe);
  return 1;
}

static PyObject *bind(PyObject *self, PyObject *args) {
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
  RESOLVE(read_header, "jpeg_read_header");
  RESOLVE(start_decompress, "jpeg_start_decompress");
  RESOLVE(skip_scanlines, "jpeg_skip_scanlines");
  RESOLVE(read_scanlines, "jpeg_read_scanlines");
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

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(imaging_path) -> path of the libjpeg Pillow's _imaging links"},
    {"decode_rows", decode_rows, METH_VARARGS,
     "decode_rows(data, out, width, height, row_begin, row_end): RGB rows of a JPEG into out (strict)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_libjpeg", NULL, -1, methods};

PyMODINIT_FUNC PyInit__libjpeg(void) {
  PyObject *m = PyModule_Create(&module);
  if (m == NULL) return NULL;
  JpegError = PyErr_NewException("kimi_vision_prep._libjpeg.JpegError", PyExc_ValueError, NULL);
  if (JpegError == NULL || PyModule_AddObjectRef(m, "JpegError", JpegError) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
