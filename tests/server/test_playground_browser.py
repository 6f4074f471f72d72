"""The playground in a real browser: headless Chromium (the system's package) against the live server on the
CPU fixture model. The tests click and type as a person would and read what the page exposes in
`window.playground`, then check it against the server's own records.

Without Chromium, chromedriver or selenium these tests skip with the reason, except under CI=true, where
they fail: CI installs the browser (.ci/run) and must run them. Each test leaves a screenshot of the page
in its tmp dir (also on failure).

Requests fix their length with `force_tokens` (N speech tokens = 960·N samples) and cut the first chunk
short with `first_hop`, so every reply has several chunks whatever the model's sampling does.
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
from server_live import SAMPLES_PER_TOKEN, VOICE, Live, make_wav, run_server

from cosystream.server.app import build_app
from cosystream.server.state import ServerSettings
from cosystream.testing.browser import chromium, missing_browser

# the browser fixture first: without Chromium the tests skip before the live server loads the model
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.usefixtures("driver")]  # a live server + Chromium

SAMPLE_RATE = 24000
FIRST_HOP = 5  # speech tokens in the first chunk: a short first chunk, so later chunks follow it
TOKENS = 30  # a reply of 1.2 s in several chunks
WAIT_S = 120  # the fixture model is small, but a CI machine may be slow and busy
STAGES = ("queue_s", "frontend_s", "llm_prefill_s", "first_token_s", "first_chunk_ready_s", "first_chunk_flow_s",
          "first_chunk_vocoder_s", "first_audio_s", "total_s")


# Records every binary WebSocket frame as it arrives, before the page's own code sees it: what the server
# sent, captured independently of the page's player and wav writer.
WIRE_TAP = """
window.__wireFrames = [];
window.WebSocket = class extends window.WebSocket {
  constructor(...args) {
    super(...args);
    this.addEventListener("message", (event) => {
      if (typeof event.data === "string") return;
      const bytes = new Uint8Array(event.data);
      let text = "";
      for (let i = 0; i < bytes.length; i += 8192) text += String.fromCharCode(...bytes.subarray(i, i + 8192));
      window.__wireFrames.push(btoa(text));
    });
  }
};
"""


@pytest.fixture(scope="session")
def driver() -> Iterator[Any]:
    reason = missing_browser()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI runs the browser tests; .ci/run installs them)")
        pytest.skip(reason)
    with chromium() as browser:
        browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": WIRE_TAP})
        yield browser


def wire_pcm(page: Page) -> np.ndarray:
    """The 16-bit samples of every binary frame the page's WebSockets received since it was opened."""
    frames = page.driver.execute_script("return window.__wireFrames")
    return np.frombuffer(b"".join(base64.b64decode(frame) for frame in frames), dtype="<i2")


