/* A JPEG's quantized DCT coefficients, read by the libjpeg-turbo Pillow decodes with
 * (jpeg_read_coefficients: entropy decoding only, every scan, restart markers, arithmetic coding
 * where the library has it), for the integer kernels of decode/jpeg_kernels.py (README.md).
 *
 *   coefficient_header(data) -> (width, height, precision, progressive, arithmetic, color_space,
 *                                components)
 *       the frame as libjpeg reads it (strict, like every decode here); `color_space` is libjpeg's
 *       J_COLOR_SPACE guess (JFIF, Adobe transform, component ids); `components` one tuple per
 *       component: (h_samp, v_samp, width_in_blocks, height_in_blocks, downsampled_width,
 *       downsampled_height). The caller sizes and bounds its buffers from it.
 *   read_coefficients(data, blocks, quant) -> (smoothing, dc_missing)
 *       every component's blocks into `blocks` (int16, C-contiguous: component after component,
 *       height_in_blocks x width_in_blocks x 64 each, natural order) and the quantization table
 *       each component was decoded with into `quant` (uint16, components x 64, natural order);
 *       without the GIL. `smoothing`: libjpeg's decode would smooth the blocks (jdcoefct.c
 *       smoothing_ok: a progressive stream whose first AC coefficients are not all refined);
 *       `dc_missing`: a component never got a DC scan. Strict: an error or a warning but bytes
 *       skipped before a marker raises JpegError, and the stream is read to its EOI. */

#include "libjpeg.h"

#define SAVED_COEFS 10 /* jdcoefct.c: the coefficients block smoothing looks at */

/* zigzag positions of the first 9 AC coefficients in natural order (jdcoefct.c Q01_POS...) */
static const int SMOOTHING_QUANT[SAVED_COEFS] = {0, 1, 8, 16, 9, 2, 3, 10, 17, 24};

/* A strict decompressor on `data`, its headers read; an error jumps to err->jump, where the
 * caller destroys it (as it does on success). */
static void open_strict(j_decompress_ptr cinfo, strict_error *err, const unsigned char *data, size_t size) {
  cinfo->err = lib.std_error(&err->pub);
  err->pub.error_exit = on_error;
  err->pub.emit_message = on_message;
  err->tolerant = 0;
  lib.create_decompress(cinfo, JPEG_LIB_VERSION, sizeof(*cinfo));
  lib.mem_src(cinfo, data, (unsigned long)size);
  lib.read_header(cinfo, TRUE);
}

static PyObject *header_tuple(j_decompress_ptr cinfo) {
  PyObject *components = PyTuple_New(cinfo->num_components);
  int ci;
  if (components == NULL) return NULL;
  for (ci = 0; ci < cinfo->num_components; ci++) {
    const jpeg_component_info *c = &cinfo->comp_info[ci];
    PyObject *item = Py_BuildValue("(iiIIII)", c->h_samp_factor, c->v_samp_factor, c->width_in_blocks,
                                   c->height_in_blocks, c->downsampled_width, c->downsampled_height);
    if (item == NULL) {
      Py_DECREF(components);
      return NULL;
    }
    PyTuple_SET_ITEM(components, ci, item);
  }
  return Py_BuildValue("(IIiiiiN)", cinfo->image_width, cinfo->image_height, cinfo->data_precision,
                       (int)cinfo->progressive_mode, (int)cinfo->arith_code, (int)cinfo->jpeg_color_space,
                       components);
}

PyObject *coefficient_header(PyObject *self, PyObject *args) {
  Py_buffer data;
  struct jpeg_decompress_struct cinfo;
  strict_error err;
  PyObject *result;

  if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
  if (!bound) {
    PyBuffer_Release(&data);
    PyErr_SetString(PyExc_RuntimeError, "libjpeg is not bound: call bind() first");
    return NULL;
  }
  memset(&cinfo, 0, sizeof(cinfo));
  if (setjmp(err.jump)) {
    lib.destroy_decompress(&cinfo);
    PyBuffer_Release(&data);
    PyErr_SetString(JpegError, err.message);
    return NULL;
  }
  open_strict(&cinfo, &err, data.buf, (size_t)data.len);
  result = header_tuple(&cinfo);
  lib.destroy_decompress(&cinfo);
  PyBuffer_Release(&data);
  return result;
}

/* Blocks the caller's buffers must hold, from the header: 0 when they do not match. */
static int buffers_match(j_decompress_ptr cinfo, size_t blocks_len, size_t quant_len) {
  size_t total = 0;
  int ci;
  for (ci = 0; ci < cinfo->num_components; ci++)
    total += (size_t)cinfo->comp_info[ci].width_in_blocks * cinfo->comp_info[ci].height_in_blocks;
  return blocks_len == total * DCTSIZE2 * sizeof(JCOEF) &&
         quant_len == (size_t)cinfo->num_components * DCTSIZE2 * sizeof(UINT16);
}

