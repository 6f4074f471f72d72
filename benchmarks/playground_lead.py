"""The playground's own buffering, measured in headless Chromium against a running server: for each run the
page's time from the first PCM bytes arriving to their scheduled playback (its lead), the browser's first
audio, and the server's; optionally screenshots of the page at laptop and phone width.

    cosystream serve --model-dir MODEL --port 8000 &
    python benchmarks/playground_lead.py --url http://127.0.0.1:8000 --voice alice --runs 10 \\
        [--prompt-wav anna.wav --prompt-text "..."]  [--force-tokens 60 --first-hop 10]  [--screenshots docs/img]

Needs chromium and chromium-driver from the system's packages, and selenium (cosystream/testing/browser.py).
The voice is registered from --prompt-wav when the server does not know it yet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cosystream.testing.browser import chromium, missing_browser

LAPTOP = (1366, 860)
PHONE = (390, 844)


def ensure_voice(url: str, voice: str, prompt_wav: str | None, prompt_text: str) -> None:
    if httpx.get(f"{url}/v1/voices/{voice}").status_code == 200:
        return
    if prompt_wav is None:
        sys.exit(f"voice {voice!r} is not registered: pass --prompt-wav to register it")
    with open(prompt_wav, "rb") as recording:
        response = httpx.post(f"{url}/v1/voices", data={"name": voice, "prompt_text": prompt_text},
                              files={"prompt_wav": (Path(prompt_wav).name, recording)}, timeout=120)
    response.raise_for_status()


def wait_for(driver: Any, script: str, timeout_s: float = 300) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(script)


def speak_once(driver: Any, url: str, fields: dict[str, str]) -> dict:
    """Open the page, fill the form, press Speak, and return window.playground once playback ended."""
    driver.get(url + "/")
    wait_for(driver, "return window.playground.server === 'ready' && window.playground.voices.length > 0")
    for element_id, value in fields.items():
        driver.execute_script("const el = document.getElementById(arguments[0]); el.value = arguments[1];"
                              "el.dispatchEvent(new Event('change'))", element_id, value)
    driver.find_element("id", "speak-btn").click()
    return wait_for(driver, "const s = window.playground; return (s.status === 'finished' || s.status === 'error')"
                            " ? s : null")


def screenshot(driver: Any, path: Path, size: tuple[int, int], mobile: bool) -> None:
    """The whole page at this viewport width (device scale 1: small files for the docs)."""
    width, height = size
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
    time.sleep(0.3)  # the layout and the waveform's redraw after the resize
    full_height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": max(height, full_height), "deviceScaleFactor": 1,
                            "mobile": mobile})
    time.sleep(0.3)
    path.write_bytes(driver.get_screenshot_as_png())
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def summary(values: list[float]) -> str:
    return (f"median {statistics.median(values):7.1f}  min {min(values):7.1f}  max {max(values):7.1f}"
            if values else "n/a")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--voice", default="alice")
    parser.add_argument("--prompt-wav", default=None)
    parser.add_argument("--prompt-text", default="")
    parser.add_argument("--text", default="Hello! This is cosystream, speaking as soon as the first chunk is ready.")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--force-tokens", type=int, default=None, help="fixed reply length (speech tokens)")
    parser.add_argument("--first-hop", type=int, default=None, help="speech tokens in the first chunk")
    parser.add_argument("--screenshots", type=Path, default=None, help="write playground-laptop/phone.png here")
    parser.add_argument("--json", type=Path, default=None, help="write every run's page state here")
    args = parser.parse_args()
    reason = missing_browser()
    if reason is not None:
        sys.exit(reason)
    url = args.url.rstrip("/")
    ensure_voice(url, args.voice, args.prompt_wav, args.prompt_text)
    fields = {"text": args.text, "voice": args.voice, "seed": str(args.seed)}
    if args.force_tokens is not None:
        fields["force-tokens"] = str(args.force_tokens)
    if args.first_hop is not None:
        fields["first-hop"] = str(args.first_hop)

    runs = []
    with chromium(width=LAPTOP[0], height=LAPTOP[1]) as driver:
        for index in range(args.runs):
            state = speak_once(driver, url, fields)
            runs.append(state)
            if state["status"] == "error":
                print(f"run {index}: error {state['error']}")
                continue
            parts = state["leadParts"]
            print(f"run {index}: lead {state['leadMs']:6.1f} ms (margin {parts['marginMs']:.0f}, output latency "
                  f"{parts['outputLatencyMs']:.1f}, handling {parts['processingMs']:.1f}), browser first audio "
                  f"{state['firstAudioMs']:7.1f} ms, server first audio "
                  f"{1000 * state['done']['server_first_audio_s']:7.1f} ms, chunks {state['chunks']}, "
                  f"underruns {len(state['underruns'])}")
        if args.screenshots is not None:
            args.screenshots.mkdir(parents=True, exist_ok=True)
            screenshot(driver, args.screenshots / "playground-laptop.png", LAPTOP, mobile=False)
            screenshot(driver, args.screenshots / "playground-phone.png", PHONE, mobile=True)
    ok = [r for r in runs if r["status"] == "finished"]
    print(f"\n{len(ok)}/{len(runs)} runs finished")
    print(f"page lead (first PCM bytes -> scheduled playback), ms: {summary([r['leadMs'] for r in ok])}")
    print(f"  of which output latency the browser reports, ms:  "
          f"{summary([r['leadParts']['outputLatencyMs'] for r in ok])}")
    print(f"browser first audio (Speak -> first PCM bytes), ms: {summary([r['firstAudioMs'] for r in ok])}")
    print(f"server first audio (arrival -> first bytes sent), ms: "
          f"{summary([1000 * r['done']['server_first_audio_s'] for r in ok])}")
    print(f"underruns: {sum(len(r['underruns']) for r in ok)} in {len(ok)} runs")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
