"""Returns INPUT0 as OUTPUT0 by handle (the very array it received), and says in the response
parameters how that array lives in this stub: a view of shared memory, not a private copy."""
import mmap

import triton_python_backend_utils as pb_utils


def _root_buffer(arr):
    base = arr
    while getattr(base, "base", None) is not None:
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base


class TritonPythonModel:
    def execute(self, requests):
        rt = getattr(pb_utils, "_runtime", None)
        responses = []
        for request in requests:
            arr = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            root = _root_buffer(arr)
            params = {
                "owndata": bool(arr.flags.owndata),
                "mmap_view": isinstance(root, mmap.mmap),
                # (a block's view: shared, or copy-on-write as every input of a stub is)
                "in_shm": bool(rt is not None and (
                    rt.transport.segments.locate(arr) is not None
                    or rt.transport.private.source(arr) is not None)),
                "nbytes": int(arr.nbytes),
            }
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", arr)], parameters=params))
        return responses
