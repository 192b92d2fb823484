"""Qwen3-Omni's code2wav: frames of codes to a 24 kHz waveform, whole or in exact chunks.

The vocoder is causal with a one-frame look-ahead that it trims:

- the pre-transformer attends over a sliding window of ``W`` frames in each of
  its ``L`` layers (so a frame sees at most ``L * (W - 1)`` frames back);
- every convolution is left-padded (causal), and each transposed convolution
  trims its last ``stride`` samples, so ``N`` frames give
  ``N * U - trim`` samples (``U`` = ``samples_per_frame``, ``trim`` fixed).

So the decode of the first ``E`` frames is a prefix of the decode of all
frames, and the samples ``[S(E0), S(E))`` (``S(n) = n * U - trim``) of a
chunk ending at frame ``E`` need only ``left_context`` frames before ``E0``
(``receptive_frames`` plus the trim). ``decode_codes(window, left_context=c)``
decodes ``window`` (``c`` context frames then the new ones) and returns exactly
those samples; concatenated over any chunk schedule they are the full decode,
sample for sample and in length. (transformers' ``chunked_decode`` cuts
``c * U`` samples instead of ``c * U - trim`` and so drops ``trim`` samples at
every chunk boundary; for at most 300 frames, as ``generate`` calls it, it is one
full decode, which is what ``decode`` computes.)

A batch of requests decodes in one call, right-padded with code 0: padding
after a sequence cannot change its samples (causal), which are then cut at
its own ``S(n)``. The chunked stage batches the same way: ``decode_chunks``
decodes every request's scheduled chunk (each with its left context and its
own positions) in one forward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from omnistage.core.chunk_schedule import ChunkSchedule

__all__ = ["Qwen3OmniCode2Wav", "StreamingVocoder"]

SAMPLE_RATE = 24000
# Streamed decode: a first chunk of 4 frames (0.32 s of audio at 12.5 frames/s) for
# latency, then chunks of 12 (0.96 s). Any schedule gives the same samples.
STREAM_SCHEDULE = ChunkSchedule(first=4, size=12)


class Qwen3OmniCode2Wav:
    """Wraps ``Qwen3OmniMoeCode2Wav``; codes are ``[num_quantizers, N]`` int arrays, audio 1-D float32."""

    sample_rate = SAMPLE_RATE

    def __init__(self, code2wav: Any) -> None:
        self.module = code2wav
        cfg = code2wav.config
        self.num_quantizers = int(cfg.num_quantizers)
        self.codebook_size = int(cfg.codebook_size)  # codes are in [0, codebook_size) in every group
        self.samples_per_frame = int(code2wav.total_upsample)
        self.trim = self._trim(cfg)
        self.receptive_frames = self._receptive_frames(cfg)
        # Frames of left context that make a chunk exact: its first kept sample sits
        # ceil(trim / U) frames before the chunk, and sees receptive_frames before that.
        self.left_context = self.receptive_frames + math.ceil(
            self.trim / self.samples_per_frame
        )

    @property
    def device(self) -> torch.device:
        return self.module.code_embedding.weight.device

    @staticmethod
    def _trim(cfg: Any) -> int:
        """Samples the decoder's transposed convolutions trim at the end, in output samples.

        Each (kernel ``2r``, stride ``r``) turns ``L`` inputs into ``(L - 1) * r``
        outputs; the hidden-rate ones (kernel = stride) trim nothing."""
        rates = [int(r) for r in cfg.upsample_rates]
        return sum(
            r * int(np.prod(rates[i + 1 :], dtype=np.int64))
            for i, r in enumerate(rates)
        )

    @staticmethod
    def _receptive_frames(cfg: Any) -> int:
        """Frames before a sample that can change it: the attention window over the
        layers, plus each causal convolution's reach converted to frames (rounded up)."""
        frames = int(cfg.num_hidden_layers) * (int(cfg.sliding_window) - 1)
        rate = 1
        for r in cfg.upsampling_ratios:
            rate *= int(r)
            frames += math.ceil(6 / rate)  # ConvNeXt depthwise conv, kernel 7
        frames += math.ceil(6 / rate)  # decoder input conv, kernel 7
        for r in cfg.upsample_rates:
            rate *= int(r)
            frames += math.ceil(
                6 * (1 + 3 + 9) / rate
            )  # residual units, kernel 7, dilations 1, 3, 9
        frames += math.ceil(6 / rate)  # output conv, kernel 7
        return frames

    def num_samples(self, num_frames: int) -> int:
        """Samples of the full decode of ``num_frames`` frames."""
        return (
            max(0, num_frames * self.samples_per_frame - self.trim) if num_frames else 0
        )

    @torch.inference_mode()
    def _run(self, codes: torch.Tensor, first_frame: int | Sequence[int] = 0) -> torch.Tensor:
        """``[B, Q, N]`` codes -> ``[B, N * U - trim]`` fp32 samples; row ``b``'s positions start at
        ``first_frame`` (or ``first_frame[b]``) so that a chunk's rotary phases are those of the
        full decode."""
        m = self.module
        hidden = m.code_embedding(codes + m.code_offset).mean(1)
        starts = [first_frame] * codes.shape[0] if isinstance(first_frame, int) else list(first_frame)
        positions = torch.arange(codes.shape[-1], device=codes.device)[None] + torch.tensor(
            starts, device=codes.device
        )[:, None]
        hidden = m.pre_transformer(
            inputs_embeds=hidden, position_ids=positions
        ).last_hidden_state
        hidden = hidden.permute(0, 2, 1)
        for blocks in m.upsample:
            for block in blocks:
                hidden = block(hidden)
        wav = hidden
        for block in m.decoder:
            wav = block(wav)
        return wav.clamp(min=-1, max=1)[:, 0].float()

    def _as_tensor(self, codes: Any) -> torch.Tensor:
        """``[Q, N]`` codes on the device; codes past the codebook are refused (checked on the host)."""
        a = np.asarray(codes)
        if a.ndim != 2 or a.shape[0] != self.num_quantizers:
            raise ValueError(
                f"code2wav: expected codes [{self.num_quantizers}, frames], got {tuple(a.shape)}"
            )
        # Past the codebook a code would read another group's embedding (code_offset) or none.
        if a.size and (int(a.min()) < 0 or int(a.max()) >= self.codebook_size):
            raise ValueError(
                f"code2wav: codes must be in [0, {self.codebook_size}), got {int(a.min())}..{int(a.max())}"
            )
        return torch.as_tensor(a, dtype=torch.long, device=self.device)

    def decode(self, codes: Any) -> np.ndarray:
        """The full decode of ``[Q, N]`` codes: ``num_samples(N)`` float32 samples."""
        return self.decode_batch([codes])[0]

    def decode_batch(self, batch: Sequence[Any]) -> list[np.ndarray]:
        """Full decodes of several code arrays in one forward, right-padded (exact: the model is causal)."""
        tensors = [self._as_tensor(c) for c in batch]
        lengths = [t.shape[1] for t in tensors]
        out: list[np.ndarray | None] = [
            np.zeros(0, dtype=np.float32) if n == 0 else None for n in lengths
        ]
        live = [i for i, n in enumerate(lengths) if n > 0]
        if live:
            longest = max(lengths[i] for i in live)
            padded = torch.zeros(
                len(live),
                self.num_quantizers,
                longest,
                dtype=torch.long,
                device=self.device,
            )
            for row, i in enumerate(live):
                padded[row, :, : lengths[i]] = tensors[i]
            wav = self._run(padded).cpu().numpy()
            for row, i in enumerate(live):
                out[i] = np.ascontiguousarray(
                    wav[row, : self.num_samples(lengths[i])], dtype=np.float32
                )
        return out  # type: ignore[return-value]

    def decode_codes(
        self, codes: Any, left_context: int = 0, first_frame: int | None = None
    ) -> np.ndarray:
        """Samples of the new frames of a chunk, exactly as the full decode has them.

        ``codes`` is ``[Q, c + n]``: ``left_context = c`` frames already decoded
        before, then ``n`` new frames. With ``E0`` the index of the first new
        frame, it returns the full decode's samples ``[S(E0), S(E0 + n))``,
        provided ``c >= min(E0, self.left_context)`` (pass every earlier frame
        when there are fewer). ``first_frame`` is the window's first frame index
        (default ``E0 - c`` with ``E0 = c``, i.e. a window starting at frame 0
        when ``c`` is the whole history; pass it when the window starts later).
        """
        t = self._as_tensor(codes)
        c = int(left_context)
        if not 0 <= c <= t.shape[1]:
            raise ValueError(
                f"decode_codes: left_context={c} outside 0..{t.shape[1]} frames"
            )
        start = 0 if first_frame is None else int(first_frame)
        if t.shape[1] == c:
            return np.zeros(0, dtype=np.float32)
        wav = self._run(t[None], first_frame=start)[0]
        e0 = start + c
        skip = self.num_samples(e0) - start * self.samples_per_frame if e0 > 0 else 0
        return np.ascontiguousarray(wav[skip:].cpu().numpy(), dtype=np.float32)

    def stream(self) -> StreamingVocoder:
        """A fresh streaming decoder over this vocoder."""
        return StreamingVocoder(self)

    # -- the ChunkedVocoder protocol (models/chunked_vocoder.py): codes are frames ------------
    # Each chunk re-reads its left context from the frames it is given, so a decode
    # keeps no state; a chunk reads no frame past its end (lookahead 0).

    stream_schedule: ChunkSchedule = STREAM_SCHEDULE

    def chunk_schedule(self, stream: bool) -> ChunkSchedule:
        return self.stream_schedule if stream else ChunkSchedule()

    def start_decode(self, speaker: str, seed: int, stream: bool) -> ChunkSchedule:
        return self.chunk_schedule(
            stream
        )  # no noise, no tail: the schedule is the whole state

    def decode_chunk(
        self, codes: Sequence[Any], index: int, state: ChunkSchedule, last: bool
    ) -> np.ndarray:
        """Samples of chunk ``index``: ``codes`` are every frame so far (``[groups]`` each),
        and the result is exactly the full decode's samples of the chunk's frames."""
        start, end = state.span(index, len(codes), last)
        lo = max(0, start - self.left_context)
        window = (
            np.asarray(codes[lo:end], dtype=np.int64)
            .reshape(end - lo, self.num_quantizers)
            .T
        )
        return self.decode_codes(window, left_context=start - lo, first_frame=lo)

    def _chunk_window(self, call: Any) -> tuple[torch.Tensor, int, int]:
        """A chunk's ``([Q, c + n] window, first frame, samples to skip)``, as ``decode_chunk`` reads it."""
        start, end = call.state.span(call.index, len(call.codes), call.last)
        lo = max(0, start - self.left_context)
        window = self._as_tensor(
            np.asarray(call.codes[lo:end], dtype=np.int64).reshape(end - lo, self.num_quantizers).T
        )
        skip = self.num_samples(start) - lo * self.samples_per_frame if start > 0 else 0
        return window, lo, skip

    def decode_chunks(self, calls: Sequence[Any]) -> list[np.ndarray]:
        """``decode_chunk`` of several requests' chunks (``ChunkCall``s) in one forward.

        Each window (the chunk's frames after its left context) is right-padded with
        code 0 to the longest and gets its own positions; the model is causal, so the
        padding cannot reach a window's samples, which are cut at its own
        ``[skip, S(window))``. Equal to one call per chunk to float rounding."""
        windows = [self._chunk_window(c) for c in calls]
        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(calls)
        live = [i for i, (w, _, skip) in enumerate(windows) if self.num_samples(w.shape[1]) > skip]
        if not live:
            return out
        longest = max(windows[i][0].shape[1] for i in live)
        padded = torch.zeros(len(live), self.num_quantizers, longest, dtype=torch.long, device=self.device)
        for row, i in enumerate(live):
            padded[row, :, : windows[i][0].shape[1]] = windows[i][0]
        wav = self._run(padded, first_frame=[windows[i][1] for i in live]).cpu().numpy()
        for row, i in enumerate(live):
            window, _, skip = windows[i]
            out[i] = np.ascontiguousarray(wav[row, skip : self.num_samples(window.shape[1])], dtype=np.float32)
        return out


