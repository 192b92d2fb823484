"""Servers for the OpenAI-server tests: uvicorn in a background thread on a free
loopback port, serving tiny local checkpoints (built once per session).

``server`` runs a text-only model; ``media_server`` a model that takes images
and audio, for the tests of how media is decoded (a text-only model refuses
any media part before decoding it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint
from omnistage.testing.tiny_mm_checkpoints import write_tiny_qwen2_5_omni_thinker

from oai_helpers import (
    TEST_MAX_AUDIO_SECONDS,
    TEST_MAX_BODY_BYTES,
    TEST_MAX_IMAGE_PIXELS,
    TINY_MEDIA_MODEL_NAME,
    TINY_MODEL_NAME,
    Server,
    start_server,
)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core
    machine the thread barriers cost more than the math."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_ckpts")
    return {arch: write_tiny_checkpoint(arch, root / arch) for arch in ("llama", "qwen2", "qwen3")}


def _serve_with_test_limits(model_path: Path, name: str, media_dir: Path) -> Iterator[Server]:
    """A server on ``model_path`` with the tests' small media and body limits."""
    thread, app = start_server(
        model_path,
        name,
        media_dir,
        max_image_pixels=TEST_MAX_IMAGE_PIXELS,
        max_audio_seconds=TEST_MAX_AUDIO_SECONDS,
        max_request_body_bytes=TEST_MAX_BODY_BYTES,
    )
    try:
        yield Server(thread, app, name, media_dir)
    finally:
        thread.stop()


@pytest.fixture(scope="session")
def server(tiny_checkpoints, tmp_path_factory) -> Iterator[Server]:
    """The shared tiny-llama server, with small media and body limits."""
    yield from _serve_with_test_limits(tiny_checkpoints["llama"], TINY_MODEL_NAME, tmp_path_factory.mktemp("media"))


@pytest.fixture(scope="session")
def media_server(tmp_path_factory) -> Iterator[Server]:
    """A tiny Qwen2.5-Omni thinker (text, image, video and audio in) with the
    shared server's media and body limits and its own local media folder."""
    path = write_tiny_qwen2_5_omni_thinker(tmp_path_factory.mktemp("tiny_omni_thinker"))
    yield from _serve_with_test_limits(Path(path), TINY_MEDIA_MODEL_NAME, tmp_path_factory.mktemp("media_for_omni"))


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