class Page:
    """The playground open in the browser."""

    def __init__(self, driver: Any, base_url: str) -> None:
        self.driver = driver
        self.base_url = base_url

    def open(self) -> Page:
        self.driver.get(self.base_url + "/")
        return self

    def state(self) -> dict:
        return self.driver.execute_script("return window.playground")

    def wait(self, condition: Callable[[dict], bool], what: str, timeout_s: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.state()
            if condition(state):
                return state
            assert time.monotonic() < deadline, f"page never reached: {what}; last state {json.dumps(state)[:2000]}"
            time.sleep(0.05)

    def wait_loaded(self) -> dict:
        return self.wait(lambda s: s["server"] == "ready" and any(v["name"] == VOICE for v in s["voices"]),
                         "server ready and voices listed")

    def element(self, element_id: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def click(self, element_id: str) -> None:
        self.element(element_id).click()

    def fill(self, **values: Any) -> None:
        """Set inputs by id (the way a paste would: value, then an input event)."""
        for element_id, value in values.items():
            self.driver.execute_script(
                "const el = document.getElementById(arguments[0]); el.value = arguments[1];"
                "el.dispatchEvent(new Event('input', {bubbles: true}));"
                "el.dispatchEvent(new Event('change', {bubbles: true}));", element_id.replace("_", "-"), str(value))

    def text(self, selector: str) -> str:
        return self.driver.execute_script("return document.querySelector(arguments[0]).textContent", selector)


@pytest.fixture
def page(driver: Any, live: Live, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Page]:
    page = Page(driver, live.base_url).open()
    page.wait_loaded()
    yield page
    driver.save_screenshot(str(tmp_path / f"{request.node.name}.png"))


def assert_gap_free(state: dict) -> None:
    """Each chunk starts where the previous one ends on the audio clock, unless it came late: then the gap
    is the underrun the page recorded at that point of the audio."""
    schedule, underruns = state["schedule"], {round(u["atS"], 6): u["gapMs"] for u in state["underruns"]}
    assert len(schedule) == state["chunks"]
    for previous, chunk in zip(schedule, schedule[1:], strict=False):
        end = previous["ctxStart"] + previous["duration"]
        assert chunk["audioStart"] == pytest.approx(previous["audioStart"] + previous["duration"], abs=1e-9)
        gap_ms = (chunk["ctxStart"] - end) * 1000
        if round(chunk["audioStart"], 6) in underruns:
            assert gap_ms > 0 and underruns[round(chunk["audioStart"], 6)] == pytest.approx(gap_ms, abs=1e-6)
        else:
            assert gap_ms == pytest.approx(0, abs=1e-9)
    assert len(underruns) == len(state["underruns"])


def test_speaking_plays_from_the_first_chunk_and_ends_with_stage_times(page: Page, live: Live, tmp_path: Path):
    text = "Hello from the browser."
    page.fill(text=text, seed=7, first_hop=FIRST_HOP, force_tokens=TOKENS)
    page.click("speak-btn")
    first = page.wait(lambda s: s["chunks"] >= 1, "the first chunk")
    assert first["scheduledSeconds"] > 0 and first["firstAudioMs"] > 0 and first["leadMs"] > 0
    state = page.wait(lambda s: s["done"] is not None and s["status"] in ("playing", "finished"), "the done event")
    done = state["done"]
    assert state["error"] is None and state["requestId"] == done["request_id"]
    assert done["num_samples"] == TOKENS * SAMPLES_PER_TOKEN and done["num_chunks"] > 1
    # playback began while the request was still running: the first chunk was on the audio clock before done
    assert state["firstScheduledAt"] < state["doneAt"]
    assert state["chunks"] == done["num_chunks"] and state["chunkEvents"] == done["num_chunks"]
    assert state["scheduledSeconds"] == pytest.approx(done["num_samples"] / SAMPLE_RATE)
    assert state["waveSamples"] == done["num_samples"]
    assert_gap_free(state)
    times = done["times"]
    assert all(times[key] >= 0 for key in STAGES) and 0 < times["first_audio_s"] <= times["total_s"]
    assert 0 < done["server_first_audio_s"] < state["firstAudioMs"] / 1000  # the browser saw it later
    stages = page.text("#stages")
    assert "Engine first audio" in stages and "Server first audio" in stages
    record = live.client().get(f"/v1/requests/{done['request_id']}").json()
    assert record["outcome"] == "ok" and record["endpoint"] == "ws"

    page.driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(tmp_path)})
    page.click("download-btn")
    wav_path = tmp_path / f"{done['request_id']}.wav"
    deadline = time.monotonic() + 10
    while not wav_path.is_file():
        assert time.monotonic() < deadline, "no wav downloaded"
        time.sleep(0.05)
    info = sf.info(str(wav_path))
    assert (info.samplerate, info.channels, info.frames) == (SAMPLE_RATE, 1, done["num_samples"])
    samples, _ = sf.read(str(wav_path), dtype="int16")
    np.testing.assert_array_equal(samples, wire_pcm(page))  # the download holds exactly what came in


def test_stop_cancels_the_request_on_the_server(page: Page, live: Live):
    long_reply = 2000  # 80 s of audio: far longer than the test waits
    page.fill(text="This sentence would take a long time to finish.", first_hop=FIRST_HOP, force_tokens=long_reply)
    page.click("speak-btn")
    state = page.wait(lambda s: s["chunks"] >= 1 and s["requestId"] is not None, "the first chunk")
    request_id = state["requestId"]
    page.click("stop-btn")
    state = page.wait(lambda s: s["serverOutcome"] is not None, "the server's record of the stopped request")
    assert state["status"] == "stopped" and state["serverOutcome"] == "cancelled" and state["done"] is None
    record = live.state.finished.get(request_id)
    assert record is not None and record.outcome == "cancelled"
    assert record.audio_s < long_reply * SAMPLES_PER_TOKEN / SAMPLE_RATE
    deadline = time.monotonic() + 10
    while not live.engine_idle():  # the engine dropped the request, not just the connection
        assert time.monotonic() < deadline, "the engine still holds the stopped request"
        time.sleep(0.05)
    chunks = page.state()["chunks"]
    time.sleep(0.3)
    assert page.state()["chunks"] == chunks
    assert "cancelled" in page.text("#speak-status")


