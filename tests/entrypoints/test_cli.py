"""The ``omnistage`` command: generate (JSON lines) and chat (stdin)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.core import spec_policy
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
    # With --chat the prompt becomes a message's content: one that is neither text nor parts is named too.
    f.write_text(json.dumps({"prompt": 5}) + "\n" + json.dumps({"prompt": "hi"}) + "\n", encoding="utf-8")
    assert cli.main(["generate", "--model", model_path, "--max-tokens", "3", "--chat", "--file", str(f)]) == 0
    bad, good = _rows(capsys.readouterr().out)
    assert "messages[0].content" in bad["error"] and "got int" in bad["error"] and good["text"] is not None


@pytest.fixture(scope="module")
def copying_path(tmp_path_factory):
    """A tiny checkpoint whose attention output is zeroed: a bigram model, whose texts repeat
    themselves (so prompt lookup drafts, and sampled drafts are often kept)."""
    path = Path(write_tiny_checkpoint("llama", tmp_path_factory.mktemp("ckpt") / "copying"))
    for f in path.glob("*.safetensors"):
        weights = load_file(f)
        save_file({k: v * 0 if k.endswith("o_proj.weight") else v for k, v in weights.items()}, f)
    return str(path)


def test_generate_with_a_seed_repeats_itself_with_speculation(copying_path, capsys, monkeypatch):
    """Each request is seeded from --seed and its index: a sampled run repeats itself, and,
    since seeded verification draws once per emitted token, equals the run without
    speculation (the engine's shared generator would draw as many numbers as drafts verified,
    which the draft policy decides from step costs timed when the engine starts). Every
    proposal is verified here (a free verify step for the policy)."""
    monkeypatch.setenv("OMNISTAGE_MEASURE_STEP_COST", "0")
    monkeypatch.setattr(spec_policy, "DEFAULT_VERIFY_COSTS", {1: ((1, 1.0), (2, 1.0))})
    monkeypatch.setattr(spec_policy, "DEFAULT_DECODE_COSTS", ((1, 1.0), (2, 1.0)))
    monkeypatch.setattr(spec_policy, "DEFAULT_MIN_GAIN", 0.0)
    common = ["generate", "--model", copying_path, "--max-tokens", "24", "--temperature", "0.5", "--seed", "7",
              "one two three one two three one two", "hello hello hello", "--ignore-eos"]  # fmt: skip
    spec = ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3})]
    runs = []
    for extra in ([], spec, spec):
        assert cli.main([*common, *extra]) == 0
        runs.append([r["token_ids"] for r in _rows(capsys.readouterr().out)])
    assert runs[0] == runs[1] == runs[2] and runs[0][0] != runs[0][1]


def test_a_chat_template_that_refuses_the_conversation_is_an_error_line(model_path, tmp_path, capsys):
    """A template's own error (raise_exception, as templates refusing a system turn do) is the
    prompt's error, not a traceback: the other prompts still run."""
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}{% if m['content'] == 'no' %}{{ raise_exception('Refused by the template') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}",
        encoding="utf-8",
    )
    args = ["generate", "--model", model_path, "--max-tokens", "2", "--chat", "--chat-template", str(template)]
    assert cli.main([*args, "no", "hi"]) == 0
    bad, good = _rows(capsys.readouterr().out)
    assert "Refused by the template" in bad["error"] and good["text"] is not None


def test_generate_row_of_a_request_that_failed_in_the_engine_says_why(model_path, monkeypatch, capsys):
    from omnistage.worker.model_runner import ModelRunner

    real, calls = ModelRunner.execute_model, []

    def fails_second_step(self, so):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated kernel failure")
        return real(self, so)

    monkeypatch.setattr(ModelRunner, "execute_model", fails_second_step)
    assert cli.main(["generate", "--model", model_path, "--max-tokens", "4", "--ignore-eos", "hello there"]) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert row["finish_reason"] == "error" and "simulated kernel failure" in row["error"]


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


