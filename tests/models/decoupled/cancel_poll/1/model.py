"""Cancellation as a model sees it (request parameter 'mode'):
poll         send one response, then poll request.is_cancelled() until it turns True (10 s max)
poll_thread  the same from a thread, after execute has returned
stream       send a response every 2 ms until cancelled (10 s max)
gate         wait for the file named by parameter 'path' to exist, then answer
check        record is_cancelled() of request and sender, then answer
report       answer REPORT (JSON): what each request saw, and every request id executed."""
import json
import os
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def out(v):
    return pb_utils.InferenceResponse(
        output_tensors=[pb_utils.Tensor("OUT", np.array([v], dtype=np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.seen = {}
        self.executed = []
        self.threads = []

    def poll(self, request, sender, rid):
        t0 = time.monotonic()
        while not request.is_cancelled() and time.monotonic() - t0 < 10:
            time.sleep(0.002)
        self.seen[rid] = {"cancelled": request.is_cancelled(),
                          "sender_cancelled": sender.is_cancelled(),
                          "waited_ms": int((time.monotonic() - t0) * 1000)}
        sender.send(flags=FINAL)

    def execute(self, requests):
        for request in requests:
            params = json.loads(request.parameters())
            mode, rid = params.get("mode", ""), request.request_id()
            self.executed.append(rid)
            sender = request.get_response_sender()
            if mode == "poll":
                sender.send(out(0))
                self.poll(request, sender, rid)
            elif mode == "poll_thread":
                sender.send(out(0))
                t = threading.Thread(target=self.poll, args=(request, sender, rid), daemon=True)
                t.start()
                self.threads.append(t)
            elif mode == "stream":
                t0, n = time.monotonic(), 0
                while not request.is_cancelled() and time.monotonic() - t0 < 10:
                    sender.send(out(n))
                    n += 1
                    time.sleep(0.002)
                self.seen[rid] = {"cancelled": request.is_cancelled(), "sent": n}
                sender.send(flags=FINAL)
            elif mode == "gate":
                deadline = time.monotonic() + 20
                while not os.path.exists(params["path"]) and time.monotonic() < deadline:
                    time.sleep(0.002)
                sender.send(out(1), flags=FINAL)
            elif mode == "check":
                self.seen[rid] = {"cancelled": request.is_cancelled(),
                                  "sender_cancelled": sender.is_cancelled()}
                sender.send(out(2), flags=FINAL)
            elif mode == "report":
                for t in self.threads:
                    t.join(timeout=10)
                report = {"seen": self.seen, "executed": self.executed}
                sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(
                    "REPORT", np.array([json.dumps(report)], dtype=np.object_))]), flags=FINAL)
            else:
                sender.send(flags=FINAL)
        return None

    def finalize(self):
        for t in self.threads:
            t.join(timeout=10)
