"""The decode stage: encoded bytes -> pixels at the stored size, with Pillow's verdict (the routes,
their decoder pool, the JPEG scan, libjpeg-turbo in row bands, EXIF orientation of decoded pixels).

May import the root foundations (kernels, limits, buffers, numba_runtime, extras, pixels) and
kimi_vision_common; never another stage (resize, patchify, video) nor a root meeting module.
"""
