"""--metrics-config as Triton 2.51 reads it (measured against the anchor): the duration
counters go with ``counter_latencies=false``; ``summary_latencies=true`` adds a summary per
duration (count, sum, then each quantile of about the last minute); ``summary_quantiles`` picks
the quantiles; a setting without ``=`` stops the start. Real stubs, the real metrics page."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest
from _models import SLEEPER_PY, infer, serving, write_model

from tritonpy import MetricsConfig
from tritonpy._stats import DEFAULT_QUANTILES, LatencySummary, quantiles_of
from tritonpy._cli_settings import metrics_config
from tritonpy.cli import build_parser
from tritonpy.metrics import metrics_text

pytestmark = pytest.mark.timeout(60)

DURATIONS = ("request", "queue", "compute_input", "compute_infer", "compute_output")


def _lines(text: str, family: str) -> list[str]:
    return [line for line in text.splitlines()
            if line.startswith(family) or line.startswith(f"# TYPE {family} ")
            or line.startswith(f"# HELP {family} ")]


def test_parse_reads_settings_as_triton() -> None:
    assert MetricsConfig.parse([]) == MetricsConfig()
    config = MetricsConfig.parse(["counter_latencies=false", "summary_latencies=true",
                                  "summary_quantiles=0.5:0.05,0.9:0.01", "foo=bar"])
    assert (config.counter_latencies, config.summary_latencies) == (False, True)
    assert config.summary_quantiles == ((0.5, 0.05), (0.9, 0.01))
    # Only the exact words turn things on and off.
    loose = MetricsConfig.parse(["summary_latencies=TRUE", "counter_latencies=0"])
    assert (loose.counter_latencies, loose.summary_latencies) == (True, False)
    # A named group's settings are not the models' (Triton reads the global group only).
    assert MetricsConfig.parse(["other,summary_latencies=true"]) == MetricsConfig()
    assert MetricsConfig.parse([",summary_latencies=true"]).summary_latencies
    with pytest.raises(ValueError, match="format is <setting>=<value>. Got nokeyvalue"):
        MetricsConfig.parse(["nokeyvalue"])
    # As Triton 2.51 (measured; QA L0_metrics): an empty value is no setting either, and a
    # setting turned on or off stays so however often it is repeated (tritonpy started with
    # the empty value, and took the last of the repeats).
    with pytest.raises(ValueError, match="Got summary_quantiles=$"):
        MetricsConfig.parse(["summary_quantiles="])
    assert MetricsConfig.parse(["summary_latencies=true", "summary_latencies=false"]) == \
        MetricsConfig(summary_latencies=True)
    assert MetricsConfig.parse(["counter_latencies=false", "counter_latencies=true"]) == \
        MetricsConfig(counter_latencies=False)


def test_quantile_numbers_are_read_as_cpp_stod_reads_them(
        caplog: pytest.LogCaptureFixture) -> None:
    # Triton 2.51 (measured; QA L0_metrics' test_summaries_custom_quantiles, which failed
    # on tritonpy): the number at the start counts, the rest is ignored; no number at all is
    # logged with stod's word.
    parsed = MetricsConfig.parse(["summary_quantiles=0.1:0.0.1,0.7:0.01,0.3x:0.01y"])
    assert parsed.summary_quantiles == ((0.1, 0.0), (0.7, 0.01), (0.3, 0.01))
    with caplog.at_level(logging.ERROR, logger="tritonpy._stats"):
        assert MetricsConfig.parse(["summary_quantiles=abc:0.1,0.5:.05"]).summary_quantiles == \
            ((0.5, 0.05),)
    assert "Invalid option: [abc:0.1]. Error: stod" in caplog.text


def test_malformed_quantiles_are_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="tritonpy._stats"):
        assert MetricsConfig.parse(["summary_quantiles=abc"]).summary_quantiles == \
            DEFAULT_QUANTILES
        assert MetricsConfig.parse(["summary_quantiles=0.5,0.9:0.01"]).summary_quantiles == \
            ((0.9, 0.01),)
    assert "Invalid option: [abc]. No ':' delimiter found" in caplog.text
    assert "Invalid option: [0.5]" in caplog.text


def test_a_quantile_outside_0_to_1_is_logged_and_skipped(
        caplog: pytest.LogCaptureFixture) -> None:
    # A quantile of 2 or an error of -1 was taken without a word.
    with caplog.at_level(logging.ERROR, logger="tritonpy._stats"):
        assert MetricsConfig.parse(["summary_quantiles=2:0.1,0.9:-1,0.5:0.05,nan:0.1"]) \
            .summary_quantiles == ((0.5, 0.05),)
    for item in ("2:0.1", "0.9:-1", "nan:0.1"):
        assert f"Invalid option: [{item}]. A quantile and its error are between 0 and 1" \
            in caplog.text


def test_a_setting_without_a_value_stops_the_start() -> None:
    args = build_parser().parse_args(["serve", "--metrics-config", "nokeyvalue"])
    with pytest.raises(SystemExit, match='Bad option: "--metrics-config". --metrics-config '
                                         'option format is <setting>=<value>. Got nokeyvalue'):
        metrics_config(args)
    args = build_parser().parse_args(["serve", "--metrics-config", "summary_latencies=true",
                                      "--metrics-config", "summary_quantiles=0.5:0.05"])
    assert metrics_config(args) == MetricsConfig(summary_latencies=True,
                                                 summary_quantiles=((0.5, 0.05),))


def test_summary_window_quantiles_and_memory() -> None:
    s = LatencySummary()
    for i, us in enumerate(range(1, 101)):
        s.observe(us, now=1000.0 + i * 0.01)
    assert (s.count, s.sum) == (100, 5050)
    assert quantiles_of(s.window(1001.0), [0.5, 0.9, 0.99, 0.999]) == [50.0, 90.0, 99.0, 100.0]
    # A minute later those observations have left the quantiles, not the count and sum.
    assert quantiles_of(s.window(1000.0 + 61 + LatencySummary.MAX_AGE / 5), [0.5]) != [50.0]
    assert np.isnan(quantiles_of(s.window(1100.0), [0.5])[0])
    assert (s.count, s.sum) == (100, 5050)
    # A busy minute keeps a bounded sample per age bucket, and its quantiles stay close.
    busy = LatencySummary()
    for i in range(50_000):
        busy.observe(i % 1000, now=2000.0)
    kept = busy.window(2000.0)
    assert len(kept) == LatencySummary.KEEP
    p50, p99 = quantiles_of(kept, [0.5, 0.99])
    assert abs(p50 - 500) < 60 and abs(p99 - 990) < 15


def test_summaries_and_no_duration_counters_on_the_metrics_page(tmp_path, shm_prefix) -> None:
    write_model(tmp_path / "repo", "sleeper", SLEEPER_PY)
    config = MetricsConfig.parse(["summary_latencies=true", "counter_latencies=false",
                                  "summary_quantiles=0.5:0.05,0.9:0.01"])
    with serving(tmp_path / "repo", shm_prefix, metrics_config=config) as server:
        text = metrics_text(server)
        # Before any request: the series are there, count 0 and no quantile yet.
        assert 'nv_inference_request_summary_us_count{model="sleeper",version="1"} 0' in text
        assert 'nv_inference_request_summary_us{model="sleeper",version="1",quantile="0.5"} ' \
               'NaN' in text
        model = server.model("sleeper")
        for ms in (5, 5, 5, 40):
            infer(model, {"IN": np.array([ms], np.float32)})
        text = metrics_text(server)
    assert "_duration_us" not in text  # counter_latencies=false
    assert "nv_cache_" not in text  # no response cache
    assert 'nv_inference_request_success{model="sleeper",version="1"} 4' in text
    for key in DURATIONS:
        family = f"nv_inference_{key}_summary_us"
        lines = _lines(text, family)
        labels = 'model="sleeper",version="1"'
        assert lines[1] == f"# TYPE {family} summary", lines
        assert lines[2] == f"{family}_count{{{labels}}} 4", lines
        assert re.fullmatch(rf"{family}_sum\{{{labels}\}} \d+", lines[3]), lines
        assert [line.split(" ")[0] for line in lines[4:]] == [
            f'{family}{{{labels},quantile="0.5"}}', f'{family}{{{labels},quantile="0.9"}}']
    values = {line.split(" ")[0]: int(line.split(" ")[1])
              for line in _lines(text, "nv_inference_compute_infer_summary_us")[2:]}
    labels = 'model="sleeper",version="1"'
    # The model slept 5, 5, 5 and 40 ms: the median is about 5 ms, the 0.9 quantile 40 ms.
    assert 5_000 <= values[f'nv_inference_compute_infer_summary_us{{{labels},quantile="0.5"}}'] \
        < 40_000
    assert values[f'nv_inference_compute_infer_summary_us{{{labels},quantile="0.9"}}'] >= 40_000
    assert values[f"nv_inference_compute_infer_summary_us_sum{{{labels}}}"] >= 55_000


def test_a_cached_model_has_cache_hit_and_miss_summaries(tmp_path, shm_prefix) -> None:
    # As Triton 2.51 (measured): with the response cache, a model that enables it has
    # nv_cache_hit/miss_summary_per_model and no request summary; the others the reverse.
    write_model(tmp_path / "repo", "sleeper", SLEEPER_PY)
    write_model(tmp_path / "repo", "cached", SLEEPER_PY, config=(
        'backend: "python"\ninput [ { name: "IN", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        "response_cache { enable: true }\n"))
    config = MetricsConfig.parse(["summary_latencies=true"])
    with serving(tmp_path / "repo", shm_prefix, metrics_config=config,
                 response_cache_size=1 << 20) as server:
        for ms in (1, 2, 1, 1):
            infer(server.model("cached"), {"IN": np.array([ms], np.float32)})
        infer(server.model("sleeper"), {"IN": np.array([1], np.float32)})
        text = metrics_text(server)
    cached, plain = 'model="cached",version="1"', 'model="sleeper",version="1"'
    for family, count, doc in (("nv_cache_hit_summary_per_model", 2, "hit"),
                               ("nv_cache_miss_summary_per_model", 2, "miss")):
        lines = _lines(text, family)
        assert lines[0] == (f"# HELP {family} Summary of cache {doc} counts/durations per "
                            "model, in microseconds."), lines
        assert lines[2] == f"{family}_count{{{cached}}} {count}", lines
        assert not [line for line in lines if plain in line], lines  # not for a model without
    assert f"nv_inference_request_summary_us_count{{{plain}}} 1" in text
    assert f"nv_inference_request_summary_us_count{{{cached}}}" not in text
    assert f"nv_inference_queue_summary_us_count{{{cached}}} 4" in text  # hits count there
    assert f"nv_inference_compute_infer_summary_us_count{{{cached}}} 2" in text


def test_the_default_page_has_duration_counters_and_no_summaries(tmp_path, shm_prefix) -> None:
    write_model(tmp_path / "repo", "sleeper", SLEEPER_PY)
    with serving(tmp_path / "repo", shm_prefix) as server:
        infer(server.model("sleeper"), {"IN": np.array([2], np.float32)})
        text = metrics_text(server)
    assert "_summary_us" not in text
    line = _lines(text, "nv_inference_compute_infer_duration_us{")[0]
    assert int(line.split(" ")[1]) >= 2_000  # whole microseconds, as Triton prints them
    assert "# HELP nv_inference_count Number of inferences performed (does not include " \
           "cached requests)" in text
    # Failures follow the successes, their reasons in Triton's order.
    assert [line.split("reason=")[1][:9] for line in text.splitlines()
            if line.startswith("nv_inference_request_failure{")] == [
        '"OTHER",v', '"BACKEND"', '"CANCELED', '"REJECTED']


def test_summaries_go_on_over_a_reload_and_restart_after_an_unload(tmp_path, shm_prefix) -> None:
    # As the counters (and Triton's summaries, which live in the same reporter): a reload
    # that replaces the runtime does not restart them; an unload does.
    mdir = write_model(tmp_path / "repo", "sleeper", SLEEPER_PY)
    config = MetricsConfig.parse(["summary_latencies=true"])
    count = 'nv_inference_compute_infer_summary_us_count{model="sleeper",version="1"} '
    with serving(tmp_path / "repo", shm_prefix, metrics_config=config,
                 model_control_mode="explicit", load_models=["sleeper"]) as server:
        for _ in range(2):
            infer(server.model("sleeper"), {"IN": np.array([1], np.float32)})
        old = server.runtime("sleeper", 1)
        (mdir / "1" / "model.py").write_text(SLEEPER_PY + "\n# changed\n")
        server.load("sleeper")
        assert server.runtime("sleeper", 1) is not old  # a real reload
        infer(server.model("sleeper"), {"IN": np.array([1], np.float32)})
        assert count + "3" in metrics_text(server)
        server.unload("sleeper")
        assert count not in metrics_text(server)
        server.load("sleeper")
        assert count + "0" in metrics_text(server)
