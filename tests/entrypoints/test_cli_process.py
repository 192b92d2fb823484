"""The ``omnistage`` command as a user runs it: a separate process, its exit status and what it prints.

Errors a user can fix are one line, never a traceback; ``serve`` checks its
port and its model before uvicorn starts; ``chat`` on a terminal survives
Ctrl-C while an answer streams (driven through a pseudo-terminal).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import torch

import omnistage
from omnistage.testing.tiny_checkpoints import write_tiny_checkpoint

ROOT = Path(omnistage.__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "omnistage.entrypoints.cli"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "llama"))


@pytest.fixture(scope="module")
def long_model_path(tmp_path_factory) -> str:
    """The tiny model with a context long enough that an answer streams for minutes."""
    path = write_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "long")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 16
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def _assert_one_line_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_version():
    result = _run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"omnistage {omnistage.__version__}"
    with open(ROOT / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == omnistage.__version__  # the package's own


def test_an_unknown_flag_prints_the_subcommands_usage():
    result = _run("generate", "--no-such-flag", "hi")
    assert result.returncode == 2
    assert "usage: omnistage generate" in result.stderr and "--no-such-flag" in result.stderr


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["generate", "--device", "tpu", "hi"], ["device", "tpu"]),
        pytest.param(["generate", "--device", "cuda", "hi"], ["cuda", "CUDA"],
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
        (["generate", "--file", "/no/such/prompts.txt"], ["/no/such/prompts.txt", "no such file"]),
        (["generate", "--tensor-parallel-size", "2", "hi"], ["tensor_parallel_size=2"]),
        (["serve", "/no/such/model"], ["/no/such/model", "does not exist"]),
    ],
)  # fmt: skip
def test_errors_are_one_line(argv, needles):
    _assert_one_line_error(_run(*argv), *needles)


def test_a_malformed_jsonl_line_names_the_file_and_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "fine"}\n\n{"prompt": "broken\n', encoding="utf-8")
    _assert_one_line_error(_run("generate", "--file", str(prompts)), f"{prompts}:3", "not valid JSON")


def test_serve_refuses_a_busy_port_before_loading_the_model(model_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _run("serve", model_path, "--port", str(port))
    _assert_one_line_error(result, f"127.0.0.1:{port}", "in use")
    assert "loading" not in result.stderr  # refused before the model loaded


def _read_until(stream, needle: str, timeout: float) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        assert time.monotonic() < deadline, f"no {needle!r} in {seen!r}"
        line = stream.readline()
        assert line, f"the process ended before {needle!r}: {seen!r}"
        seen += line
    return seen


def test_serve_takes_the_model_positionally_and_says_where_it_listens(model_path):
    proc = subprocess.Popen([*CLI, "serve", model_path, "--port", "0", "--log-level", "warning"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        seen = _read_until(proc.stderr, "listening on", timeout=300)
        loaded = next(line for line in seen.splitlines() if "loaded" in line)
        assert "loaded llama (float32, cpu) in " in loaded and "KV cache" in loaded and "context 512 tokens" in loaded
        url = seen.split("listening on ")[1].split()[0]
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
                    models = json.load(response)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert models["data"][0]["id"] == model_path
    finally:
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
    assert "Traceback" not in seen + rest


class _Terminal:
    """A child process on a pseudo-terminal, read without blocking."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = os.openpty()
        self.fd = master
        self.proc = subprocess.Popen(argv, env=_env(), stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.output = ""

    def expect(self, needle: str, timeout: float, start: int = 0) -> int:
        """Wait until ``needle`` appears after offset ``start``; return the offset after it."""
        deadline = time.monotonic() + timeout
        while (at := self.output.find(needle, start)) < 0:
            left = deadline - time.monotonic()
            assert left > 0, f"no {needle!r} after {start} in {self.output!r}"
            ready, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    chunk = b""
                assert chunk, f"the child ended before {needle!r}: {self.output!r}"
                self.output += chunk.decode("utf-8", "replace")
        return at + len(needle)

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        os.close(self.fd)


def test_chat_ctrl_c_stops_the_answer_and_returns_to_the_prompt(long_model_path):
    term = _Terminal([*CLI, "chat", "--model", long_model_path, "--max-model-len", str(1 << 16),
                      "--max-tokens", "60000", "--ignore-eos", "--num-kv-blocks", "4200"])  # fmt: skip
    try:
        at = term.expect("user> ", timeout=300)
        term.send("hello world!\n")
        at = term.expect("assistant> ", timeout=60, start=at)
        time.sleep(1.0)  # mid-answer: 60000 tokens take far longer
        term.proc.send_signal(signal.SIGINT)
        at = term.expect("[interrupted]", timeout=60, start=at)
        at = term.expect("user> ", timeout=60, start=at)
        assert term.proc.poll() is None  # still alive, back at the prompt
        term.send("/help\n")
        at = term.expect("/reset", timeout=30, start=at)
        at = term.expect("user> ", timeout=30, start=at)
        term.proc.send_signal(signal.SIGINT)  # Ctrl-C at the prompt ends the chat
        assert term.proc.wait(timeout=60) == 0
        assert "Traceback" not in term.output and "KeyboardInterrupt" not in term.output
    finally:
        term.close()