def test_uploading_a_voice_registers_it_and_a_bad_file_shows_the_servers_message(page: Page, live: Live,
                                                                                 tmp_path: Path):
    name = f"upload-{uuid.uuid4().hex[:8]}"
    seconds = 2.5
    recording = tmp_path / "speaker.wav"
    recording.write_bytes(make_wav(seconds=seconds))
    page.fill(voice_name=name, voice_text="Hello there, this is my voice.")
    page.element("voice-file").send_keys(str(recording))
    page.wait(lambda s: s.get("recordingSeconds") is not None, "the recording's duration")
    assert f"{seconds:.1f} s" in page.text("#rec-info")
    page.click("register-btn")
    state = page.wait(lambda s: any(v["name"] == name for v in s["voices"]), "the new voice in the list")
    assert state["voiceError"] is None
    voice = live.client().get(f"/v1/voices/{name}").json()
    assert voice["prompt_text"] == "Hello there, this is my voice."
    assert voice["prompt_seconds"] == pytest.approx(seconds, abs=0.05)
    assert page.driver.execute_script("return document.getElementById('voice').value") == name

    broken = tmp_path / "broken.wav"
    broken.write_bytes(b"RIFF but not really a wav file" * 20)
    page.fill(voice_name=f"{name}-2")
    page.element("voice-file").send_keys(str(broken))
    page.click("register-btn")
    state = page.wait(lambda s: s["voiceError"] is not None, "the server's error")
    error = state["voiceError"]
    assert error["field"] == "prompt_wav" and error["message"].startswith("prompt_wav: ")
    assert page.text('#voice-form .field-error[data-error-for="prompt_wav"]') == error["message"]
    assert live.client().get(f"/v1/voices/{name}-2").status_code == 404

    delete = f'#voice-list li[data-voice="{name}"] button[data-action="delete"]'
    for _ in range(2):  # the second click confirms
        page.driver.execute_script("document.querySelector(arguments[0]).click()", delete)
    page.wait(lambda s: all(v["name"] != name for v in s["voices"]), "the voice gone from the list")
    assert live.client().get(f"/v1/voices/{name}").status_code == 404


def test_live_typing_sends_words_as_they_are_typed_and_produces_audio(page: Page):
    page.click("tab-live")
    page.fill(text="", first_hop=FIRST_HOP, force_tokens=TOKENS)
    page.click("live-btn")
    page.wait(lambda s: s["status"] == "streaming", "the live stream open")
    typed = "Hello there, my friend. How"
    page.element("text").send_keys(typed)
    state = page.wait(lambda s: s["textSent"] == "Hello there, my friend. ", "the finished words sent")
    assert state["piecesSent"] >= 2  # word by word, not in one piece
    page.click("finish-btn")
    state = page.wait(lambda s: s["done"] is not None, "the done event")
    assert state["textSent"] == typed and state["endSent"] and state["error"] is None
    assert state["chunks"] == state["done"]["num_chunks"] >= 1
    assert state["scheduledSeconds"] == pytest.approx(TOKENS * SAMPLES_PER_TOKEN / SAMPLE_RATE)
    assert_gap_free(state)


def test_writing_at_a_token_rate_streams_the_text_and_produces_audio(page: Page):
    source = "Streaming text arrives a few characters at a time, as an LLM writes it."
    page.click("tab-live")
    page.fill(text=source, token_rate=40, first_hop=FIRST_HOP, force_tokens=TOKENS)
    page.click("write-btn")
    state = page.wait(lambda s: s["done"] is not None, "the done event")
    assert state["error"] is None and state["textSent"] == source
    assert state["piecesSent"] >= len(source.split())  # no piece is longer than a word
    assert page.driver.execute_script("return document.getElementById('text').value") == source
    assert state["chunks"] >= 1 and state["scheduledSeconds"] == pytest.approx(
        TOKENS * SAMPLES_PER_TOKEN / SAMPLE_RATE)


def test_a_microphone_recording_registers_a_voice(page: Page, live: Live):
    name = f"mic-{uuid.uuid4().hex[:8]}"
    page.fill(voice_name=name, voice_text="")
    page.click("record-btn")
    page.wait(lambda s: s.get("recordingStarted"), "the recorder started")
    time.sleep(1.5)
    page.click("record-btn")
    state = page.wait(lambda s: s.get("recordingSeconds") is not None, "the recording converted")
    assert 1.0 < state["recordingSeconds"] < 4.0
    page.click("register-btn")
    page.wait(lambda s: any(v["name"] == name for v in s["voices"]), "the recorded voice in the list")
    voice = live.client().get(f"/v1/voices/{name}").json()
    assert voice["prompt_seconds"] == pytest.approx(state["recordingSeconds"], abs=0.05)
    assert live.client().delete(f"/v1/voices/{name}").status_code == 204


def test_with_an_api_key_the_page_asks_for_it_and_sends_it(driver: Any, live: Live, tmp_path: Path):
    key = "sk-browser-test"
    app = build_app(live.engine, ServerSettings(api_keys=frozenset({key}), warmup=False, close_engine=False))
    with run_server(app) as base_url:
        page = Page(driver, base_url).open()
        try:
            page.wait(lambda s: s["needsKey"], "the key prompt")
            assert page.driver.execute_script("return document.getElementById('keybar').hidden") is False
            page.fill(api_key="sk-wrong")
            page.click("key-btn")
            key_error = '#key-form .field-error[data-error-for="Authorization"]'
            page.wait(lambda s: "unknown API key" in page.text(key_error), "the server's refusal next to the key")
            page.fill(api_key=key)
            page.click("key-btn")
            page.wait_loaded()
            assert page.state()["needsKey"] is False
            page.fill(text="With a key.", first_hop=FIRST_HOP, force_tokens=10)
            page.click("speak-btn")
            state = page.wait(lambda s: s["done"] is not None or s["error"] is not None, "the done event")
            assert state["error"] is None and state["chunks"] >= 1
        finally:
            driver.save_screenshot(str(tmp_path / "api_key.png"))
