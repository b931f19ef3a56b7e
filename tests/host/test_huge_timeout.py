"""A request's timeout that is years long (any int64 a client may send) is a timeout like any
other: the server's timer thread, which every other timeout waits on, keeps running. It used
to die on it ("timestamp out of range for platform time_t"), and no later timeout fired."""
from __future__ import annotations

import numpy as np
import pytest
from _models import SLEEPER_PY, serving, write_model

pytestmark = pytest.mark.timeout(60)


def _ms(ms: float) -> dict:
    return {"IN": np.array([ms], np.float32)}


def test_a_huge_timeout_leaves_the_other_timeouts_working(tmp_path, shm_prefix) -> None:
    write_model(tmp_path / "repo", "sleeper", SLEEPER_PY)
    with serving(tmp_path / "repo", shm_prefix) as server:
        model = server.model("sleeper")
        busy = model.infer(_ms(1500))  # holds the one instance
        patient = model.infer(_ms(0), timeout=2**63 - 1)  # queued: µs, hundreds of millennia
        hasty = model.infer(_ms(0), timeout=100_000)  # queued: 100 ms
        late = hasty.get(timeout=20)
        assert late.error is not None and "timeout" in late.error.message.lower(), late
        assert busy.get(timeout=20).error is None
        assert patient.get(timeout=20).error is None  # served once the instance was free


def test_a_request_the_channel_cannot_encode_fails_alone_and_the_model_serves_on(
        tmp_path, shm_prefix) -> None:
    # Values that got past validation and not past the channel: a request id that is not
    # text (JSON's "\ud800"), a timeout past 64 bits. Each fails with the reason; the model
    # kept its one instance busy for ever after a few of them.
    write_model(tmp_path / "repo", "sleeper", SLEEPER_PY)
    with serving(tmp_path / "repo", shm_prefix) as server:
        model = server.model("sleeper")
        for _ in range(4):
            for kwargs in ({"request_id": "bad\ud800"}, {"timeout": 2**64}):
                resp = model.infer(_ms(0), **kwargs).get(timeout=20)
                assert resp.error is not None and "cannot be encoded" in resp.error.message, \
                    resp.error
        resp = model.infer(_ms(0)).get(timeout=20)
        assert resp.error is None, resp.error
