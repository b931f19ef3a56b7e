"""Answers with its own version number (version 2 links to this file)."""
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.version = int(args["model_version"])

    def execute(self, requests):
        out = pb_utils.Tensor("VERSION", np.array([self.version], dtype=np.int32))
        return [pb_utils.InferenceResponse(output_tensors=[out]) for _ in requests]
