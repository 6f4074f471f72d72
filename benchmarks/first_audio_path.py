"""Where a request's first audio waits: the stage medians of `bench_engine.py` result files, level by level, with
the token-to-wave worker's own record of the same level (the engine stats the file holds before and after it).

    python3 benchmarks/first_audio_path.py out/zs_distinct.json [out/zs_registered.json ...]   # .json or .json.gz

Per level, from the requests' server stage times (medians, ms from submission):
  analysis (the frontend: a new recording's speech tokens, x-vector and mel; of it the recording's own part:
  decoding, analysis and transcript, and of that its batched analysis with the wait for its batch, where the
  files have them), LM start (analysis + queue), first
  token, first chunk's tokens ready, first chunk handed to the worker, the wait between the two, the first
  chunk's flow and vocoder, first audio.
From the engine stats (the level's difference):
  - the worker's ODE calls by shape (streams x new frames): calls and GPU ms per call; a new voice's prompt pass
    is one of them (its prompt frames up to the last chunk boundary), beside the chunks' calls;
  - "open in flight": decode-step periods that passed while a batch that only opened streams (new voices'
    prompt passes, run ahead of the first chunk) was on the worker, per prompt pass built. It counts only time
    the LM decoded meanwhile, so it is a lower bound of how long the first chunk could not start because of it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
from pathlib import Path

_STAGES = (("analysis", "frontend_s"), ("recording", "prompt_s"), ("batched analysis", "prompt_analysis_s"),
           ("LM start", None), ("first token", None),
           ("tokens ready", "first_chunk_ready_s"), ("to the worker", "first_chunk_start_s"), ("waited", None),
           ("flow", "first_chunk_flow_s"), ("vocoder", "first_chunk_vocoder_s"), ("first audio", "first_audio_s"))
_ODE_CALLS = re.compile(r"^token2wav_calls_ode_(\d+)x(\d+)$")


def load(path: Path) -> dict:
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def request_stages(server: dict) -> dict[str, float]:
    """One request's first-audio path in seconds from its submission (the `server` record of a request)."""
    lm_start = server["frontend_s"] + server.get("queue_s", 0.0)
    out = {name: server[key] for name, key in _STAGES if key is not None and key in server}
    out["LM start"] = lm_start
    out["first token"] = lm_start + server.get("first_token_s", 0.0)
    if "first_chunk_start_s" in server and "first_chunk_ready_s" in server:
        out["waited"] = server["first_chunk_start_s"] - server["first_chunk_ready_s"]
    return out


def stage_medians(requests: list[dict]) -> dict[str, float]:
    per_request = [request_stages(r["server"]) for r in requests if r.get("server")]
    names = [name for name, _ in _STAGES]
    return {name: statistics.median(s[name] for s in per_request if name in s)
            for name in names if any(name in s for s in per_request)}


def level_stats(doc: dict) -> dict[str, dict[str, float]]:
    """The engine stats' change over each level (snapshots are taken after each level, labelled by its summary
    line, which starts with the level's name followed by a colon)."""
    snaps = doc.get("meta", {}).get("engine_stats", [])
    out: dict[str, dict[str, float]] = {}
    for before, after in zip(snaps, snaps[1:], strict=False):
        level = after["after"].split(":", 1)[0]
        out[level] = {k: v - before["stats"].get(k, 0.0) for k, v in after["stats"].items()}
    return out


def worker_lines(stats: dict[str, float]) -> list[str]:
    lines = []
    odes = []
    for key, calls in stats.items():
        match = _ODE_CALLS.match(key)
        if match and calls > 0:
            seconds = stats.get(key + "_seconds", 0.0)
            odes.append((int(match.group(1)), int(match.group(2)), int(calls), 1000 * seconds / calls))
    if odes:
        lines.append("  ODE calls (streams x new frames: calls, GPU ms each): " + ", ".join(
            f"{rows}x{frames}: {calls}, {ms:.1f}" for rows, frames, calls, ms in sorted(odes)))
    built = stats.get("flow_prompts_built", 0.0)
    beside_open = stats.get("decode_step_seconds_beside_open", 0.0)
    if built > 0:
        lines.append(f"  prompt passes: {built:.0f} built in {stats.get('flow_prompt_build_calls', 0.0):.0f} calls; "
                     f"open in flight {1000 * beside_open / built:.1f} ms per pass (decode-step periods, a lower "
                     f"bound), while the LM decoded {stats.get('decode_steps_beside_open', 0.0) / built:.0f} steps")
    analysed = stats.get("prompt_analysis_prompts", 0.0)
    if analysed > 0:
        lines.append(f"  prompt analysis: {analysed:.0f} recordings in "
                     f"{stats.get('prompt_analysis_batches', 0.0):.0f} batches")
    return lines


def report(path: Path) -> list[str]:
    doc = load(path)
    meta = doc.get("meta", {})
    lines = [f"{path} (commit {meta.get('commit', '?')}, {meta.get('device', '?')})"]
    names = [name for name, _ in _STAGES]
    lines.append("| level | requests | " + " | ".join(names) + " |")
    lines.append("|---" * (len(names) + 2) + "|")
    by_level: dict[str, list[dict]] = {}
    for r in doc.get("requests", []):
        if r.get("level") != "warmup" and r.get("error") is None:
            by_level.setdefault(r["level"], []).append(r)
    stats = level_stats(doc)
    details = []
    for level, requests in by_level.items():
        medians = stage_medians(requests)
        cells = [f"{1000 * medians[n]:.1f}" if n in medians else "-" for n in names]
        lines.append(f"| {level} | {len(requests)} | " + " | ".join(cells) + " |")
        if level in stats:
            details += [f"{level}:"] + worker_lines(stats[level])
    return lines + details


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.files:
        print("\n".join(report(path)))
        print()


if __name__ == "__main__":
    main()
