"""Triton Python model kimi_k3_decode: thin wrapper; the logic is kimi_vision_prep.serving.models.DecodeModel.

config.pbtxt parameters select the preset and the runtime knobs (see that class's docstring).
"""

import triton_python_backend_utils as pb_utils

from kimi_vision_prep.serving.models import DecodeModel


class TritonPythonModel:
    def initialize(self, args):
        self.model = DecodeModel(pb_utils, args)

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
