"""The resize stage: Pillow-exact resizing, one kernel per array type (numba, torch, Pillow), and
the resampling geometry they share.

May import the root foundations (kernels, limits, buffers, numba_runtime, extras, pixels) and
kimi_vision_common; never another stage (decode, patchify, video) nor a root meeting module.
"""
