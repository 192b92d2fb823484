"""The ``omnistage`` command: generate (JSON lines) and chat (stdin)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from omnistage.entrypoints import cli
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield str(write_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama"))
    torch.set_num_threads(threads)


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_generate_arguments_and_file(model_path, tmp_path, capsys):
    plain = tmp_path / "prompts.txt"
    plain.write_text("what is the capital of france?\n\nhello world!\n", encoding="utf-8")
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"id": "x", "prompt": "hello world!"}) + "\n", encoding="utf-8")
    common = ["--model", model_path, "--max-tokens", "5", "--block-size", "4"]
    assert cli.main(["generate", *common, "hello world!", "one two", "--file", str(plain)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert [r["id"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["prompt"] for r in rows] == ["hello world!", "one two", "what is the capital of france?", "hello world!"]
    for r in rows:
        assert set(r) == {"id", "prompt", "text", "token_ids", "finish_reason", "num_cached_tokens"}
        assert 1 <= len(r["token_ids"]) <= 5 and r["finish_reason"] in ("stop", "length")
    assert rows[3]["token_ids"] == rows[0]["token_ids"]  # greedy by default
    assert cli.main(["generate", *common, "--file", str(jsonl), "--no-prefix-caching", "--seed", "3"]) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row["id"] == "x" and row["num_cached_tokens"] == 0


def test_generate_reports_a_bad_prompt_and_runs_the_rest(model_path, tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": ""}) + "\n" + json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    assert cli.main(["generate", "--model", model_path, "--max-tokens", "3", "--file", str(f)]) == 0
    bad, good = _rows(capsys.readouterr().out)
    assert "empty" in bad["error"] and good["text"] is not None


def test_chat_reads_stdin_turns(model_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world!\n\nwhat is the capital of france?\n"))
    args = ["chat", "--model", model_path, "--max-tokens", "6", "--block-size", "4", "--stats", "--temperature", "0"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") >= 2  # one line (at least) per answer
    stats = [line for line in captured.err.splitlines() if line.startswith("[turn")]
    assert len(stats) == 2
    # The second turn's prompt starts with the first turn: its full blocks are cached.
    cached = int(stats[1].split(":")[1].split("/")[0])
    assert cached > 0


def test_parser_has_serve_when_the_server_is_installed():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"generate", "chat"} <= set(sub.choices)
    if cli._serve_hooks() is not None:
        assert "serve" in sub.choices


def test_bad_parameters_exit_with_a_one_line_error(model_path, capsys):
    assert cli.main(["generate", "--model", model_path, "--top-p", "0", "hi"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "Traceback" not in err
