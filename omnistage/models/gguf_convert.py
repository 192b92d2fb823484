"""Convert a GGUF file once into a cached safetensors checkpoint folder.

Loading a GGUF through ``from_pretrained(gguf_file=...)`` dequantizes every
tensor and rebuilds the BPE tokenizer on each load (tens of seconds for a
135M model), and needs ``accelerate``. Instead we use transformers' GGUF
readers once (config, tokenizer with its chat template, and
``load_gguf_checkpoint`` for the dequantized, HF-named tensors) and write an
ordinary checkpoint folder that later loads in about a second.

Cache policy: one folder per GGUF file, keyed by file name, size and
modification time plus :data:`CONVERSION_VERSION`; a changed file gets a new
folder. The folder is written under a temporary name and renamed into place,
so a reader never sees a half-written folder; when two processes convert
concurrently, the first rename wins and the other discards its copy. After
a new conversion, older folders converted from the same path (a file since
replaced, e.g. by a reinstall) are deleted; nothing else is ever evicted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from omnistage.cache_dir import cache_root

CONVERSION_VERSION = 1
MARKER = "omnistage_conversion.json"  # written last inside the folder; its presence means complete


def converted_folder_for(gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` lives (it may not exist yet)."""
    st = gguf_path.stat()
    key = f"{gguf_path.name}:{st.st_size}:{st.st_mtime_ns}:v{CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def cached_gguf_checkpoint(gguf_path: str | Path) -> Path:
    """The converted checkpoint folder of ``gguf_path``, converting it on first use."""
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file {gguf_path} does not exist")
    target = converted_folder_for(gguf_path)
    if (target / MARKER).is_file():
        return target
    if target.exists():
        # A folder without its marker was not produced by us in one piece (e.g. edited by hand): redo it.
        shutil.rmtree(target, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():
                raise
            # Another process finished first; its folder is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale_conversions(gguf_path, keep=target)
    return target


def _remove_stale_conversions(gguf_path: Path, keep: Path) -> None:
    """Delete completed folders converted from ``gguf_path`` other than ``keep``."""
    for folder in keep.parent.glob(f"{gguf_path.stem}-*"):
        if folder == keep or not (folder / MARKER).is_file():
            continue
        try:
            source = json.loads((folder / MARKER).read_text()).get("source")
        except (OSError, ValueError):
            continue
        if source == str(gguf_path):
            shutil.rmtree(folder, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write ``gguf_path`` as a float32 safetensors checkpoint folder at ``out_dir``."""
    # Imported here: it pulls in the gguf package, which plain folder loads never need.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    start = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    out_dir.mkdir(parents=True, exist_ok=False)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    # A weightless model suffices: the reader only needs its parameter names to map GGUF's.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
    )
    tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
    expected = set(skeleton.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")  # tied to the embedding; loaders re-tie it
    missing = sorted(expected - set(tensors))
    if missing:
        raise ValueError(f"GGUF file {gguf_path} lacks tensors for {missing[:5]} (and {max(0, len(missing) - 5)} more)")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = torch.float32
    config.save_pretrained(out_dir)

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
    eos = [i for i in (config.eos_token_id, tokenizer.eos_token_id) if i is not None]
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=sorted(set(eos)) if len(set(eos)) > 1 else (eos[0] if eos else None),
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)

    st = gguf_path.stat()
    record = {
        "source": str(gguf_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "conversion_version": CONVERSION_VERSION,
        "conversion_seconds": round(time.perf_counter() - start, 2),
    }
    (out_dir / MARKER).write_text(json.dumps(record, indent=2))
    return out_dir
