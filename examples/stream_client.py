"""Stream /v1/tts as events: play-as-you-go audio plus the server's per-stage timings at the end.

    python examples/stream_client.py --voice alice --text "Hello there." --out hello.wav
"""

import argparse
import base64
import json

import httpx

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://localhost:8000")
parser.add_argument("--voice", default="alice")
parser.add_argument("--text", default="Hello there. This is a streamed reply.")
parser.add_argument("--out", default="hello.wav")
args = parser.parse_args()

body = {"text": args.text, "voice": args.voice, "response_format": "wav", "seed": 42}
with open(args.out, "wb") as out, httpx.stream("POST", args.base_url + "/v1/tts?events=ndjson", json=body,
                                              timeout=120) as response:
    response.raise_for_status()
    for line in response.iter_lines():
        event = json.loads(line)
        if event["type"] == "audio":  # the next bytes of the wav file: write (or play) them now
            out.write(base64.b64decode(event["audio"]))
            print(f"chunk {event['index']}: {event['num_samples']} samples at {event['elapsed_s']:.3f} s")
        elif event["type"] == "done":
            times = event["times"]
            print(f"first audio {times['first_audio_s']:.3f} s, total {times['total_s']:.3f} s, "
                  f"audio {event['audio_s']:.2f} s, rtf {times['rtf']}")
        else:  # "error": the stream failed after it started
            raise SystemExit(f"error: {event['error']}")
print("wrote", args.out)