/* jdcoefct.c smoothing_ok after the last scan (what Pillow's decode decides once it has read the
 * whole stream): 1 when the output pass would smooth; *dc_missing when a DC is never coded. */
static int would_smooth(j_decompress_ptr cinfo, int *dc_missing) {
  int ci, k, useful = 0;
  *dc_missing = 0;
  if (!cinfo->progressive_mode || cinfo->coef_bits == NULL) return 0;
  for (ci = 0; ci < cinfo->num_components; ci++) {
    const JQUANT_TBL *q = cinfo->comp_info[ci].quant_table;
    if (q == NULL) return 0;
    for (k = 0; k < SAVED_COEFS; k++)
      if (q->quantval[SMOOTHING_QUANT[k]] == 0) return 0;
    if (cinfo->coef_bits[ci][0] < 0) {
      *dc_missing = 1;
      return 0;
    }
    for (k = 1; k < SAVED_COEFS; k++)
      if (cinfo->coef_bits[ci][k] != 0) useful = 1;
  }
  return useful;
}

/* Reads the stream and copies the blocks out; runs without the GIL. 0, or -1 with err->message. */
static int read_nogil(const unsigned char *data, size_t size, JCOEF *blocks, size_t blocks_len, UINT16 *quant,
                      size_t quant_len, int *smoothing, int *dc_missing, strict_error *err) {
  struct jpeg_decompress_struct cinfo;
  jvirt_barray_ptr *arrays;
  int ci;

  memset(&cinfo, 0, sizeof(cinfo));
  if (setjmp(err->jump)) {
    lib.destroy_decompress(&cinfo);
    return -1;
  }
  open_strict(&cinfo, err, data, size);
  if (!buffers_match(&cinfo, blocks_len, quant_len)) {
    snprintf(err->message, sizeof(err->message), "the buffers do not fit the frame's blocks");
    lib.destroy_decompress(&cinfo);
    return -1;
  }
  arrays = lib.read_coefficients(&cinfo);
  for (ci = 0; ci < cinfo.num_components; ci++) {
    const jpeg_component_info *c = &cinfo.comp_info[ci];
    JDIMENSION row;
    if (c->quant_table == NULL) {
      snprintf(err->message, sizeof(err->message), "component %d has no quantization table", ci);
      lib.destroy_decompress(&cinfo);
      return -1;
    }
    memcpy(quant + (size_t)ci * DCTSIZE2, c->quant_table->quantval, DCTSIZE2 * sizeof(UINT16));
    for (row = 0; row < c->height_in_blocks; row++) {
      JBLOCKARRAY line = (*cinfo.mem->access_virt_barray)((j_common_ptr)&cinfo, arrays[ci], row, 1, FALSE);
      memcpy(blocks, line[0], (size_t)c->width_in_blocks * sizeof(JBLOCK));
      blocks += (size_t)c->width_in_blocks * DCTSIZE2;
    }
  }
  *smoothing = would_smooth(&cinfo, dc_missing);
  lib.finish_decompress(&cinfo);
  lib.destroy_decompress(&cinfo);
  return 0;
}

PyObject *read_coefficients(PyObject *self, PyObject *args) {
  Py_buffer data, blocks, quant;
  strict_error err;
  int status, smoothing = 0, dc_missing = 0;

  if (!PyArg_ParseTuple(args, "y*w*w*", &data, &blocks, &quant)) return NULL;
  if (!bound || !PyBuffer_IsContiguous(&blocks, 'C') || !PyBuffer_IsContiguous(&quant, 'C')) {
    PyErr_SetString(bound ? PyExc_ValueError : PyExc_RuntimeError,
                    bound ? "blocks and quant must be C-contiguous" : "libjpeg is not bound: call bind() first");
    status = -2;
  } else {
    Py_BEGIN_ALLOW_THREADS
    status = read_nogil(data.buf, (size_t)data.len, blocks.buf, (size_t)blocks.len, quant.buf, (size_t)quant.len,
                        &smoothing, &dc_missing, &err);
    Py_END_ALLOW_THREADS
  }
  PyBuffer_Release(&data);
  PyBuffer_Release(&blocks);
  PyBuffer_Release(&quant);
  if (status == -1) PyErr_SetString(JpegError, err.message);
  if (status != 0) return NULL;
  return Py_BuildValue("(OO)", smoothing ? Py_True : Py_False, dc_missing ? Py_True : Py_False);
}
