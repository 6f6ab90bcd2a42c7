"""Triton Python model kimi_k3_vision_fused: thin wrapper; the logic is
kimi_vision_prep.serving.models.FusedVisionModel (decode + preprocess in one model).

config.pbtxt parameters select the preset and the runtime knobs (see that class's docstring).
"""

import triton_python_backend_utils as pb_utils

from kimi_vision_prep.serving.models import FusedVisionModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = FusedVisionModel(pb_utils, args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
