"""Qwen3-Omni thinker adapter: the MoE text stack, the audio tower, M-RoPE, and the talker's per-token rows.

The text stack is transformers' ``Qwen3OmniMoeThinkerTextModel`` on paged
attention (``CausalLM`` over ``TextStackView``). Its sparse MoE blocks are
transformers' own: the router picks the top-k experts per token and each hit
expert runs once on all of its tokens (batched per expert, never per token);
the thinker has no shared expert (the talker has one).

What the talker reads for every token the thinker forwarded is one row of
the thinker's width (``per_token_outputs``):

- at audio / image / video placeholders: the output of layer
  ``accept_hidden_layer`` (transformers' ``hidden_states[accept_hidden_layer]``;
  the final normed state when that index is the last), which the talker
  projects with ``hidden_projection``;
- everywhere else: the input embedding (``hidden_states[0]``), which it
  projects with ``text_projection``.

transformers' ``generate`` never reads the other tensor at a position, so
one row per token is the whole hand-off. The layer output is captured by a
forward hook during the step's own forward, so it costs no extra compute; it
is let go once ``per_token_outputs`` read it (or when the next step begins,
for a step that returned no rows), so no activation outlives its step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from omnistage.models.interface import TensorCachePolicy
from omnistage.models.mm_adapter import QwenMultiModalAdapter
from omnistage.models.qwen2_5_omni_thinker import padded_audio_batch
from omnistage.multimodal.inputs import MultiModalFeatureSpec
from omnistage.multimodal.processing import qwen3_audio_output_length

__all__ = ["QWEN3_THINKER_FOR_TALKER_POLICY", "Qwen3OmniThinkerAdapter"]

# The talker reads one row per token for every token the thinker forwarded, prefix included.
QWEN3_THINKER_FOR_TALKER_POLICY = TensorCachePolicy(full_prefix_hidden=True)


class Qwen3OmniThinkerAdapter(QwenMultiModalAdapter):
    """Wraps ``Qwen3OmniMoeThinkerForConditionalGeneration`` (or the whole model, whose ``thinker`` it uses).

    Audio items carry ``input_features`` ``[num_mel_bins, frames]`` (valid frames
    only) and ``audio_feature_lengths`` ``[1]``; image items ``pixel_values`` and
    ``image_grid_thw``; video items ``pixel_values_videos``, ``video_grid_thw`` and
    ``second_per_grid_ts`` (the temporal M-RoPE axis advances
    ``second_per_grid_ts * position_id_per_seconds`` per grid). Audio interleaved
    with a video (``use_audio_in_video``) is refused by the processor.

    **Deepstack.** The vision tower also returns, per image or video, one ``[n, hidden]``
    tensor per deepstack level, which transformers adds to the hidden states at
    the image's positions after decoder layers ``0 .. levels - 1``. The encoder
    cache holds only the main rows (one per placeholder); the deepstack rows are
    kept beside them here, keyed by the main tensor the cache holds and dropped
    when the cache lets go of it (a weak reference). Each step the runner hands
    the gathered rows to ``begin_step``, which maps every gathered row back to
    its item and row (the cache serves views of the main tensor), and forward
    hooks on the first layers add the matching deepstack rows, as
    ``_deepstack_process`` does.
    """

    modalities = ("image", "video", "audio")
    tensor_cache_policy = QWEN3_THINKER_FOR_TALKER_POLICY

    def __init__(self, model: Any, accept_hidden_layer: int | None = None) -> None:
        super().__init__(getattr(model, "thinker", model))
        ids = [
            int(getattr(self.config, n))
            for n in ("audio_token_id", "image_token_id", "video_token_id")
        ]
        self._placeholders = torch.tensor(ids, device=self.device)
        layers = self.language_model.layers
        self.accept_hidden_layer = (
            len(layers) if accept_hidden_layer is None else int(accept_hidden_layer)
        )
        if not 1 <= self.accept_hidden_layer <= len(layers):
            raise ValueError(
                f"accept_hidden_layer={self.accept_hidden_layer}: expected 1..{len(layers)} (the thinker's layers)"
            )
        self._accepted: torch.Tensor | None = None
        if self.accept_hidden_layer < len(layers):
            # hidden_states[k] is layer k-1's output; the last index is the final normed state instead.
            # Registered before the deepstack hooks: transformers records the layer output before the add.
            layers[self.accept_hidden_layer - 1].register_forward_hook(self._capture)
        # storage of the main rows -> (weak ref to them, their deepstack rows per level)
        self._deepstack: dict[int, tuple[weakref.ref, list[torch.Tensor]]] = {}
        self._step_deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = (
            None  # (positions, rows per level)
        )
        levels = len(
            getattr(self.config.vision_config, "deepstack_visual_indexes", ()) or ()
        )
        self._deepstack_levels = min(levels, len(layers))
        for level in range(self._deepstack_levels):
            layers[level].register_forward_hook(self._add_deepstack(level))

    def _capture(self, module: Any, args: Any, output: Any) -> None:
        # Read by this step's per_token_outputs, which lets it go.
        self._accepted = output[0] if isinstance(output, tuple) else output

    # ------------------------------------------------------------- towers

    def _encode_image(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        out = self.inner.get_image_features(
            self._cat(items, "pixel_values"),
            self._cat(items, "image_grid_thw", torch.int64),
            return_dict=True,
        )
        return self._with_deepstack(out)

    def _encode_video(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        out = self.inner.get_video_features(
            self._cat(items, "pixel_values_videos"),
            self._cat(items, "video_grid_thw", torch.int64),
            return_dict=True,
        )
        return self._with_deepstack(out)

    def _with_deepstack(self, out: Any) -> list[torch.Tensor]:
        """The vision tower's main rows per item, each remembered with its deepstack rows."""
        mains = [
            m.to(self.dtype).clone() for m in out.pooler_output
        ]  # own storage: the cache's views map back
        for i, main in enumerate(mains):
            self._remember(
                main, [level[i].to(self.dtype) for level in out.deepstack_features]
            )
        return mains

    def embed_multimodal(
        self, modality: str, items: list[dict[str, Any]]
    ) -> list[torch.Tensor]:
        outs = super().embed_multimodal(modality, items)
        if modality in ("image", "video") and any(
            _storage(o) not in self._deepstack for o in outs
        ):
            raise RuntimeError(
                f"Qwen3OmniThinkerAdapter: {modality} rows lost their deepstack rows (dtype cast)"
            )
        return outs

    def _remember(self, main: torch.Tensor, levels: list[torch.Tensor]) -> None:
        key = _storage(main)
        self._deepstack[key] = (
            weakref.ref(main, lambda _, k=key: self._deepstack.pop(k, None)),
            levels,
        )

    @property
    def num_deepstack_items(self) -> int:
        """Images and videos whose deepstack rows are kept (as many as the encoder cache holds)."""
        return len(self._deepstack)

    def begin_step(
        self, mm_rows: Sequence[torch.Tensor], is_mm_embed: torch.Tensor | None
    ) -> None:
        """The step's gathered encoder rows (in the order of the ``is_mm_embed`` positions):
        find the deepstack rows of those that are image or video rows."""
        self._step_deepstack = None
        self._accepted = None  # a capture the step before did not read: not kept past it
        if not mm_rows or is_mm_embed is None or not self._deepstack:
            return
        positions = torch.nonzero(is_mm_embed.cpu()).squeeze(1)
        pos_parts: list[torch.Tensor] = []
        row_parts: list[list[torch.Tensor]] = []
        offset = 0
        for rows in mm_rows:
            # The cache serves slices or aliases of the main tensor: same storage, an offset into it.
            entry = self._deepstack.get(_storage(rows))
            main = entry[0]() if entry is not None else None
            n = rows.shape[0]
            if main is not None:
                first = (rows.storage_offset() - main.storage_offset()) // max(
                    1, main.stride(0)
                )
                pos_parts.append(positions[offset : offset + n])
                row_parts.append([level[first : first + n] for level in entry[1]])  # type: ignore[index]
            offset += n
        if pos_parts:
            levels = len(row_parts[0])
            self._step_deepstack = (
                torch.cat(pos_parts).to(self.device),
                [torch.cat([r[k] for r in row_parts]) for k in range(levels)],
            )

    def _add_deepstack(self, level: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> Any:
            step = self._step_deepstack
            if step is None:
                return None
            positions, rows = step
            if level == self._deepstack_levels - 1:
                self._step_deepstack = None  # the forward's last use: not kept past the step
            hidden = (output[0] if isinstance(output, tuple) else output).clone()
            hidden[0, positions] = hidden[0, positions] + rows[level].to(hidden.dtype)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return hook

    def _encode_audio(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        features, mask, lengths = padded_audio_batch(items)
        out = self.inner.get_audio_features(
            features.to(self.device, self.inner.audio_tower.conv2d1.weight.dtype),
            feature_attention_mask=mask.to(self.device),
            return_dict=True,
        )
        n_window = int(self.inner.audio_tower.n_window)
        return list(
            out.last_hidden_state.split(
                [qwen3_audio_output_length(int(n), n_window) for n in lengths]
            )
        )

    def _rope_index(
        self, input_ids: torch.Tensor, features: list[MultiModalFeatureSpec]
    ) -> tuple[torch.Tensor, Any]:
        return self.inner.get_rope_index(
            input_ids,
            image_grid_thw=self._gather(features, "image", "image_grid_thw"),
            video_grid_thw=self._gather(features, "video", "video_grid_thw"),
            attention_mask=torch.ones_like(input_ids),
            use_audio_in_video=False,
            audio_seqlens=self._gather(features, "audio", "audio_feature_lengths"),
            second_per_grids=self._gather(features, "video", "second_per_grid_ts"),
        )

    # ----------------------------------------------------- talker hand-off

    @torch.inference_mode()
    def per_token_outputs(
        self, hidden: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """``[T, hidden]`` rows the talker reads, for the step's packed tokens (see the module docstring).

        Called once per step, after its forward: the captured layer output is let go here."""
        n = input_ids.shape[0]
        captured, self._accepted = self._accepted, None
        is_mm = torch.isin(input_ids, self._placeholders)
        if not bool(is_mm.any()):
            return self.embed_input_ids(input_ids)
        accepted = (
            hidden
            if captured is None
            else captured.reshape(-1, hidden.shape[-1])[:n]
        )
        return torch.where(
            is_mm[:, None], accepted.to(hidden.dtype), self.embed_input_ids(input_ids)
        )


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
