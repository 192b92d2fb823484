"""Engine arguments: the one source of the engine's options, their defaults and their flags.

``EngineArgs`` is what ``LLM(**kwargs)`` takes and what ``omnistage generate``,
``chat`` and ``serve`` expose as flags (``EngineArgs.add_cli_args``): each field
is a flag of the same name (``max_num_seqs`` -> ``--max-num-seqs``), its help
and default taken from the field, booleans as ``--x/--no-x``.

A few fields exist so that a vLLM script or command line runs unchanged
(``tensor_parallel_size=1``, ``trust_remote_code``, ...). Policy for them: a
value this engine honours is accepted silently, a value it ignores is accepted
with a one-line warning (once per process), a value it cannot honour
(``tensor_parallel_size=2``) is refused with ``ValueError``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from omnistage.core.spec_decode import SpeculativeConfig
from omnistage.sampling_params import SEED_MAX, SEED_MIN

__all__ = ["DEFAULT_MAX_MODEL_LEN_CAP", "EngineArgs"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN_CAP = 8192
DEFAULT_KV_CACHE_BYTES_CPU = 512 * 1024**2
DEFAULT_KV_CACHE_BYTES_GPU = 4 * 1024**3
TOKEN_ID_BYTES = 8  # the runner's host table of token ids is int64 (worker/input_batch.py)

_ENGINE = "model and engine"
_VLLM = "accepted for vLLM scripts"


def _option(default: Any, help: str, group: str = _ENGINE) -> Any:
    """A field with its flag's help text (and the help group it is listed in)."""
    return field(default=default, metadata={"help": help, "group": group})


