"""Speak through cosystream with the unmodified OpenAI SDK, streaming the audio into a file.

    python examples/openai_client.py --voice alice --text "Hello from cosystream." --out hello.mp3
"""

import argparse

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="http://localhost:8000")
parser.add_argument("--voice", default="alice")
parser.add_argument("--text", default="Hello from cosystream.")
parser.add_argument("--out", default="hello.mp3")
args = parser.parse_args()

client = OpenAI(base_url=args.base_url + "/v1", api_key="not-needed")
with client.audio.speech.with_streaming_response.create(
    model="cosyvoice2",  # accepted and ignored: the server runs one model
    voice=args.voice,  # a voice registered with POST /v1/voices
    input=args.text,
    response_format=args.out.rsplit(".", 1)[-1],  # mp3, opus, wav, flac or pcm
) as response:
    print("request id:", response.headers["x-request-id"])
    response.stream_to_file(args.out)  # bytes are written as each chunk arrives
print("wrote", args.out)
