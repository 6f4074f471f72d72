"""A fault inside the real engine reaches the client as a clear error; the server stays ready and serves on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_live import SAMPLES_PER_TOKEN, VOICE, Live, decode

from cosystream.engine.accounting import take_accounts

BAD_TEXT = "this request meets a broken model."


@pytest.fixture
def nan_audio_for_bad_text(live: Live) -> Iterator[None]:
    """NaN in the flow output of the requests whose text is BAD_TEXT (the others are left alone)."""
    t2w = live.engine.token2wav
    real_flow = t2w._flow
    bad_ids = set()
    real_build = live.engine._build_request

    def build(params, emit):
        req = real_build(params, emit)
        if params.text == BAD_TEXT:
            bad_ids.add(req.request_id)
        return req

    def flow_with_nan(jobs):
        mels = real_flow(jobs)
        return [m * float("nan") if st.key[0] in bad_ids else m for (st, _, _), m in zip(jobs, mels, strict=True)]

    t2w._flow, live.engine._build_request = flow_with_nan, build
    yield
    t2w._flow, live.engine._build_request = real_flow, real_build


def test_non_finite_audio_is_a_500_naming_the_cause(live, client, nan_audio_for_bad_text):
    response = client.post("/v1/tts", json={"text": BAD_TEXT, "voice": VOICE, "force_tokens": 20,
                                            "response_format": "pcm"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "non_finite_output" and "NaN or infinite" in error["message"]
    assert client.get("/ready").status_code == 200
    ok = client.post("/v1/tts", json={"text": "a healthy request.", "voice": VOICE, "force_tokens": 20,
                                      "response_format": "pcm"})
    assert decode(ok.content, "pcm").shape == (20 * SAMPLES_PER_TOKEN,)
    assert take_accounts(live.engine).is_idle
