"""Frontend: text in, prompt audio in, everything the models need out (spec/frontend.md).

    frontend = Frontend(load_checkpoint(model_dir))
    voice = frontend.make_voice_prompt("prompt.wav", "transcript of the prompt")   # once per voice
    for segment in frontend.segments(text):                                        # per request
        inputs = frontend.inputs_zero_shot(segment, voice)

CPU only apart from the two ONNX models; no model code and no torch.cuda. Heavy libraries
(transformers, onnxruntime, wetext, inflect) are imported when a `Frontend` is built, so the
dataclasses here stay cheap to import for the voice store and the CLI.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from cosystream.checkpoint import Checkpoint
from cosystream.errors import BadInput, UnknownVoice
from cosystream.frontend.audio import AudioInput, PromptAudio, load_speech, prepare_prompt_audio, prompt_mel, to_16k
from cosystream.frontend.prompt import (
    MODES,
    BuiltinSpeaker,
    ModelInputs,
    VoicePrompt,
    build_voice_prompt,
    cross_lingual_inputs,
    instruct2_inputs,
    load_spk2info,
    sft_inputs,
    vc_inputs,
    zero_shot_inputs,
)
from cosystream.frontend.speaker import SpeakerEncoder
from cosystream.frontend.speech_tokenizer import SpeechTokenizer
from cosystream.frontend.text import TextNormalizer
from cosystream.frontend.tokenizer import END_OF_PROMPT, TextTokenizer

if TYPE_CHECKING:
    from cosystream.frontend.torch_prompt import PromptAnalysis

__all__ = ["Frontend", "VoicePrompt", "ModelInputs", "BuiltinSpeaker", "AudioInput", "MODES"]

# CosyVoice3's system prefix: `CosyVoice3LM` needs `<|endofprompt|>` in the prompt or target text
# (spec/cosyvoice3.md §3.2); the official examples put this sentence before it.
CV3_SYSTEM_PROMPT = "You are a helpful assistant."


class Frontend:
    """Text normalisation, tokenisation and prompt analysis for one CosyVoice2 or CosyVoice3 model directory.

    Thread-safe: the engine may call it from a thread pool. `device` ("cpu" or "cuda[:N]") only
    selects the onnxruntime provider of the speech tokenizer and CAM++; every tensor returned
    is a CPU tensor.
    """

    def __init__(self, checkpoint: Checkpoint, device: str = "cpu") -> None:
        files = checkpoint.files
        self.family = files.family
        self.mel_dims = checkpoint.hparams.mel
        self.token_mel_ratio = checkpoint.hparams.token_mel_ratio
        self.tokenizer = TextTokenizer(files.tokenizer_dir, files.family)
        self.speech_tokenizer = SpeechTokenizer(files.speech_tokenizer, device)
        self.speaker_encoder = SpeakerEncoder(files.campplus, device)
        self.speakers: dict[str, BuiltinSpeaker] = load_spk2info(files.spk2info, files.family) if files.spk2info else {}
        self._normalizer = TextNormalizer(self.tokenizer.encode)
        # inflect keeps per-call state on its engine; re-entrant so that a caller can hold it around a whole
        # request (normalizer_if_free)
        self._normalizer_lock = threading.RLock()

    # text

    def normalize(self, text: str, split: bool = True) -> list[str]:
        """Official `text_normalize`: the segments, or with split=False one element, the whole text.

        May return [] (nothing speakable) or [""] (empty input), exactly as the official code.
        """
        with self._normalizer_lock:
            result = self._normalizer.normalize(text, split=split)
        return result if isinstance(result, list) else [result]

    @contextlib.contextmanager
    def normalizer_if_free(self) -> Iterator[bool]:
        """Hold the text normaliser if no other thread is using it (yields True), without waiting (False):
        a caller that must not block (an event loop) prepares its request inside, or hands it to a thread."""
        free = self._normalizer_lock.acquire(blocking=False)
        try:
            yield free
        finally:
            if free:
                self._normalizer_lock.release()

    def segments(self, text: str) -> list[str]:
        """The text segments to synthesise one by one; BadInput when there is nothing to say."""
        _check_text_length(text, "text")
        segments = [segment for segment in self.normalize(text) if segment.strip()]
        if not segments:
            raise BadInput("text: nothing to synthesise (empty, or only punctuation and symbols)")
        return segments

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    # voices

    def make_voice_prompt(self, audio: AudioInput, prompt_text: str = "",
                          analyse: Callable[[PromptAudio], PromptAnalysis] | None = None) -> VoicePrompt:
        """Analyse a prompt recording once: speech tokens, mel, x-vector and the transcript's ids.

        `audio` is a path, the file's bytes, or (samples [N] or [N, C], sample_rate). The
        transcript is normalised like the official `inference_zero_shot` does (split=False);
        leave it empty for a voice used only cross-lingually or by instruction. `analyse`
        replaces the ONNX analysis of the checked audio (the engine's batched GPU analysis).
        CosyVoice3: a transcript without `<|endofprompt|>` gets the system prefix
        "You are a helpful assistant.<|endofprompt|>" (the official example's prompt text); the official
        `text_normalize` then leaves the whole text unnormalised, as it does for any `<|...|>` markup.
        """
        _check_text_length(prompt_text, "prompt_text")
        if self.family == "cosyvoice3" and prompt_text.strip() and END_OF_PROMPT not in prompt_text:
            prompt_text = CV3_SYSTEM_PROMPT + END_OF_PROMPT + prompt_text
        prompt_audio = prepare_prompt_audio(audio, self.mel_dims.sampling_rate)
        if analyse is not None:
            analysis = analyse(prompt_audio)
            raw_tokens, raw_mel, xvector = analysis.tokens, analysis.mel, analysis.xvector
        else:
            raw_tokens = self.speech_tokenizer.tokenize(prompt_audio.wav_16k)
            raw_mel = prompt_mel(prompt_audio.wav_24k, self.mel_dims)
            xvector = self.speaker_encoder.embed(prompt_audio.wav_16k)
        text_ids = self.encode_text(self.normalize(prompt_text, split=False)[0]) if prompt_text else []
        return build_voice_prompt(text_ids, raw_tokens, raw_mel, xvector, self.token_mel_ratio, self.family)

    def builtin_voice(self, name: str) -> VoicePrompt:
        """The prompt of a zero-shot entry of the model's `spk2info.pt`."""
        speaker = self._speaker(name)
        if speaker.prompt is None:
            raise BadInput(f"voice: built-in speaker {name!r} has only an embedding (use mode sft)")
        return speaker.prompt

    def _speaker(self, name: str) -> BuiltinSpeaker:
        if name not in self.speakers:
            known = ", ".join(sorted(self.speakers)) or "none"
            raise UnknownVoice(f"voice: no built-in speaker {name!r} in spk2info.pt (known: {known})")
        return self.speakers[name]

    # model inputs, one text segment each

    def inputs_zero_shot(self, text: str, prompt: VoicePrompt) -> ModelInputs:
        """`text` is one segment from `segments()`; the voice needs a transcript."""
        if prompt.prompt_text_ids.numel() == 0:
            raise BadInput("prompt_text: zero_shot needs the voice's transcript (use cross_lingual without one)")
        return zero_shot_inputs(self.encode_text(text), prompt)

    def inputs_cross_lingual(self, text: str, prompt: VoicePrompt) -> ModelInputs:
        """CosyVoice3: a segment without `<|endofprompt|>` gets the system prefix in front (the official
        example writes it into the target text; prefixing the normalised segment keeps normalisation)."""
        return cross_lingual_inputs(self.encode_text(self._with_system_prompt(text)), prompt)

    def inputs_instruct2(self, text: str, instruct: str, prompt: VoicePrompt) -> ModelInputs:
        """The instruction is tokenised verbatim (not normalised), ending in `<|endofprompt|>`.

        Deviation: the official code leaves a missing `<|endofprompt|>` missing; the model was
        trained with it, so we append it. CosyVoice3 instructions start with the system sentence
        ("You are a helpful assistant. <instruction><|endofprompt|>"); it is put in front when absent.
        """
        return instruct2_inputs(self.encode_text(text), self.instruction_ids(instruct), prompt)

    def instruction_ids(self, instruct: str) -> list[int]:
        """The instruct2 prompt text ids: the instruction verbatim, ending in `<|endofprompt|>`
        (CosyVoice3: after the system sentence, see inputs_instruct2)."""
        _check_text_length(instruct, "instruct")
        instruct = instruct.strip()
        if not instruct:
            raise BadInput("instruct: empty instruction")
        if self.family == "cosyvoice3" and END_OF_PROMPT not in instruct and not instruct.startswith(
                CV3_SYSTEM_PROMPT):
            instruct = f"{CV3_SYSTEM_PROMPT} {instruct}"
        if not instruct.endswith(END_OF_PROMPT):
            instruct += END_OF_PROMPT
        return self.encode_text(instruct)

    def text_stream_prompt_ids(self, mode: str, prompt: VoicePrompt, instruct: str = "") -> torch.Tensor:
        """The LM prompt text (int32 ids) of a request whose target text streams in: zero_shot the voice's
        transcript, instruct2 the instruction, cross_lingual none (CosyVoice3: the system prefix, as its LM
        needs `<|endofprompt|>` in the prompt text when the text streams in)."""
        if mode == "zero_shot":
            if prompt.prompt_text_ids.numel() == 0:
                raise BadInput("prompt_text: zero_shot needs the voice's transcript")
            return prompt.prompt_text_ids
        if mode == "instruct2":
            return torch.tensor(self.instruction_ids(instruct), dtype=torch.int32)
        if self.family == "cosyvoice3":
            return torch.tensor(self.encode_text(CV3_SYSTEM_PROMPT + END_OF_PROMPT), dtype=torch.int32)
        return torch.zeros(0, dtype=torch.int32)

    def inputs_sft(self, text: str, speaker: str) -> ModelInputs:
        """A speaker of `spk2info.pt`; zero-shot entries work too, through their x-vector.
        CosyVoice3: the segment gets the system prefix as in cross-lingual (its LM needs `<|endofprompt|>`)."""
        return sft_inputs(self.encode_text(self._with_system_prompt(text)), self._speaker(speaker).xvector)

    def _with_system_prompt(self, text: str) -> str:
        """CosyVoice3 without a prompt transcript: the system prefix in front of a segment lacking the marker."""
        if self.family == "cosyvoice3" and END_OF_PROMPT not in text:
            return CV3_SYSTEM_PROMPT + END_OF_PROMPT + text
        return text

    def inputs_vc(self, source: AudioInput, prompt: VoicePrompt) -> ModelInputs:
        """Re-voice `source` (0.5-30 s of speech) with the prompt's voice."""
        data, sample_rate = load_speech(source, field="source_wav")
        return vc_inputs(self.speech_tokenizer.tokenize(to_16k(data, sample_rate)), prompt)


def _check_text_length(text: str, field: str) -> None:
    """The text's type; its length limit is the engine's (EngineConfig.max_text_chars), checked at its entry."""
    if not isinstance(text, str):
        raise BadInput(f"{field}: expected a string, got {type(text).__name__}")
