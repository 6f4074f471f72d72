"""PCM → response bytes: streaming encoders for wav, pcm, flac, mp3 and opus (docs/server.md#formats).

An encoder turns each engine chunk (float32, 24 kHz mono) into the next bytes of one file, so the
concatenated output of `encode(...)` calls is a complete file. When the whole audio arrives as one
final chunk (stream=false) the headers carry exact lengths; otherwise wav says "unknown length"
(0xFFFFFFFF, as OpenAI's streamed wav does) and flac is held back until the end (see FlacEncoder).
"""

from __future__ import annotations

import enum
import io
import struct

import numpy as np
import soundfile as sf

from cosystream.outputs import SAMPLE_RATE

SAMPLE_WIDTH_BYTES = 2  # every format here carries 16-bit samples (pcm, wav, flac) or compresses them
UNKNOWN_SIZE = 0xFFFFFFFF  # RIFF/data size of a wav whose length is not known yet
OPUS_PAGE_LATENCY_MS = 60.0  # libsndfile's default is ~1 s of audio per Ogg page: a whole chunk held back
MP3_COMPRESSION_LEVEL = 0.5  # libsndfile scale 0 (best) .. 1 (smallest); 0.5 ≈ 80 kbit/s CBR at 24 kHz
_SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302  # sndfile.h; soundfile does not wrap this command


class AudioFormat(str, enum.Enum):
    wav = "wav"
    pcm = "pcm"  # raw 16-bit little-endian mono, OpenAI's "pcm"
    flac = "flac"
    mp3 = "mp3"
    opus = "opus"  # Opus in Ogg


MEDIA_TYPES = {
    AudioFormat.wav: "audio/wav",
    AudioFormat.pcm: "audio/pcm",
    AudioFormat.flac: "audio/flac",
    AudioFormat.mp3: "audio/mpeg",
    AudioFormat.opus: "audio/ogg",
}


def to_int16(pcm: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] → int16 little-endian (clipped: the vocoder may overshoot slightly)."""
    return (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2")


def wav_header(num_samples: int | None, sample_rate: int = SAMPLE_RATE) -> bytes:
    """44-byte PCM16 mono RIFF header; num_samples None → the streaming 'unknown length' sizes."""
    if num_samples is None:
        riff_size = data_size = UNKNOWN_SIZE
    else:
        data_size = num_samples * SAMPLE_WIDTH_BYTES
        riff_size = 36 + data_size
    byte_rate = sample_rate * SAMPLE_WIDTH_BYTES
    return (b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, byte_rate, SAMPLE_WIDTH_BYTES, 16)
            + b"data" + struct.pack("<I", data_size))


class AudioEncoder:
    """Base: `encode(pcm, is_final)` returns the bytes to send now; after is_final it must not be called."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self.sample_rate = sample_rate
        self.num_calls = 0

    def encode(self, pcm: np.ndarray, is_final: bool) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        """Release what an unfinished stream holds (the request was cancelled)."""


class PcmEncoder(AudioEncoder):
    def encode(self, pcm: np.ndarray, is_final: bool) -> bytes:
        self.num_calls += 1
        return to_int16(pcm).tobytes()


class WavEncoder(AudioEncoder):
    def encode(self, pcm: np.ndarray, is_final: bool) -> bytes:
        body = to_int16(pcm).tobytes()
        self.num_calls += 1
        if self.num_calls > 1:
            return body
        # one final chunk = the complete audio: exact sizes; otherwise the streaming header
        length = pcm.shape[0] if is_final else None
        return wav_header(length, self.sample_rate) + body


class _Sink:
    """A seekable write-only file for libsndfile whose bytes can be taken away as they are written.

    Encoders write forward and, on close, seek back to patch headers (FLAC STREAMINFO, the MP3
    Info frame). Bytes already sent cannot be patched: those writes are dropped, which leaves the
    header's "unknown" values (valid for streams). Pending bytes are patched in place.
    """

    def __init__(self) -> None:
        self.pos = 0
        self.size = 0
        self.sent = 0
        self.pending = bytearray()

    def write(self, data: bytes) -> int:
        data = bytes(data)
        start, num_bytes = self.pos, len(data)
        if start < self.sent:  # patch of bytes already on the wire
            data, start = data[self.sent - start:], self.sent
        offset = start - self.sent
        if offset + len(data) > len(self.pending):
            self.pending.extend(bytes(offset + len(data) - len(self.pending)))
        self.pending[offset:offset + len(data)] = data
        self.pos += num_bytes
        self.size = max(self.size, self.pos)
        return num_bytes

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, size: int = -1) -> bytes:
        return b""  # write-only: libsndfile never needs to read back what it encoded here

    def take(self) -> bytes:
        out = bytes(self.pending)
        self.sent += len(out)
        self.pending = bytearray()
        return out


class SoundfileEncoder(AudioEncoder):
    """mp3 (CBR) and opus through libsndfile, bytes handed out as soon as libsndfile writes them."""

    _FORMATS = {AudioFormat.mp3: ("MP3", "MPEG_LAYER_III"), AudioFormat.opus: ("OGG", "OPUS")}

    def __init__(self, fmt: AudioFormat, sample_rate: int = SAMPLE_RATE) -> None:
        super().__init__(sample_rate)
        self.fmt = fmt
        self._sink = _Sink()
        container, subtype = self._FORMATS[fmt]
        extra = {}
        if fmt == AudioFormat.mp3:
            # VBR writes a Xing placeholder that decoders trust when it is never patched; CBR is safe
            extra = {"bitrate_mode": "CONSTANT", "compression_level": MP3_COMPRESSION_LEVEL}
        self._file = sf.SoundFile(self._sink, mode="w", samplerate=sample_rate, channels=1,
                                  format=container, subtype=subtype, **extra)
        if fmt == AudioFormat.opus:
            latency = sf._ffi.new("double*", OPUS_PAGE_LATENCY_MS)
            sf._snd.sf_command(self._file._file, _SFC_SET_OGG_PAGE_LATENCY_MS, latency, sf._ffi.sizeof("double"))

    def encode(self, pcm: np.ndarray, is_final: bool) -> bytes:
        self.num_calls += 1
        if pcm.shape[0]:
            self._file.write(np.ascontiguousarray(pcm, dtype=np.float32))
        if is_final:
            self._file.close()
        return self._sink.take()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class FlacEncoder(AudioEncoder):
    """FLAC held until the audio is complete, then sent as one file with an exact STREAMINFO.

    A streamed FLAC must leave total_samples unknown (0); that is valid FLAC, but libsndfile (and so
    soundfile) cannot read such a stream to its end, so exact files are the safer default.
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        super().__init__(sample_rate)
        self._parts: list[np.ndarray] = []

    def encode(self, pcm: np.ndarray, is_final: bool) -> bytes:
        self.num_calls += 1
        self._parts.append(np.asarray(pcm, dtype=np.float32))
        if not is_final:
            return b""
        out = io.BytesIO()
        sf.write(out, np.concatenate(self._parts), self.sample_rate, format="FLAC", subtype="PCM_16")
        self._parts = []
        return out.getvalue()


def build_encoder(fmt: AudioFormat | str, sample_rate: int = SAMPLE_RATE) -> AudioEncoder:
    fmt = AudioFormat(fmt)
    if fmt == AudioFormat.pcm:
        return PcmEncoder(sample_rate)
    if fmt == AudioFormat.wav:
        return WavEncoder(sample_rate)
    if fmt == AudioFormat.flac:
        return FlacEncoder(sample_rate)
    return SoundfileEncoder(fmt, sample_rate)
