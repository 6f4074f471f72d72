"""Text streaming in: the official `inference_bistream` schedule as a pure state machine (spec/llm.md §7).

The LM was trained on sequences that interleave 5 text tokens with 15 speech tokens. Text ids arrive
over time; `BistreamState` decides what the LM row is fed next and how each generated token is
treated. It holds embeddings only; the engine runs the forwards (an "extend" for a multi-position
feed, the batched decode step for the single speech token fed after each emitted token).

Deviations from the reference, on purpose (spec/llm.md §7 lists them as quirks):
* an input already consumed is never fed twice (the reference re-feeds the last speech embedding at
  the final stage when the last decode loop ended on FILL);
* prompt speech not yet paired with text when the text ends is fed before TASK_ID instead of dropped.
"""

from __future__ import annotations

import enum
from collections import deque

import torch


class Feed(enum.Enum):
    wait = "wait"  # nothing to feed until more text arrives
    extend = "extend"  # feed `take_pending()` (several positions), then sample
    decode = "decode"  # the last emitted token is the next input (batched decode step)
    done = "done"


class BistreamState:
    def __init__(self, sos: torch.Tensor, task_id: torch.Tensor, prompt_text: torch.Tensor,
                 prompt_speech: torch.Tensor, fill_token: int, mix_ratio: tuple[int, int] = (5, 15),
                 prefix: torch.Tensor | None = None) -> None:
        """sos/task_id [d]; prompt_text [Lp, d], prompt_speech [P, d] embeddings; prefix [n, d]: fed right
        after SOS, outside the 5:15 interleave (CosyVoice3: the prompt text up to `<|endofprompt|>`)."""
        self.text_per_group, self.speech_per_group = mix_ratio
        self.fill_token = fill_token
        self.task_id = task_id
        self.pending: list[torch.Tensor] = [sos, *(prefix if prefix is not None else [])]
        self.text_buf: deque[torch.Tensor] = deque(prompt_text)
        self.sp_buf: deque[torch.Tensor] = deque(prompt_speech)
        self.out: list[int] = []  # every generated id, FILL included (the RAS window sees FILL)
        num_prompt = prompt_speech.shape[0]
        self.next_fill = self.speech_per_group - num_prompt % self.speech_per_group
        self.started = False  # the first forward happened
        self.decoding = False  # a decode loop is running (tokens fed back one by one)
        self.text_ended = False
        self.final_stage = False

    # ------------------------------------------------------------------ text side
    def add_text(self, text_embeddings: torch.Tensor) -> None:
        for row in text_embeddings:
            self.text_buf.append(row)
            self._pair_prompt()

    def _pair_prompt(self) -> None:
        while self.sp_buf and len(self.text_buf) >= self.text_per_group:
            self.pending += [self.text_buf.popleft() for _ in range(self.text_per_group)]
            self.pending += [self.sp_buf.popleft() for _ in range(min(self.speech_per_group, len(self.sp_buf)))]

    def end_text(self) -> None:
        self.text_ended = True

    # ------------------------------------------------------------------ LM side
    def next_feed(self) -> Feed:
        if self.final_stage:
            return Feed.decode if self.decoding else Feed.done
        if self.decoding:
            return Feed.decode
        if self.text_ended:
            self._enter_final_stage()
            return Feed.extend
        if self.sp_buf:
            return Feed.wait
        needs_text = (self.out and self.out[-1] == self.fill_token) or (not self.started and len(self.pending) == 1)
        if needs_text:
            if len(self.text_buf) < self.text_per_group:
                return Feed.wait
            self.pending += [self.text_buf.popleft() for _ in range(self.text_per_group)]
        return Feed.extend if self.pending else Feed.wait

    def _enter_final_stage(self) -> None:
        self.final_stage = True
        self.pending += list(self.sp_buf) + list(self.text_buf) + [self.task_id]
        self.sp_buf.clear()
        self.text_buf.clear()

    def take_pending(self) -> torch.Tensor:
        """The embeddings to feed now [n, d]; afterwards the row samples one token."""
        feed = torch.stack(self.pending)
        self.pending = []
        self.started = True
        self.decoding = True
        return feed

    def forced_token(self) -> int | None:
        """FILL is forced at fixed positions while text is streaming (the training layout)."""
        if not self.final_stage and len(self.out) == self.next_fill:
            return self.fill_token
        return None

    def on_token(self, token: int, is_special: bool) -> bool:
        """Record a generated token; returns True when it is speech to voice.

        While text streams, any special class acts as FILL (the reference raises on 6562; EOS is
        masked then); in the final stage any special class ends the segment.
        """
        if is_special and not self.final_stage:
            self.next_fill = len(self.out) + self.speech_per_group + 1
            self.out.append(self.fill_token)
            self.decoding = False  # wait for the next 5 text tokens
            return False
        self.out.append(token)
        if is_special:
            self.decoding = False
        return not is_special
