"""EngineArgs: validation, the flags it generates, vLLM's options, and how limits resolve against a model."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import pytest
import torch

from omnistage.core.config import SchedulerConfig
from omnistage.engine import arg_utils
from omnistage.engine.arg_utils import DEFAULT_MAX_MODEL_LEN_CAP, EngineArgs


@pytest.fixture(autouse=True)
def _fresh_warnings():
    arg_utils._warned.clear()  # each test sees its own once-per-process warnings
    yield
    arg_utils._warned.clear()


def _parser(**kw) -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser(prog="t"), **kw)


def test_every_field_is_a_flag_with_the_fields_default():
    parser = _parser()
    parsed = parser.parse_args([])
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in parser._option_string_actions, f.name
        assert getattr(parsed, f.name) == f.default, f.name
    assert EngineArgs.from_cli_args(parsed) == EngineArgs()
    text = parser.format_help()
    assert "--max-num-seqs N" in text and "(default: 64)" in text  # defaults shown in --help
    assert "--kv-cache-memory-bytes" in text and "--encoder-cache-size" in text  # options no flag exposed before


def test_flags_map_to_fields_with_their_types():
    argv = ["--model", "/m", "--block-size", "8", "--max-num-seqs", "4", "--kv-cache-memory-bytes", "1000000",
            "--max-num-batched-encoder-embeds", "300", "--no-enable-encoder-cache", "--seed", "5"]  # fmt: skip
    args = EngineArgs.from_cli_args(_parser().parse_args(argv))
    assert (args.model, args.block_size, args.max_num_seqs, args.seed) == ("/m", 8, 4, 5)
    assert args.kv_cache_memory_bytes == 1_000_000 and args.max_num_batched_encoder_embeds == 300
    assert args.enable_encoder_cache is False and args.max_model_len is None


@pytest.mark.parametrize(
    "argv, expected",
    [([], True), (["--no-enable-prefix-caching"], False), (["--no-prefix-caching"], False),
     (["--enable-prefix-caching"], True)],
)  # fmt: skip
def test_prefix_caching_flags_vllm_spelling_and_the_old_one(argv, expected):
    assert EngineArgs.from_cli_args(_parser().parse_args(argv)).enable_prefix_caching is expected


def test_unset_flags_keep_the_defaults():
    ns = argparse.Namespace(model="/m", max_model_len=None, seed=None, top_p=0.9)
    assert EngineArgs.from_cli_args(ns) == EngineArgs(model="/m")
    assert EngineArgs.cli_kwargs(ns) == {"model": "/m"}  # what LLM(**kwargs) gets: only what was set


def test_model_positional_or_flag():
    parser = _parser(model_positional=True)
    assert EngineArgs.cli_kwargs(parser.parse_args(["/a"])) == {"model": "/a"}
    assert EngineArgs.cli_kwargs(parser.parse_args(["--model", "/a"])) == {"model": "/a"}
    assert EngineArgs.cli_kwargs(parser.parse_args(["/a", "--model", "/a"])) == {"model": "/a"}
    with pytest.raises(ValueError, match="twice"):
        EngineArgs.cli_kwargs(parser.parse_args(["/a", "--model", "/b"]))


def test_scheduler_config_default_agrees_with_engine_args():
    assert SchedulerConfig().max_num_seqs == EngineArgs().max_num_seqs


@pytest.mark.parametrize("field", ["block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"])
def test_out_of_range_values_are_rejected(field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: 0})


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 1.0, True])
def test_a_seed_torch_cannot_take_is_rejected(seed):
    with pytest.raises(ValueError, match=r"EngineArgs\.seed is out of range"):
        EngineArgs(seed=seed)


def test_vllm_arguments_are_accepted_and_ignored_ones_warn_once(caplog):
    caplog.set_level(logging.WARNING, logger="omnistage")
    vllm_script = dict(tensor_parallel_size=1, pipeline_parallel_size=1, enforce_eager=True, trust_remote_code=True,
                       disable_log_stats=True, gpu_memory_utilization=0.9, enable_chunked_prefill=True)  # fmt: skip
    EngineArgs(**vllm_script)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned  # trust_remote_code, gpu_memory_utilization on CPU
    assert all("\n" not in w and "ignored" in w for w in warned)
    assert any("trust_remote_code" in w for w in warned) and any("gpu_memory_utilization" in w for w in warned)
    EngineArgs(**vllm_script)
    assert len(caplog.records) == 2  # once per process


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallelism_that_cannot_be_honoured_is_refused(field):
    with pytest.raises(ValueError, match=f"{field}=2 cannot be honoured"):
        EngineArgs(**{field: 2})


def test_data_parallel_size_is_honoured_and_bounded():
    """Replicas on Ray (engine/distributed); the flag parses like every other field."""
    assert EngineArgs(data_parallel_size=3).data_parallel_size == 3
    with pytest.raises(ValueError, match="data_parallel_size is out of range"):
        EngineArgs(data_parallel_size=0)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--data-parallel-size", "2"])).data_parallel_size == 2


def test_gpu_memory_utilization_must_be_a_fraction():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(gpu_memory_utilization=1.5)


def test_gpu_memory_utilization_sizes_the_kv_pool_on_cuda(monkeypatch):
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * gib, 10 * gib))
    args = EngineArgs(gpu_memory_utilization=0.9, max_num_seqs=10**6)
    args.device = "cuda"  # as if on a CUDA machine (the check at construction would refuse it here)
    # 90% of 10 GiB may be in use; 4 GiB are: 5 GiB for KV blocks of 1 MiB.
    assert args.resolve_num_kv_blocks(1024**2, max_model_len=4096) == 5 * 1024
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gib, 10 * gib))
    with pytest.raises(ValueError, match="leaves no memory for the KV cache"):
        args.resolve_num_kv_blocks(1024**2, max_model_len=4096)
    args.kv_cache_memory_bytes = 3 * 1024**2  # an explicit budget wins
    assert args.resolve_num_kv_blocks(1024**2, max_model_len=4096) == 3


def test_a_kv_pool_larger_than_the_machine_is_refused():
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_block = 737280  # the embedded default's: 30 layers x 16 tokens x 3 heads x 64 x (k, v) x fp32
    assert EngineArgs(num_kv_blocks=machine // per_block).resolve_num_kv_blocks(per_block, 8192) == machine // per_block
    # before: accepted, and the engine hung building a free list of 10^9 blocks until it ran out of memory
    with pytest.raises(ValueError, match=r"EngineArgs.num_kv_blocks=1000000000 needs 686645.5 GiB of KV cache"):
        EngineArgs(num_kv_blocks=10**9).resolve_num_kv_blocks(per_block, 8192)


def test_a_block_larger_than_the_kv_budget_names_block_size():
    per_token = 46080  # the embedded default's KV bytes per token
    with pytest.raises(ValueError, match=r"holds no block of 46080000000 bytes \(EngineArgs.block_size=1000000 tokens\)"):
        EngineArgs(block_size=10**6).resolve_num_kv_blocks(per_token * 10**6, 8192)


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "meta"])
def test_unusable_devices_are_refused(device):
    with pytest.raises(ValueError, match="EngineArgs.device"):
        EngineArgs(device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="CUDA"):
        EngineArgs(device="cuda")


def test_chat_template_and_tokenizer_options(tmp_path):
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        EngineArgs(chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="tokenizer"):
        EngineArgs(tokenizer=str(tmp_path / "nowhere"))
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(inline, encoding="utf-8")

    class Tok:
        chat_template = "original"

    assert EngineArgs(chat_template=inline).customize_tokenizer(Tok()).chat_template == inline
    assert EngineArgs(chat_template=str(path)).customize_tokenizer(Tok()).chat_template == inline
    assert EngineArgs().customize_tokenizer(Tok()).chat_template == "original"


def test_max_model_len_resolution():
    assert EngineArgs().resolve_max_model_len(512) == 512
    assert EngineArgs().resolve_max_model_len(10**6) == DEFAULT_MAX_MODEL_LEN_CAP
    assert EngineArgs(max_model_len=100).resolve_max_model_len(512) == 100
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(max_model_len=1024).resolve_max_model_len(512)


def test_a_token_table_larger_than_the_machine_is_refused():
    """max_num_seqs rows of max_model_len int64 token ids: past the machine's memory numpy would fail
    with a bare MemoryError naming no field."""
    machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fits = machine // (8192 * 8)
    assert EngineArgs(max_num_seqs=fits).resolve_max_model_len(8192) == 8192
    with pytest.raises(ValueError, match=r"max_num_seqs=10000000 with max_model_len=8192 needs 610\.4 GiB"):
        EngineArgs(max_num_seqs=10**7).resolve_max_model_len(10**6)
