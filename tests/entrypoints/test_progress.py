"""LLM.generate's progress bar: one step per finished request, token rates from real counts."""

from __future__ import annotations

import re

import pytest
import torch

from omnistage import LLM, SamplingParams
from omnistage.entrypoints import progress
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint

FRAME = re.compile(
    r"Processed prompts:.*?(\d+)/(\d+) \[.*est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s\]"
)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("ckpt") / "qwen2")
    yield LLM(str(path), block_size=4)
    torch.set_num_threads(threads)


def _frames(stderr: str) -> list[tuple[int, int, float, float]]:
    return [
        (int(m[1]), int(m[2]), float(m[3]), float(m[4]))
        for m in (FRAME.search(f) for f in stderr.split("\r"))
        if m
    ]


def test_bar_advances_once_per_finished_request(llm, capsys, monkeypatch):
    # Nothing but a finish may draw: then every frame after the first is one finish.
    monkeypatch.setattr(progress, "REDRAW_S", float("inf"))
    prompts = ["a b c d e f g h", "one two", "x y z", "hello there world"]
    lengths = (7, 2, 5, 3)  # ignore_eos: each request finishes in its own step
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    capsys.readouterr()
    outs = llm.generate(prompts, params)
    frames = _frames(capsys.readouterr().err)
    assert frames, "no progress bar was drawn"
    counts = [n for n, total, _, _ in frames]
    assert all(total == 4 for _, total, _, _ in frames)
    # The opening frame, one per finish, then close() redraws the last state.
    assert counts == [0, 1, 2, 3, 4, 4]

    # Rates share one elapsed time, so their ratio is the ratio of the real token counts.
    _, _, in_rate, out_rate = frames[-1]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == sum(lengths)
    assert in_rate > 0 and out_rate > 0
    assert in_rate / out_rate == pytest.approx(prompt_tokens / generated, rel=0.01)


def test_rates_move_between_finishes(llm, capsys, monkeypatch):
    """With redraws allowed every step, output tokens/s shows up before any request finishes."""
    monkeypatch.setattr(progress, "REDRAW_S", 0.0)
    capsys.readouterr()
    llm.generate(["a b c", "d e f"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    frames = _frames(capsys.readouterr().err)
    assert any(n == 0 and out_rate > 0 for n, _, _, out_rate in frames)


def test_no_bar_without_tqdm(llm, capsys):
    capsys.readouterr()
    llm.generate("a b c", SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
