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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["Qwen2_5OmniToken2Wav"]


class Qwen2_5OmniToken2Wav:
    """Codec tokens -> waveform with a loaded ``Qwen2_5OmniToken2WavModel``
    and the checkpoint's speakers (``spk_dict.pt``: ``cond``, ``ref_mel``)."""

    sample_rate: int = 24000

    def __init__(self, token2wav: Any, speakers: dict[str, dict[str, Any]]) -> None:
        self.token2wav = token2wav.eval().float()  # HF runs token2wav in fp32 whatever the model dtype
        self.dit = token2wav.code2wav_dit_model
        self.vocoder = token2wav.code2wav_bigvgan_model
        self.speakers = speakers

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
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        code = torch.as_tensor(codes, dtype=torch.long, device=self.device).reshape(1, -1)
        duration = code.shape[1] * self.dit.repeats
        if duration > self.dit.config.max_position_embeddings:
            raise ValueError(
                f"{code.shape[1]} codec tokens make {duration} mel frames, more than the DiT's "
                f"max_position_embeddings ({self.dit.config.max_position_embeddings})"
            )
        cond, ref_mel = self._speaker(speaker)
        noise = self.initial_noise(code.shape[1], seed)
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
