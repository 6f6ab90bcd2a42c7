"""The video stage: an encoded video -> its sampled frames as RGB arrays, chunk by chunk, decoding
only what they need; the data flows once: demux -> plan -> frames (sampling.py drives it).

May import the root foundations (kernels, limits, buffers, numba_runtime, extras, pixels) and
kimi_vision_common; never another stage (decode, resize, patchify) nor a root meeting module
(video_pipeline.py, at the root, is where its frames meet resize and patchify).
"""
