"""Lifetimes of pb_utils custom metrics, seen on the metrics page as Triton 2.51 shows them.

Measured on Triton 2.51 (the colleague's audit, ``q2_run.sh`` and ``q2b_run.sh``): deleting a
``MetricFamily`` object drops every series made through it at once, HELP and TYPE included,
even under a Metric object still alive (whose operations then raise, with the prefix of
Triton's stub); the same name made again starts from 0 with the first description; deleting a
Metric object alone keeps its series; a model whose ``finalize`` deletes its families loses
its series on unload, and one whose ``finalize`` does not keeps them and goes on counting after
a reload. Beyond what was measured: a stub that dies deletes nothing, and a series that another
live stub's family made too stays.
"""
from __future__ import annotations

import json
import os
import signal

import pytest

from _models import fp32, infer, io_config, serving, wait_for, write_model
from tritonpy.metrics import metrics_text

pytestmark = pytest.mark.timeout(120)

# One model per family prefix ``P``: each request names an operation in its parameters.
LIFECYCLE_PY = '''
import json
import triton_python_backend_utils as pb_utils

P = "{prefix}"
DELETES_IN_FINALIZE = {finalize}


class TritonPythonModel:
    def initialize(self, args):
        self.fam = pb_utils.MetricFamily(P + "_cnt", "audit counter", pb_utils.MetricFamily.COUNTER)
        self.m_a = self.fam.Metric(labels={{"k": "a"}})
        self.m_b = self.fam.Metric(labels={{"k": "b"}})
        self.gfam = pb_utils.MetricFamily(P + "_gauge", "audit gauge", pb_utils.MetricFamily.GAUGE)
        self.g = self.gfam.Metric(labels={{"k": "g"}})
        self.hfam = pb_utils.MetricFamily(P + "_hist", "audit histogram",
                                          pb_utils.MetricFamily.HISTOGRAM)
        self.h = self.hfam.Metric(labels={{"k": "h"}}, buckets=[1.0, 2.0])

    def finalize(self):
        if DELETES_IN_FINALIZE:  # the metrics first, then their families
            for n in ("m_a", "m_b", "g", "h", "fam", "gfam", "hfam"):
                if hasattr(self, n):
                    delattr(self, n)

    def op_bump(self):
        for n in ("m_a", "m_b", "m_a2"):
            if hasattr(self, n):
                getattr(self, n).increment(1)
        if hasattr(self, "g"):
            self.g.set(5)
        if hasattr(self, "h"):
            self.h.observe(1.5)
        return "ok"

    def op_del_metric(self):
        del self.m_a
        return "deleted m_a"

    def op_local_metric(self):
        local = self.fam.Metric(labels={{"k": "local"}})
        local.increment(7)
        return "local out of scope"

    def op_del_family(self):
        del self.m_b
        del self.fam
        return "deleted m_b and fam"

    def op_del_family_under_metric(self):
        del self.gfam
        out = {{}}
        for what, call in (("set", lambda: self.g.set(9)),
                           ("increment", lambda: self.g.increment(1)),
                           ("value", lambda: self.g.value())):
            try:
                call()
                out[what] = "no error"
            except pb_utils.TritonModelException as exc:
                out[what] = str(exc)
        return json.dumps(out)

    def op_observe_after_family_gone(self):
        fam = pb_utils.MetricFamily(P + "_tmp", "temporary", pb_utils.MetricFamily.HISTOGRAM)
        m = fam.Metric(labels={{"k": "t"}}, buckets=[1.0])
        m.observe(0.5)
        del fam
        try:
            m.observe(0.5)
            return "no error"
        except pb_utils.TritonModelException as exc:
            return str(exc)

    def op_cyclic_family(self):
        # A family only a reference cycle keeps: the cyclic collector frees it, here in
        # gc.collect(), in general at whatever allocation starts a collection (a send of
        # the stub's included), so its deletion is sent at the next safe point.
        import gc
        holder = {{}}
        holder["self"] = holder
        holder["fam"] = pb_utils.MetricFamily(P + "_cyc", "cyclic", pb_utils.MetricFamily.GAUGE)
        holder["fam"].Metric(labels={{"k": "c"}}).set(3)
        del holder
        gc.collect()
        return "collected"

    def op_del_hist_metric(self):
        del self.h
        return "deleted h"

    def op_recreate(self):
        self.fam2 = pb_utils.MetricFamily(P + "_cnt", "audit counter again",
                                          pb_utils.MetricFamily.COUNTER)
        self.m_a2 = self.fam2.Metric(labels={{"k": "a"}})
        return repr(self.m_a2.value())

    def execute(self, requests):
        out = []
        for r in requests:
            op = json.loads(r.parameters())["op"]
            try:
                msg = getattr(self, "op_" + op)()
            except Exception as exc:
                msg = "exception %s: %s" % (type(exc).__name__, exc)
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())],
                parameters={{"msg": msg}}))
        return out
'''

