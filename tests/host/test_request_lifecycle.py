"""A request's end: exactly one final answer, and a cancel or timeout is that answer even when
the model, told of it, stops early and answers at once."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from tritonpy._errors import CancelledError, UnavailableError
from tritonpy._request import HostRequest


def _request(got: list[tuple[Any, Any, bool]]) -> HostRequest:
    def sink(req: HostRequest, outputs: Any, error: Any, parameters: Any, final: bool) -> None:
        got.append((outputs, error, final))

    return HostRequest(SimpleNamespace(name="m", version=1), [], None, sink)


def _answers_at_once(req: HostRequest, error: Any) -> None:
    # Stands in for the host telling the stub: a model that polls is_cancelled() returns early
    # with a normal response, which can reach the host before the cancelling thread goes on.
    req.respond([("OUT", np.ones(1, np.float32))], None, None, True)


def test_cancel_is_the_answer_even_if_the_model_answers_on_seeing_it() -> None:
    got: list = []
    req = _request(got)
    req.on_cancel = _answers_at_once
    req.cancel("the client went away")
    assert len(got) == 1
    outputs, error, final = got[0]
    assert isinstance(error, CancelledError) and "the client went away" in error.message
    assert final and req.done and req.cancelled


def test_timeout_is_the_answer_even_if_the_model_answers_on_seeing_it() -> None:
    got: list = []
    req = _request(got)
    req.on_cancel = _answers_at_once
    req.abort(UnavailableError("Request timeout expired"))
    assert [e.message for _, e, _ in got] == ["Request timeout expired"]


def test_one_final_answer_only() -> None:
    got: list = []
    req = _request(got)
    req.respond([("OUT", np.zeros(1))], None, None, False)  # a decoupled partial
    req.respond([("OUT", np.ones(1))], None, None, True)
    req.fail(UnavailableError("too late"))
    req.cancel()
    assert [final for _, _, final in got] == [False, True]
    assert all(error is None for _, error, _ in got)
