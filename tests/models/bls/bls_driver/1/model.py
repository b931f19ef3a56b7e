"""A scriptable BLS caller for tests: SPEC (JSON) says which request to build and how to run
it; REPORT (JSON) says what came back, field by field, as the caller's stub saw it.

SPEC keys: model, version, inputs {name: {data, dtype}}, data_as (send the DATA input under
this name, as received: a zero-copy forward), outputs, request_id, correlation_id, flags,
timeout, parameters, preferred_memory ([kind, device id]), mode (sync | decoupled |
decoupled_cancel | thread | thread_decoupled), repeat (sync calls in a row; only the last
response is described), return_output (attach that output tensor of the last response as
OUTPUT0, as received).
"""
import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


def _transport():
    rt = getattr(pb_utils, "_runtime", None)
    return getattr(rt, "transport", None)


def _in_shm(arr):
    tr = _transport()
    try:
        # (a block's view: shared, or copy-on-write as every tensor a stub receives is)
        return tr is not None and (tr.segments.locate(arr) is not None
                                   or tr.private.source(arr) is not None)
    except Exception:
        return None


def describe(response):
    out = {"error": None, "outputs": {}, "parameters": json.loads(response.parameters())}
    err = response.error()
    if err is not None:
        out["error"] = {"code": err.code(), "message": err.message()}
    for t in response.output_tensors():
        arr = t.as_numpy()
        d = {"dtype": str(arr.dtype), "shape": list(arr.shape), "owndata": bool(arr.flags.owndata),
             "in_shm": _in_shm(arr)}
        if arr.size <= 64:
            d["values"] = [v.decode() if isinstance(v, bytes) else v for v in arr.tolist()] \
                if arr.ndim == 1 else arr.tolist()
        out["outputs"][t.name()] = d
    return out


class TritonPythonModel:
    def initialize(self, args):
        self.instance = args["model_instance_name"]

    def build(self, spec, data):
        inputs = []
        for name, v in (spec.get("inputs") or {}).items():
            dtype = np.object_ if v.get("dtype") == "object" else np.dtype(v.get("dtype", "float32"))
            arr = np.array(v["data"], dtype=dtype)
            inputs.append(pb_utils.Tensor(name, arr))
        if spec.get("data_as"):
            inputs.append(pb_utils.Tensor(spec["data_as"], data.as_numpy()))
        kwargs = dict(model_name=spec["model"], requested_output_names=spec.get("outputs", []),
                      inputs=inputs)
        for key in ("request_id", "correlation_id", "flags", "timeout", "parameters"):
            if key in spec:
                kwargs[key] = spec[key]
        if "version" in spec:
            kwargs["model_version"] = spec["version"]
        if "preferred_memory" in spec:
            kind, device = spec["preferred_memory"]  # (a number in JSON: Triton takes no int)
            kwargs["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.MemoryType(kind),
                                                                  device)
        return pb_utils.InferenceRequest(**kwargs)

    def run(self, spec, data, report):
        mode = spec.get("mode", "sync")
        request = self.build(spec, data)
        if mode == "sync":
            response = None
            errors = 0
            for _ in range(int(spec.get("repeat", 1))):
                response = request.exec()
                errors += response.has_error()
                report["calls"] += 1
            report["errors"] = errors
            report["responses"].append(describe(response))
            return response
        if mode in ("decoupled", "decoupled_cancel"):
            last = None
            iterator = request.exec(decoupled=True)
            for response in iterator:
                report["responses"].append(describe(response))
                if mode == "decoupled_cancel" and len(report["responses"]) == 1:
                    iterator.cancel()
                last = response
            return last
        if mode in ("thread", "thread_decoupled"):
            box = {}

            def work():
                try:
                    if mode == "thread":
                        box["responses"] = [request.exec()]
                    else:
                        box["responses"] = list(request.exec(decoupled=True))
                except Exception as exc:  # reported, not raised, so the test can see it
                    box["exception"] = f"{type(exc).__name__}: {exc}"

            t = threading.Thread(target=work, name="bls-background")
            t.start()
            t.join(float(spec.get("thread_timeout", 20)))
            report["thread_hung"] = t.is_alive()
            if "exception" in box:
                report["exception"] = box["exception"]
            for r in box.get("responses", []):
                report["responses"].append(describe(r))
            return (box.get("responses") or [None])[-1]
        raise ValueError(f"unknown mode {mode!r}")

    def execute(self, requests):
        responses = []
        for request in requests:
            spec = json.loads(pb_utils.get_input_tensor_by_name(request, "SPEC").as_numpy()[0])
            data = pb_utils.get_input_tensor_by_name(request, "DATA")
            report = {"responses": [], "exception": None, "calls": 0, "instance": self.instance}
            tr = _transport()
            before = (tr.copies, tr.forwards) if tr is not None else (0, 0)
            outputs = []
            try:
                last = self.run(spec, data, report)
                want = spec.get("return_output")
                if want and last is not None:
                    t = pb_utils.get_output_tensor_by_name(last, want)
                    if t is not None:
                        outputs.append(pb_utils.Tensor("OUTPUT0", t.as_numpy()))
                del last
            except pb_utils.TritonModelException as exc:
                report["exception"] = f"TritonModelException: {exc.message()}"
            except Exception as exc:
                report["exception"] = f"{type(exc).__name__}: {exc}"
            if tr is not None:
                report["stub_copies"] = tr.copies - before[0]
                report["stub_forwards"] = tr.forwards - before[1]
            outputs.append(pb_utils.Tensor("REPORT", np.array([json.dumps(report)], dtype=np.object_)))
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