# A family shared by name with other models: its own series k=<model>, and k=shared, which
# the other models make too.
SHARED_PY = '''
import json
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        name = args["model_name"]
        self.fam = pb_utils.MetricFamily("shared_cnt", "shared counter",
                                         pb_utils.MetricFamily.COUNTER)
        self.mine = self.fam.Metric(labels={"k": name})
        self.shared = self.fam.Metric(labels={"k": "shared"})

    def execute(self, requests):
        for r in requests:
            op = json.loads(r.parameters())["op"]
            if op == "bump":
                self.mine.increment(1)
                self.shared.increment(1)
            elif op == "del_family":
                del self.mine, self.shared, self.fam
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy())],
            parameters={"pid": __import__("os").getpid()}) for r in requests]
'''

DELETED = ("Invalid metric operation as the corresponding 'MetricFamily' has been deleted. The "
           "'MetricFamily' object should be deleted AFTER its corresponding 'Metric' objects "
           "have been deleted.")


def shown(server, prefix: str) -> list[str]:
    """The lines of the metrics page about families named ``prefix...``, sorted (tritonpy
    lists a family's series oldest first, Triton newest first: the order is not compared)."""
    def family(line: str) -> str:
        return line.split()[2] if line.startswith(("# HELP ", "# TYPE ")) else line

    return sorted(line for line in metrics_text(server).splitlines()
                  if family(line).startswith(prefix))


def run(model, op: str) -> str:
    resp = infer(model, {"IN": fp32(1)}, parameters={"op": op})
    assert resp.error is None, resp.error
    return resp.parameters.get("msg", "")


def counter(prefix: str, help_text: str, **series: float) -> list[str]:
    return [f"# HELP {prefix}_cnt {help_text}", f"# TYPE {prefix}_cnt counter"] + [
        f'{prefix}_cnt{{k="{k}"}} {v:g}' for k, v in series.items()]


def hist(prefix: str, count: int) -> list[str]:
    return [f"# HELP {prefix}_hist audit histogram", f"# TYPE {prefix}_hist histogram",
            f'{prefix}_hist_bucket{{k="h",le="1"}} 0',
            f'{prefix}_hist_bucket{{k="h",le="2"}} {count}',
            f'{prefix}_hist_bucket{{k="h",le="+Inf"}} {count}',
            f'{prefix}_hist_count{{k="h"}} {count}', f'{prefix}_hist_sum{{k="h"}} {1.5 * count:g}']


def gauge(prefix: str, value: float) -> list[str]:
    return [f"# HELP {prefix}_gauge audit gauge", f"# TYPE {prefix}_gauge gauge",
            f'{prefix}_gauge{{k="g"}} {value:g}']


