"""Helpers for the server tests: starting a server, small media payloads."""

from __future__ import annotations

import base64
import io
import struct
import time
from pathlib import Path

import numpy as np
from PIL import Image

from omnistage.engine.arg_utils import EngineArgs
from omnistage.entrypoints.openai.api_server import ServerOptions, ServerThread, build_app


def png_bytes(width: int = 8, height: int = 6, color: tuple[int, int, int] = (200, 30, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(width: int = 8, height: int = 6) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(width, height)).decode()


def wav_bytes(
    samples: np.ndarray, sample_rate: int = 16000, bits: int = 16, float_format: bool = False, channels: int = 1
) -> bytes:
    """A RIFF/WAVE file; ``samples`` in [-1, 1], shape (frames,) or (frames, channels)."""
    x = np.asarray(samples, dtype=np.float64).reshape(-1, channels)
    if float_format:
        data = x.astype("<f4" if bits == 32 else "<f8").tobytes()
        tag = 3
    elif bits == 8:
        data = np.clip(np.round(x * 127 + 128), 0, 255).astype(np.uint8).tobytes()
        tag = 1
    elif bits == 24:
        ints = np.clip(np.round(x * (2**23 - 1)), -(2**23), 2**23 - 1).astype("<i4").reshape(-1)
        data = b"".join(struct.pack("<i", int(v))[:3] for v in ints)
        tag = 1
    else:
        dtype = "<i2" if bits == 16 else "<i4"
        data = np.round(x * (2 ** (bits - 1) - 1)).astype(dtype).tobytes()
        tag = 1
    block_align = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, sample_rate, sample_rate * block_align, block_align, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def wav_b64(seconds: float = 0.1, sample_rate: int = 16000) -> str:
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    return base64.b64encode(wav_bytes(0.5 * np.sin(2 * np.pi * 440 * t), sample_rate)).decode()


TINY_MODEL_NAME = "tiny-llama"
TINY_MEDIA_MODEL_NAME = "tiny-omni-thinker"  # conftest's media_server: takes images and audio
# Small limits so the hardening tests need only small payloads.
TEST_MAX_IMAGE_PIXELS = 64 * 64
TEST_MAX_AUDIO_SECONDS = 1.0
TEST_MAX_BODY_BYTES = 1024 * 1024
TEST_MAX_MODEL_LEN = 256


class Server:
    """A running test server: its URL, its app (for engine stats) and helpers."""

    def __init__(self, thread: ServerThread, app, model: str, media_dir: Path | None = None) -> None:
        self.thread = thread
        self.app = app
        self.model = model
        self.media_dir = media_dir

    @property
    def base_url(self) -> str:
        return self.thread.base_url

    @property
    def v1(self) -> str:
        return self.thread.base_url + "/v1"

    def engine_stats(self):
        return self.app.state.engine_client.call_sync(lambda e: e.get_stats())

    def wait_idle(self, timeout: float = 15.0):
        """Wait until the engine holds no request and no KV block; returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            busy = self.app.state.engine_client.call_sync(lambda e: e.has_unfinished_requests())
            stats = self.engine_stats()
            if (not busy and stats.kv_blocks_used == 0) or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


def start_server(model_path: Path | None, name: str | None, media_dir: Path | None = None, **options) -> tuple[ServerThread, object]:
    engine_args = EngineArgs(
        model=str(model_path) if model_path else None,
        max_model_len=TEST_MAX_MODEL_LEN if model_path else 512,
        max_num_seqs=64,
        max_num_batched_tokens=1024,
    )
    opts = ServerOptions(
        served_model_names=[name] if name else None,
        allowed_local_media_path=str(media_dir) if media_dir else None,
        **options,
    )
    app = build_app(engine_args, opts)
    return ServerThread(app).start(), app


def metric_samples(text: str) -> dict[str, float]:
    """``/metrics`` text as ``{sample name with labels: value}`` (comment lines skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out