def test_a_malformed_jsonl_line_is_named_by_file_and_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hi"}) + "\n" + '{"prompt": oops}\n', encoding="utf-8")
    assert cli.main(["generate", "--file", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}:2: not valid JSON" in err and "Traceback" not in err
    f.write_text(json.dumps({"text": "hi"}) + "\n", encoding="utf-8")
    assert cli.main(["generate", "--file", str(f)]) == 2
    assert f"{f}:1: a JSON line needs a 'prompt' key" in capsys.readouterr().err


def test_generate_with_audio_dir_warns_for_a_model_that_cannot_speak(model_path, tmp_path, capsys):
    audio = tmp_path / "audio"
    assert cli.main(["generate", "--model", model_path, "--max-tokens", "2", "--audio-dir", str(audio), "hi"]) == 0
    captured = capsys.readouterr()
    assert "cannot speak" in captured.err and "--audio-dir is ignored" in captured.err
    assert not audio.exists() and "audio_path" not in _rows(captured.out)[0]


def test_chat_commands_and_the_cut_off_mark(model_path, monkeypatch, capsys):
    # The same message before and after /reset: the same prompt, so the history was dropped.
    lines = "hello world!\n/help\n/reset\nhello world!\n/nope\n/exit\nnever answered\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    args = ["chat", "--model", model_path, "--max-tokens", "3", "--ignore-eos", "--stats"]
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and captured.out.count("\n") == 2  # two answers, each on its line
    assert "/reset" in captured.err and "[new conversation]" in captured.err and "unknown command /nope" in captured.err
    assert captured.err.count("[cut off: the answer reached the token limit (3 tokens, --max-tokens 3)]") == 2
    stats = [line for line in captured.err.splitlines() if line.startswith("[turn")]
    prompt_lengths = [line.split("/")[1].split()[0] for line in stats]
    assert len(stats) == 2 and prompt_lengths[0] == prompt_lengths[1]


def test_ctrl_c_while_streaming_aborts_the_request_and_frees_its_kv(model_path):
    import signal

    from omnistage.entrypoints.llm import LLM

    engine = LLM(model=model_path, block_size=4).llm_engine
    step, calls = engine.step, []

    def step_then_ctrl_c():
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # as a terminal's Ctrl-C: delivered to this (main) thread
        return step()

    engine.step = step_then_ctrl_c
    params = cli.SamplingParams(max_tokens=200, ignore_eos=True)
    out = io.StringIO()
    assert cli.stream_answer(engine, "r", "hello world!", params, out) is None
    assert len(calls) == 3 and out.getvalue().endswith("\n")
    # The request is gone and its KV freed at once; its batch row goes at the next step.
    assert not engine.scheduler.has_unfinished_requests() and engine.get_stats().kv_blocks_used == 0
    engine.step = step
    final = cli.stream_answer(engine, "r", "hello world!", cli.SamplingParams(max_tokens=3, ignore_eos=True), out)
    assert final is not None and len(final.outputs[0].token_ids) == 3  # the engine serves on


def test_llm_takes_vllm_arguments_tokenizer_and_chat_template(model_path, tmp_path):
    from transformers import AutoTokenizer

    from omnistage.entrypoints.llm import LLM

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    tokenizer.save_pretrained(tokenizer_dir)
    llm = LLM(model=model_path, tensor_parallel_size=1, enforce_eager=True, trust_remote_code=True,
              gpu_memory_utilization=0.9, disable_log_stats=True, chat_template=template)  # fmt: skip
    messages = [{"role": "user", "content": "hi"}]
    assert llm.llm_engine.apply_chat_template(messages) == "<user>hi"
    assert LLM(model=model_path, tokenizer=str(tokenizer_dir)).llm_engine.apply_chat_template(messages) == "[hi]"
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLM(model=model_path, tensor_parallel_size=2)


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory):
    from omnistage.testing.tiny_omni_checkpoint import write_tiny_qwen2_5_omni

    return str(write_tiny_qwen2_5_omni(tmp_path_factory.mktemp("omni") / "omni"))


def test_generate_on_an_omni_checkpoint_writes_audio_only_when_asked(omni_path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    common = ["generate", "--model", omni_path, "--max-tokens", "3", "--talker-max-tokens", "8", "hi"]
    assert cli.main(common) == 0
    (row,) = _rows(capsys.readouterr().out)
    assert "audio_path" not in row and not list(tmp_path.rglob("*.wav"))
    assert cli.main([*common, "--audio-dir", "speech"]) == 0
    captured = capsys.readouterr()
    (row,) = _rows(captured.out)
    assert row["audio_path"] == str(Path("speech") / "0.wav") and (tmp_path / "speech" / "0.wav").stat().st_size > 44
    assert "wrote 1 spoken answer(s) to speech/" in captured.err