def test_deleting_a_family_drops_its_series_and_the_name_starts_afresh(tmp_path, shm_prefix):
    # Triton's q2_run.sh sequence, step by step.
    write_model(tmp_path, "cm", LIFECYCLE_PY.format(prefix="audit", finalize=False))
    with serving(tmp_path, shm_prefix) as srv:
        cm = srv.model("cm")
        assert shown(srv, "audit_") == sorted(
            counter("audit", "audit counter", a=0, b=0) + gauge("audit", 0) + hist("audit", 0))
        run(cm, "bump")
        after_bump = counter("audit", "audit counter", a=1, b=1) + gauge("audit", 5)
        assert shown(srv, "audit_") == sorted(after_bump + hist("audit", 1))
        # A Metric object deleted, or gone out of scope: its series stays.
        assert run(cm, "del_metric") == "deleted m_a"
        assert run(cm, "local_metric") == "local out of scope"
        assert shown(srv, "audit_cnt") == sorted(
            counter("audit", "audit counter", a=1, b=1, local=7))
        # The family object deleted: all of its series go, those of deleted metrics included,
        # and with them its HELP and TYPE lines.
        assert run(cm, "del_family") == "deleted m_b and fam"
        assert shown(srv, "audit_cnt") == []
        assert shown(srv, "audit_") == sorted(gauge("audit", 5) + hist("audit", 1))
        # Deleted under a live Metric: gone at once; the Metric's operations raise Triton's
        # error, after the prefix of Triton's stub for each operation.
        errors = json.loads(run(cm, "del_family_under_metric"))
        assert errors == {"set": "Failed to set metric value: " + DELETED,
                          "increment": "Failed to increment metric value: " + DELETED,
                          "value": "Failed to get metric value: " + DELETED}
        assert shown(srv, "audit_gauge") == []
        assert run(cm, "observe_after_family_gone") == (
            "Failed to observe metric value: " + DELETED)
        assert shown(srv, "audit_tmp") == []
        # A histogram Metric deleted alone: its series stays.
        assert run(cm, "del_hist_metric") == "deleted h"
        # As on Triton: bumping again stops at the gauge metric, whose family is gone.
        assert run(cm, "bump") == "exception TritonModelException: " + (
            "Failed to set metric value: " + DELETED)
        assert shown(srv, "audit_") == sorted(hist("audit", 1))
        # The same name again: a fresh series at 0, under the first description.
        assert run(cm, "recreate") == "0.0"
        assert shown(srv, "audit_cnt") == sorted(counter("audit", "audit counter", a=0))


def test_a_family_the_cyclic_collector_frees_leaves_the_page(tmp_path, shm_prefix):
    write_model(tmp_path, "cm", LIFECYCLE_PY.format(prefix="cyc", finalize=False))
    with serving(tmp_path, shm_prefix) as srv:
        cm = srv.model("cm")
        assert run(cm, "cyclic_family") == "collected"
        # Sent before the execute's responses: the page no longer has it once they came.
        assert not [line for line in metrics_text(srv).splitlines() if "cyc_cyc" in line]
        run(cm, "bump")  # the stub serves on, its channel intact
        assert 'cyc_cnt{k="a"} 1' in metrics_text(srv)


def test_finalize_that_deletes_its_families_drops_them_on_unload(tmp_path, shm_prefix):
    # Triton's q2b_run.sh: cm's finalize deletes nothing, cmf's deletes its metrics and then
    # its families.
    write_model(tmp_path, "cm", LIFECYCLE_PY.format(prefix="keep", finalize=False))
    write_model(tmp_path, "cmf", LIFECYCLE_PY.format(prefix="drop", finalize=True))
    with serving(tmp_path, shm_prefix, model_control_mode="explicit",
                 load_models=["cm", "cmf"]) as srv:
        for name in ("cm", "cmf"):
            run(srv.model(name), "bump")
            run(srv.model(name), "bump")
        kept = counter("keep", "audit counter", a=2, b=2) + gauge("keep", 5) + hist("keep", 2)
        assert shown(srv, "keep_") == sorted(kept)
        assert shown(srv, "drop_") == sorted(
            counter("drop", "audit counter", a=2, b=2) + gauge("drop", 5) + hist("drop", 2))
        srv.unload("cm")
        srv.unload("cmf")
        assert shown(srv, "drop_") == []
        assert shown(srv, "keep_") == sorted(kept)
        srv.load("cm")
        srv.load("cmf")
        # Reloaded: cm's metrics of the same labels go on from the old values, cmf's start at 0.
        assert shown(srv, "keep_") == sorted(kept)
        assert shown(srv, "drop_") == sorted(
            counter("drop", "audit counter", a=0, b=0) + gauge("drop", 0) + hist("drop", 0))
        for name in ("cm", "cmf"):
            run(srv.model(name), "bump")
        assert shown(srv, "keep_") == sorted(
            counter("keep", "audit counter", a=3, b=3) + gauge("keep", 5) + [
                "# HELP keep_hist audit histogram", "# TYPE keep_hist histogram",
                'keep_hist_bucket{k="h",le="1"} 0', 'keep_hist_bucket{k="h",le="2"} 3',
                'keep_hist_bucket{k="h",le="+Inf"} 3', 'keep_hist_count{k="h"} 3',
                'keep_hist_sum{k="h"} 4.5'])
        assert shown(srv, "drop_") == sorted(
            counter("drop", "audit counter", a=1, b=1) + gauge("drop", 5) + hist("drop", 1))