class StreamingVocoder:
    """Feed frames as the talker makes them; each ``push`` returns the new samples.

    ``push(frames)`` takes ``[Q, n]`` new codes and decodes them with
    ``vocoder.left_context`` frames of history (or all of it, when shorter).
    The concatenation of every ``push`` result equals ``vocoder.decode`` of all
    frames, for any sizes of the pushes (the first small for latency, later ones
    larger)."""

    def __init__(self, vocoder: Qwen3OmniCode2Wav) -> None:
        self.vocoder = vocoder
        self._history = np.zeros((vocoder.num_quantizers, 0), dtype=np.int64)
        self.num_frames = 0
        self.num_samples = 0

    def push(self, frames: Any) -> np.ndarray:
        new = np.asarray(frames, dtype=np.int64).reshape(
            self.vocoder.num_quantizers, -1
        )
        if new.shape[1] == 0:
            return np.zeros(0, dtype=np.float32)
        c = min(self.num_frames, self.vocoder.left_context)
        window = np.concatenate(
            [self._history[:, self._history.shape[1] - c :], new], axis=1
        )
        wav = self.vocoder.decode_codes(
            window, left_context=c, first_frame=self.num_frames - c
        )
        self._history = np.concatenate([self._history, new], axis=1)[
            :, -self.vocoder.left_context :
        ]
        self.num_frames += new.shape[1]
        self.num_samples += wav.shape[0]
        return wav