@dataclass
class EngineArgs:
    """Everything needed to build an ``LLMEngine``.

    ``num_kv_blocks`` wins over ``kv_cache_memory_bytes``, which wins over
    ``gpu_memory_utilization`` (accelerators only); with none of them the KV
    pool gets a default byte budget (512 MiB on CPU, 4 GiB on an accelerator),
    never more than ``max_num_seqs`` full-length requests need.
    ``max_model_len=None`` takes the model's context length, capped at 8192.

    Multimodal models: ``encoder_cache_size`` (encoder embeddings held) and
    ``max_num_batched_encoder_embeds`` (embeddings encoded per step) default
    to ``max_num_batched_tokens`` and are raised to the largest item the model
    accepts. ``enable_encoder_cache=False`` keeps no encoder output beyond its
    last user (no reuse across requests).
    """

    model: str | None = _option(
        None, "checkpoint folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = _option(None, "tokenizer folder, if not the model's own")
    chat_template: str | None = _option(
        None, "chat template: a Jinja file, or the template text itself (default: the tokenizer's)"
    )
    dtype: str = _option("float32", "weights and activations: float32, bfloat16 or float16")
    device: str = _option("cpu", "cpu, cuda or cuda:N")
    seed: int = _option(0, "seeds the engine's sampling (requests without their own seed)")
    block_size: int = _option(16, "tokens per KV block")
    num_kv_blocks: int | None = _option(None, "KV pool size in blocks (default: sized from a memory budget)")
    kv_cache_memory_bytes: int | None = _option(
        None, "KV pool budget in bytes (default: 512 MiB on CPU, 4 GiB on an accelerator)"
    )
    gpu_memory_utilization: float | None = _option(
        None, "accelerators: size the KV pool so the device's memory in use ends at this fraction"
    )
    max_num_batched_tokens: int = _option(2048, "tokens per engine step (decodes plus prefill chunks)")
    max_num_seqs: int = _option(64, "requests running at once")
    max_model_len: int | None = _option(None, "context length (default: the model's, capped at 8192)")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of a prompt prefix seen before")
    encoder_cache_size: int | None = _option(
        None,
        "multimodal: encoder embeddings held (default: max-num-batched-encoder-embeds, else max-num-batched-tokens;"
        " at least one item)",
    )
    max_num_batched_encoder_embeds: int | None = _option(
        None, "multimodal: encoder embeddings computed per step (default: max-num-batched-tokens, at least one item)"
    )
    enable_encoder_cache: bool = _option(True, "multimodal: reuse encoder outputs across requests")
    num_encoder_workers: int = _option(
        0,
        "multimodal: encoder-only Ray actors (towers only) that encode each request's media as soon as it is "
        "admitted; 0 encodes in the engine. A Ray cluster is used through RAY_ADDRESS, else a local instance",
    )
    encoder_worker_timeout_s: float = _option(
        10.0, "multimodal: an item an encoder worker has not published by then is encoded in the engine"
    )
    speculative_config: dict[str, Any] | None = _option(
        None,
        'speculative decoding, off when unset; a JSON object: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": N, "prompt_lookup_min": M} or {"method": "eagle", "model": "<head folder>", '
        '"num_speculative_tokens": K}',
    )
    data_parallel_size: int = _option(
        1,
        "engine replicas, each a Ray actor, behind this one engine; requests go to the replica caching their "
        "longest prefix, else the least loaded (Ray: a local instance, or the cluster RAY_ADDRESS names)",
    )
    # vLLM's options, for scripts written against it (module docstring: policy).
    tensor_parallel_size: int = _option(1, "must be 1: one device per model", _VLLM)
    pipeline_parallel_size: int = _option(1, "must be 1: one device per model", _VLLM)
    enforce_eager: bool = _option(False, "always true here: no CUDA graphs are captured", _VLLM)
    enable_chunked_prefill: bool | None = _option(None, "always on here: long prompts are prefilled in chunks", _VLLM)
    trust_remote_code: bool = _option(False, "ignored: checkpoint code never runs, only built-in models", _VLLM)
    disable_log_stats: bool = _option(False, "the server logs no periodic stats line (offline use logs none)", _VLLM)

    def __post_init__(self) -> None:
        checks = [
            ("block_size", self.block_size >= 1),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1),
            ("max_num_seqs", self.max_num_seqs >= 1),
            ("data_parallel_size", self.data_parallel_size >= 1),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1),
            ("kv_cache_memory_bytes", self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes >= 1),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2),
            ("encoder_cache_size", self.encoder_cache_size is None or self.encoder_cache_size >= 1),
            (
                "max_num_batched_encoder_embeds",
                self.max_num_batched_encoder_embeds is None or self.max_num_batched_encoder_embeds >= 1,
            ),
            ("gpu_memory_utilization", self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1),
            ("num_encoder_workers", self.num_encoder_workers >= 0),
            ("encoder_worker_timeout_s", self.encoder_worker_timeout_s > 0),
            ("seed", type(self.seed) is int and SEED_MIN <= self.seed <= SEED_MAX),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"EngineArgs.{name} is out of range: {getattr(self, name)!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise ValueError(
                    f"EngineArgs.{name}={getattr(self, name)!r} cannot be honoured: omnistage runs one model "
                    "on one device in one process; use 1"
                )
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # its ValueError names the key
        check_device(self.device)
        self._check_files()
        self._warn_ignored()

    def _check_files(self) -> None:
        """Fail before any weight loads when a named tokenizer or template is missing."""
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().is_dir():
            raise ValueError(f"EngineArgs.tokenizer={self.tokenizer!r} is not a folder (a local tokenizer is expected)")
        if self.chat_template is not None:
            self.chat_template_text()

    def _warn_ignored(self) -> None:
        if self.trust_remote_code:
            _warn_once("trust_remote_code is ignored: omnistage runs its built-in models, never a checkpoint's code")
        if self.enable_chunked_prefill is False:
            _warn_once("enable_chunked_prefill=False is ignored: omnistage always prefills long prompts in chunks")
        if self.gpu_memory_utilization is not None and _device_type(self.device) != "cuda":
            _warn_once(
                f"gpu_memory_utilization is ignored on {self.device!r}: it sizes the KV pool on CUDA devices; "
                "use kv_cache_memory_bytes or num_kv_blocks"
            )

    # -- the command line --------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
        """Add one flag per field, in help groups; defaults are the fields' own.

        ``model_positional`` also takes the model as the first positional
        argument (``omnistage serve MODEL``, as ``vllm serve`` does)."""
        hints = typing.get_type_hints(cls)
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in fields(cls):
            group_name = f.metadata["group"]
            if group_name not in groups:
                groups[group_name] = parser.add_argument_group(group_name)
            group = groups[group_name]
            flag = "--" + f.name.replace("_", "-")
            kind = _flag_type(hints[f.name])
            default = _default(f)
            text = f.metadata["help"] + ("" if default is None else f" (default: {default})")
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
            elif typing.get_origin(kind) is dict or kind is dict:
                group.add_argument(flag, type=_json_object(flag), default=default, help=text, metavar="JSON")
            else:
                metavar = {int: "N", float: "X"}.get(kind, f.name.removeprefix("chat_").upper())
                group.add_argument(flag, type=kind, default=default, help=text, metavar=metavar)
        engine = groups[_ENGINE]
        # The flag of earlier omnistage releases.
        engine.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                            help="same as --no-enable-prefix-caching")  # fmt: skip
        if model_positional:
            engine.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
        return parser

    @classmethod
    def cli_kwargs(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The fields the command line set to other than their defaults, as
        ``LLM(**kwargs)`` takes them. A positional model (``model_tag``) counts
        as ``--model``; giving both, differently, is an error."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            value = getattr(args, f.name, None)
            if value is not None and value != _default(f):
                kwargs[f.name] = value
        tag = getattr(args, "model_tag", None)
        if tag is not None:
            if kwargs.get("model", tag) != tag:
                raise ValueError(f"the model is given twice, as {tag!r} and as --model {kwargs['model']!r}")
            kwargs["model"] = tag
        return kwargs

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Fields from flags of the same name (``--block-size`` -> ``block_size``);
        flags left unset (None) keep the fields' defaults."""
        return cls(**cls.cli_kwargs(args))

    # -- the tokenizer -------------------------------------------------------------

    def chat_template_text(self) -> str | None:
        """``chat_template`` as template text: a file's contents, or the option
        itself when it already is a Jinja template (holds ``{{`` or ``{%``)."""
        if self.chat_template is None:
            return None
        if "{{" in self.chat_template or "{%" in self.chat_template:
            return self.chat_template
        path = Path(self.chat_template).expanduser()
        if not path.is_file():
            raise ValueError(
                f"EngineArgs.chat_template={self.chat_template!r} is neither a file nor a Jinja template"
            )
        return path.read_text(encoding="utf-8")

    def customize_tokenizer(self, tokenizer: Any) -> Any:
        """The tokenizer the engine runs: the checkpoint's ``tokenizer``, or the
        one in the ``tokenizer`` folder, with ``chat_template`` as its template."""
        if self.tokenizer is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(Path(self.tokenizer).expanduser())
        template = self.chat_template_text()
        if template is not None:
            tokenizer.chat_template = template
        return tokenizer

    # -- limits resolved against the loaded model ------------------------------------

    def resolve_max_model_len(self, model_max_len: int | None) -> int:
        limit = model_max_len or DEFAULT_MAX_MODEL_LEN_CAP
        if self.max_model_len is None:
            max_model_len = min(limit, DEFAULT_MAX_MODEL_LEN_CAP)
        elif self.max_model_len > limit:
            raise ValueError(
                f"EngineArgs.max_model_len={self.max_model_len} exceeds the model's context length {limit}"
            )
        else:
            max_model_len = self.max_model_len
        # The runner keeps every running request's token ids on the host, max_model_len of them a
        # row: a table the machine cannot hold would otherwise fail deep inside numpy, naming no field.
        needed, total = self.max_num_seqs * max_model_len * TOKEN_ID_BYTES, _device_memory("cpu")
        if needed > total:
            raise ValueError(
                f"EngineArgs.max_num_seqs={self.max_num_seqs} with max_model_len={max_model_len} needs "
                f"{needed / 2**30:.1f} GiB of host memory for the running requests' token ids "
                f"({TOKEN_ID_BYTES} bytes per position), more than the machine's {total / 2**30:.1f} GiB; "
                "lower max_num_seqs or max_model_len"
            )
        return max_model_len

    def resolve_num_kv_blocks(self, bytes_per_block: int, max_model_len: int) -> int:
        if self.num_kv_blocks is not None:
            # A pool the device cannot hold would not fail at once (a CPU tensor's pages are only
            # committed when written) but hang building its free list, then die out of memory.
            needed, total = self.num_kv_blocks * bytes_per_block, _device_memory(self.device)
            if needed > total:
                raise ValueError(
                    f"EngineArgs.num_kv_blocks={self.num_kv_blocks} needs {needed / 2**30:.1f} GiB of KV cache "
                    f"({bytes_per_block} bytes per block), more than the {total / 2**30:.1f} GiB of memory on "
                    f"{self.device}"
                )
            return self.num_kv_blocks
        budget = self.kv_cache_memory_bytes
        if budget is None and self.gpu_memory_utilization is not None and _device_type(self.device) == "cuda":
            budget = _cuda_budget(self.device, self.gpu_memory_utilization)
        if budget is None:
            budget = DEFAULT_KV_CACHE_BYTES_CPU if self.device == "cpu" else DEFAULT_KV_CACHE_BYTES_GPU
        blocks_per_seq = -(-max_model_len // self.block_size)
        num_blocks = min(budget // bytes_per_block, self.max_num_seqs * blocks_per_seq)
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds no block of {bytes_per_block} bytes (EngineArgs.block_size="
                f"{self.block_size} tokens); lower block_size or raise kv_cache_memory_bytes"
            )
        return int(num_blocks)


def check_device(device: str) -> None:
    """Raise ``ValueError`` naming the problem unless torch can run on ``device`` here."""
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"EngineArgs.device={device!r} is not a device; expected cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        backend = getattr(torch, parsed.type, None)
        if backend is None or not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"EngineArgs.device={device!r} is not available here; expected cpu, cuda or cuda:N")
        return
    if torch.version.cuda is None and torch.version.hip is None:
        raise ValueError(
            f"EngineArgs.device={device!r}: this torch build ({torch.__version__}) has no CUDA support; use cpu"
        )
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(f"EngineArgs.device={device!r}: no CUDA device is visible to this process")
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"EngineArgs.device={device!r}: only {count} CUDA device(s) are visible")


def _device_type(device: str) -> str:
    return device.split(":", 1)[0]


def _device_memory(device: str) -> int:
    """Bytes of memory ``device`` has in all (the machine's physical memory for the CPU)."""
    if _device_type(device) == "cuda":
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cuda_budget(device: str, utilization: float) -> int:
    """Bytes left for the KV pool when the device's memory in use (the weights,
    other processes) may grow to ``utilization`` of its total."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    budget = int(total * utilization) - (total - free)
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
            f"{(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB are in use already"
        )
    return budget


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _default(f: Field) -> Any:
    return None if f.default is MISSING else f.default


def _json_object(flag: str) -> Any:
    """The converter of a dict flag's text: a JSON object, or an error naming the flag."""

    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({e.msg} at char {e.pos}): {text!r}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON object, got {text!r}")
        return value

    parse.__name__ = "JSON object"  # argparse names the type in its own messages
    return parse


def _flag_type(hint: Any) -> Any:
    """``int | None`` -> ``int``: the type a flag's text converts to."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    return hint
