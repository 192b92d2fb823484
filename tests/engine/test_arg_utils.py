"""EngineArgs: validation, CLI mapping and how limits resolve against a model."""

from __future__ import annotations

import argparse

import pytest

from omnistage.engine.arg_utils import DEFAULT_MAX_MODEL_LEN_CAP, EngineArgs


def test_from_cli_args_maps_flags_and_keeps_defaults():
    ns = argparse.Namespace(
        model="/m", block_size=8, max_num_seqs=4, max_model_len=None, seed=None, no_prefix_caching=True, top_p=0.9
    )
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.block_size, args.max_num_seqs) == ("/m", 8, 4)
    assert args.max_model_len is None and args.seed == 0 and args.enable_prefix_caching is False
    assert EngineArgs.from_cli_args(argparse.Namespace(no_prefix_caching=False)).enable_prefix_caching


@pytest.mark.parametrize("field", ["block_size", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks"])
def test_out_of_range_values_are_rejected(field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(**{field: 0})


def test_max_model_len_resolution():
    assert EngineArgs().resolve_max_model_len(512) == 512
    assert EngineArgs().resolve_max_model_len(10**6) == DEFAULT_MAX_MODEL_LEN_CAP
    assert EngineArgs(max_model_len=100).resolve_max_model_len(512) == 100
    with pytest.raises(ValueError, match="max_model_len"):
        EngineArgs(max_model_len=1024).resolve_max_model_len(512)
