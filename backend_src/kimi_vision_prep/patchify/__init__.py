"""The patchify stage: normalise + pad + patchify through the table (numba and torch kernels), and
K3's chessboard composite before it.

May import the root foundations (kernels, limits, buffers, numba_runtime, extras, pixels) and
kimi_vision_common; never another stage (decode, resize, video) nor a root meeting module.
"""
