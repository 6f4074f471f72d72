// WAV files assembled in the page: the received audio for download, and microphone recordings
// (MediaRecorder gives webm/opus in Chromium, which the server does not read) converted for upload.

/** A 16-bit mono WAV Blob from Int16Array pieces (the PCM exactly as received). */
export function wavFromInt16(pieces, sampleRate) {
  const numSamples = pieces.reduce((n, p) => n + p.length, 0);
  const header = wavHeader(numSamples, sampleRate);
  return new Blob([header, ...pieces.map((p) => p.buffer.slice(p.byteOffset, p.byteOffset + p.byteLength))],
    { type: "audio/wav" });
}

/** A 16-bit mono WAV Blob from float samples in [-1, 1]. */
export function wavFromFloat(samples, sampleRate) {
  const pcm = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    pcm[i] = s < 0 ? Math.round(s * 32768) : Math.round(s * 32767);
  }
  return wavFromInt16([pcm], sampleRate);
}

function wavHeader(numSamples, sampleRate) {
  const dataBytes = numSamples * 2;
  const view = new DataView(new ArrayBuffer(44));
  const text = (offset, s) => { for (let i = 0; i < s.length; i++) view.setUint8(offset + i, s.charCodeAt(i)); };
  text(0, "RIFF");
  view.setUint32(4, 36 + dataBytes, true);
  text(8, "WAVE");
  text(12, "fmt ");
  view.setUint32(16, 16, true);           // fmt chunk size
  view.setUint16(20, 1, true);            // PCM
  view.setUint16(22, 1, true);            // mono
  view.setUint32(24, sampleRate, true);
  view.setUint32(28, sampleRate * 2, true);
  view.setUint16(32, 2, true);            // block align
  view.setUint16(34, 16, true);           // bits per sample
  text(36, "data");
  view.setUint32(40, dataBytes, true);
  return view.buffer;
}

/** Decode any audio the browser reads into mono samples at `ctx.sampleRate`; null when it cannot. */
export async function decodeToMono(ctx, blob) {
  let buffer;
  try {
    buffer = await ctx.decodeAudioData(await blob.arrayBuffer());
  } catch {
    return null;
  }
  const mono = new Float32Array(buffer.length);
  for (let c = 0; c < buffer.numberOfChannels; c++) {
    const channel = buffer.getChannelData(c);
    for (let i = 0; i < mono.length; i++) mono[i] += channel[i] / buffer.numberOfChannels;
  }
  return { samples: mono, sampleRate: buffer.sampleRate, duration: buffer.duration };
}
