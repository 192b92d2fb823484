"""Qwen2.5-Omni token2wav stage: codec tokens -> 24 kHz float32 waveform.

transformers' ``Qwen2_5OmniToken2WavModel`` is a DiT that turns codec tokens
into a mel spectrogram by integrating an ODE (fixed-step RK4, ``num_steps``
time points warped by ``sway_coefficient``, classifier-free guidance
``guidance_scale``), conditioned on the speaker's ``cond`` vector and
``ref_mel`` spectrogram, followed by a BigVGAN vocoder (240 samples per mel
frame, 2 mel frames per codec token).

Noise. The ODE starts from ``torch.randn([1, 2 * num_codes, mel_dim],
float32)`` drawn from the *global* generator of the codes' device, the first
random draw of token2wav. ``Qwen2_5OmniToken2Wav`` draws the same tensor from
a private ``torch.Generator(device).manual_seed(seed)`` instead, so a request's
audio depends only on its own seed, never on what else ran or in which order;
``torch.manual_seed(seed)`` right before HF's token2wav (or before a whole
greedy ``generate``, where nothing else draws random numbers) gives the same
noise and the same waveform.

Requests are decoded one at a time, as HF's ``generate`` does (codes of
different lengths; the DiT's attention blocks are local so padding would
change results).

Streaming (``ChunkedVocoder``, ``DiTStreamConfig``). The DiT is not causal, so
a chunk cannot be decoded exactly before the codes after it exist. Its
authors stream it with a window per chunk (Qwen's vLLM ``Code2Wav`` and
vllm-omni's ``process_chunk``): a chunk of 3 DiT blocks (72 mel frames, 36
codes) is integrated in a window that adds 2 blocks of past and 1 block of
future codes, from the same noise rows a whole decode would use; BigVGAN then
vocodes the chunk's mel with the previous chunk's last 2 x 20 mel frames in
front, and the 20 frames at each inner edge are cut (hard cuts, no
crossfade), so every mel frame is vocoded once with 20 frames of context.
The concatenated chunks have exactly a whole decode's length; their samples
differ from it (the window shifts the DiT's rotary positions and hides
far context): ``docs/omni_pipeline.md`` gives the measured difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.core.chunk_schedule import ChunkSchedule

__all__ = ["DiTStreamConfig", "Qwen2_5OmniToken2Wav"]

AUTHORS_BLOCK_FRAMES = 24  # the published DiT block; the authors' vocoder context (20 frames) is for it
AUTHORS_VOCODER_CONTEXT = 20


@dataclass(frozen=True)
class DiTStreamConfig:
    """The authors' streaming schedule, in DiT attention blocks (``block_size``
    mel frames; 24 in the published checkpoints): chunks of ``chunk_blocks``,
    integrated with ``past_blocks`` before and ``future_blocks`` after;
    ``vocoder_context_frames`` of mel on each side of a chunk boundary go
    through BigVGAN twice and are cut from one side (None: 20 frames per
    24-frame block, rounded, the authors' 20 for the published block)."""

    chunk_blocks: int = 3
    past_blocks: int = 2
    future_blocks: int = 1
    vocoder_context_frames: int | None = None


@dataclass
class _DecodeState:
    """One request's decode between chunks: its noise rows so far (drawn from
    its own CPU generator, so they are the leading rows of a whole decode's
    noise on CPU) and the mel the previous chunk vocoded."""

    speaker: str
    seed: int
    stream: bool
    generator: torch.Generator
    noise: torch.Tensor  # [1, frames drawn, mel_dim]
    vocoded_mel: torch.Tensor | None = None  # [1, mel_dim, frames]


class Qwen2_5OmniToken2Wav:
    """Codec tokens -> waveform with a loaded ``Qwen2_5OmniToken2WavModel``
    and the checkpoint's speakers (``spk_dict.pt``: ``cond``, ``ref_mel``)."""

    sample_rate: int = 24000

    def __init__(
        self, token2wav: Any, speakers: dict[str, dict[str, Any]], stream_config: DiTStreamConfig | None = None
    ) -> None:
        self.token2wav = token2wav.eval().float()  # HF runs token2wav in fp32 whatever the model dtype
        self.dit = token2wav.code2wav_dit_model
        self.vocoder = token2wav.code2wav_bigvgan_model
        self.speakers = speakers
        self._set_stream_config(stream_config or DiTStreamConfig())

    def _set_stream_config(self, config: DiTStreamConfig) -> None:
        """Mel-frame sizes of the streaming window, checked against the DiT."""
        block, repeats = int(self.dit.config.block_size), int(self.dit.repeats)
        if block % repeats:
            raise ValueError(f"the DiT's block_size {block} is not a multiple of its repeats {repeats}")
        context = config.vocoder_context_frames
        if context is None:
            context = round(AUTHORS_VOCODER_CONTEXT * block / AUTHORS_BLOCK_FRAMES)
        self.chunk_frames = config.chunk_blocks * block
        self.past_frames = config.past_blocks * block
        self.future_frames = config.future_blocks * block
        self.vocoder_context = context
        if min(config.chunk_blocks, config.future_blocks) < 1 or config.past_blocks < 0 or context < 0:
            raise ValueError(f"invalid streaming config {config}")
        if 2 * context > self.chunk_frames:
            raise ValueError(f"vocoder context {context} frames needs chunks of at least {2 * context} mel frames")
        self.stream_config = config

    @property
    def device(self) -> torch.device:
        return self.dit.proj_out.weight.device

    def initial_noise(self, num_codes: int, seed: int | None = None) -> torch.Tensor:
        """``[1, 2 * num_codes, mel_dim]`` fp32 noise; ``seed=None`` draws from
        the global generator (as HF does)."""
        shape = (1, num_codes * self.dit.repeats, self.dit.mel_dim)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(shape, dtype=torch.float32, device=self.device, generator=generator)

    def _check_length(self, num_codes: int) -> None:
        duration = num_codes * self.dit.repeats
        if duration > self.dit.config.max_position_embeddings:
            raise ValueError(
                f"{num_codes} codec tokens make {duration} mel frames, more than the DiT's "
                f"max_position_embeddings ({self.dit.config.max_position_embeddings})"
            )

    def _speaker(self, speaker: str) -> tuple[torch.Tensor, torch.Tensor]:
        if speaker not in self.speakers:
            raise ValueError(f"unknown speaker {speaker!r}; available: {sorted(self.speakers)}")
        params = self.speakers[speaker]
        return (
            params["cond"].to(self.device).float().reshape(1, -1),
            params["ref_mel"].to(self.device).float().reshape(1, -1, self.dit.mel_dim),
        )

    @torch.no_grad()
    def mel(
        self,
        codes: Sequence[int] | torch.Tensor,
        speaker: str,
        seed: int | None = None,
        num_steps: int = 10,
        guidance_scale: float = 0.5,
        sway_coefficient: float | None = -1.0,
    ) -> torch.Tensor:
        """``[1, mel_dim, 2 * num_codes]`` mel spectrogram, as
        ``Qwen2_5OmniToken2WavDiTModel.sample`` computes it."""
        code = torch.as_tensor(codes, dtype=torch.long, device=self.device).reshape(1, -1)
        self._check_length(code.shape[1])
        return self._integrate(code, speaker, self.initial_noise(code.shape[1], seed), num_steps, guidance_scale,
                               sway_coefficient)  # fmt: skip

    def _integrate(
        self,
        code: torch.Tensor,
        speaker: str,
        noise: torch.Tensor,
        num_steps: int = 10,
        guidance_scale: float = 0.5,
        sway_coefficient: float | None = -1.0,
    ) -> torch.Tensor:
        """The DiT's ODE from ``noise`` ``[1, frames, mel_dim]`` for codes ``[1, frames / repeats]``."""
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        duration = noise.shape[1]
        cond, ref_mel = self._speaker(speaker)
        cond = cond.unsqueeze(1).repeat(1, duration, 1)

        def velocity(time_step: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            apply_cfg = guidance_scale >= 1e-5
            out = self.dit(
                hidden_states=state,
                speaker_embedding=cond,
                condition_vector=ref_mel,
                quantized_code=code,
                time_step=time_step,
                drop_audio_conditioning=False,
                drop_code=False,
                apply_cfg=apply_cfg,
            )
            if not apply_cfg:
                return out
            guided, unconditioned = torch.chunk(out, 2, dim=0)
            return guided + (guided - unconditioned) * guidance_scale

        times = torch.linspace(0, 1, num_steps, device=self.device, dtype=cond.dtype)
        if sway_coefficient is not None:
            times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
        trajectory = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)
        return trajectory[-1].permute(0, 2, 1)

    # -- ChunkedVocoder ----------------------------------------------------------

    def chunk_schedule(self, stream: bool) -> ChunkSchedule:
        """Streamed: chunks of ``chunk_blocks`` DiT blocks, each decoded once the
        ``future_blocks`` after it exist; otherwise one whole decode."""
        if not stream:
            return ChunkSchedule()
        repeats = self.dit.repeats
        size = self.chunk_frames // repeats
        return ChunkSchedule(first=size, size=size, lookahead=self.future_frames // repeats)

    def start_decode(self, speaker: str, seed: int, stream: bool) -> _DecodeState:
        self._speaker(speaker)  # an unknown speaker fails before any chunk
        generator = torch.Generator().manual_seed(seed)
        return _DecodeState(speaker, seed, stream, generator, torch.zeros(1, 0, self.dit.mel_dim))

    @torch.no_grad()
    def decode_chunk(self, codes: Sequence[int], index: int, state: _DecodeState, last: bool) -> np.ndarray:
        """Chunk ``index`` of a request (see the module docstring). A whole decode
        (``stream=False``) is ``__call__``: equal to transformers."""
        if not state.stream:
            return self(codes, state.speaker, seed=state.seed)
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        self._check_length(len(codes))
        repeats, chunk, ctx = self.dit.repeats, self.chunk_frames, self.vocoder_context
        frames = len(codes) * repeats
        own_start, own_end = index * chunk, frames if last else (index + 1) * chunk
        start = max(own_start - self.past_frames, 0)  # a multiple of the block: blocks stay aligned
        end = frames if last else min(own_end + self.future_frames, frames)
        noise = self._noise_rows(state, end)[:, start:end].to(self.device)
        code = torch.as_tensor(list(codes[start // repeats : end // repeats]), dtype=torch.long, device=self.device)
        window = self._integrate(code.reshape(1, -1), state.speaker, noise)
        own = window[:, :, own_start - start : own_end - start]
        head = 0 if state.vocoded_mel is None else 2 * ctx
        mel = own if head == 0 else torch.cat([state.vocoded_mel[:, :, -head:], own], dim=2)
        state.vocoded_mel = mel
        wave = self.vocoder(mel).reshape(-1)
        hop = wave.shape[0] // mel.shape[2]
        cut_front = 0 if head == 0 else ctx * hop
        cut_back = 0 if last else ctx * hop
        return wave[cut_front : wave.shape[0] - cut_back].float().cpu().numpy()

    @staticmethod
    def _noise_rows(state: _DecodeState, frames: int) -> torch.Tensor:
        """The request's first ``frames`` noise rows, drawing the missing ones.
        On CPU, draws of whole mel rows (80 floats, a multiple of 16) continue one
        another, so these are the rows one draw of the whole length gives."""
        missing = frames - state.noise.shape[1]
        if missing > 0:
            more = torch.randn((1, missing, state.noise.shape[2]), dtype=torch.float32, generator=state.generator)
            state.noise = torch.cat([state.noise, more], dim=1)
        return state.noise

    @torch.no_grad()
    def __call__(
        self,
        codes: Sequence[int] | torch.Tensor,
        speaker: str = "Chelsie",
        seed: int | None = None,
        **mel_kwargs: Any,
    ) -> np.ndarray:
        """1-D float32 waveform at :attr:`sample_rate` (480 samples per code with the published vocoder config)."""
        if len(codes) == 0:
            return np.zeros(0, dtype=np.float32)
        wave = self.vocoder(self.mel(codes, speaker, seed, **mel_kwargs))
        return wave.reshape(-1).float().cpu().numpy()