def test_a_series_another_live_stub_made_stays_when_one_deletes_its_family(tmp_path,
                                                                           shm_prefix):
    for name in ("sa", "sb"):
        write_model(tmp_path, name, SHARED_PY)
    with serving(tmp_path, shm_prefix) as srv:
        sa, sb = srv.model("sa"), srv.model("sb")
        for m in (sa, sb):
            run(m, "bump")
        head = ["# HELP shared_cnt shared counter", "# TYPE shared_cnt counter"]
        assert shown(srv, "shared_cnt") == sorted(
            head + ['shared_cnt{k="sa"} 1', 'shared_cnt{k="sb"} 1', 'shared_cnt{k="shared"} 2'])
        run(sa, "del_family")  # sb's family made k=shared too: it stays, sa's own goes
        assert shown(srv, "shared_cnt") == sorted(
            head + ['shared_cnt{k="sb"} 1', 'shared_cnt{k="shared"} 2'])
        run(sb, "bump")
        run(sb, "del_family")
        assert shown(srv, "shared_cnt") == []


def test_a_stub_that_dies_deletes_nothing(tmp_path, shm_prefix):
    for name in ("sa", "sb"):
        write_model(tmp_path, name, SHARED_PY)
    backend = {"restart-backoff-seconds": "0.1"}
    with serving(tmp_path, shm_prefix, backend_config=backend) as srv:
        sa, sb = srv.model("sa"), srv.model("sb")
        run(sa, "bump")
        run(sb, "bump")
        (inst,) = srv.runtime("sa").instances
        first = inst.stub.pid
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: inst.stub.pid != first and sa.ready(), timeout=30)
        # The dead stub's series stay; the replacement's metrics of the same labels go on.
        head = ["# HELP shared_cnt shared counter", "# TYPE shared_cnt counter"]
        assert shown(srv, "shared_cnt") == sorted(
            head + ['shared_cnt{k="sa"} 1', 'shared_cnt{k="sb"} 1', 'shared_cnt{k="shared"} 2'])
        run(sa, "bump")
        assert shown(srv, "shared_cnt") == sorted(
            head + ['shared_cnt{k="sa"} 2', 'shared_cnt{k="sb"} 1', 'shared_cnt{k="shared"} 3'])
        # The dead stub's family no longer holds anything: once the live ones are deleted,
        # the series go.
        run(sb, "del_family")
        assert shown(srv, "shared_cnt") == sorted(head + ['shared_cnt{k="sa"} 2',
                                                          'shared_cnt{k="shared"} 3'])
        run(sa, "del_family")
        assert shown(srv, "shared_cnt") == []


def test_model_runner_drops_the_series_of_a_deleted_family(tmp_path):
    from tritonpy.testing import ModelRunner

    mdir = write_model(tmp_path, "cmr", LIFECYCLE_PY.format(prefix="run", finalize=True),
                       io_config())
    with ModelRunner(mdir) as runner:
        def run_op(op: str) -> str:
            [resp] = runner.execute([runner.request({"IN": fp32(1)}, parameters={"op": op})])
            return json.loads(resp.parameters())["msg"]

        run_op("bump")
        assert runner.metrics[("run_cnt", (("k", "a"),))] == 1.0
        run_op("del_family")
        assert not [key for key in runner.metrics if key[0] == "run_cnt"]
        assert run_op("recreate") == "0.0"
        assert runner.metrics[("run_cnt", (("k", "a"),))] == 0.0
        assert runner.metrics[("run_gauge", (("k", "g"),))] == 5.0
