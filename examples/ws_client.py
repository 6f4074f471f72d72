"""Feed text to /v1/tts/stream piece by piece (as an LLM would) and save the audio as it arrives.

    python examples/ws_client.py --voice alice --out reply.wav
    python examples/ws_client.py --prompt-wav anna.wav --prompt-text "what anna says in it" --out reply.wav
"""

import argparse
import asyncio
import json
import wave

import websockets

parser = argparse.ArgumentParser()
parser.add_argument("--base-url", default="ws://localhost:8000")
parser.add_argument("--voice", default="alice")
parser.add_argument("--prompt-wav", default=None, help="zero-shot: this recording instead of --voice")
parser.add_argument("--prompt-text", default="", help="the transcript of --prompt-wav")
parser.add_argument("--out", default="reply.wav")
args = parser.parse_args()

LLM_PIECES = ["Sure! ", "Here is ", "a short answer, ", "spoken while ", "it is being written."]


async def send_text(ws) -> None:
    if args.prompt_wav:  # the recording follows `start` as one binary frame
        start = {"type": "start", "prompt_wav": True, "prompt_text": args.prompt_text, "response_format": "pcm"}
        await ws.send(json.dumps(start))
        with open(args.prompt_wav, "rb") as recording:
            await ws.send(recording.read())
    else:
        await ws.send(json.dumps({"type": "start", "voice": args.voice, "response_format": "pcm"}))
    for piece in LLM_PIECES:
        await ws.send(json.dumps({"type": "text", "text": piece}))
        await asyncio.sleep(0.05)  # stand-in for the LLM's token rate
    await ws.send(json.dumps({"type": "end"}))


async def main() -> None:
    async with websockets.connect(args.base_url + "/v1/tts/stream") as ws:
        sender = asyncio.create_task(send_text(ws))
        with wave.open(args.out, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)  # pcm: 16-bit little-endian mono
            out.setframerate(24000)
            async for message in ws:  # ends when the server closes after "done" or "error"
                if isinstance(message, bytes):
                    out.writeframes(message)
                    continue
                event = json.loads(message)
                if event["type"] == "done":
                    print(f"done: {event['audio_s']:.2f} s of audio, first audio after "
                          f"{event['times']['first_audio_s']:.3f} s")
                elif event["type"] == "error":
                    raise SystemExit(f"error: {event['error']}")
        await sender
    print("wrote", args.out)


asyncio.run(main())
