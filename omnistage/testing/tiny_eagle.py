"""Tiny EAGLE-1 draft heads for tiny targets, in the layout vLLM loads.

``write_tiny_eagle_head(target, path)`` writes ``config.json`` (the target's
decoder config with one layer, ``architectures: ["EagleLlamaForCausalLM"]``)
and ``model.safetensors`` with ``fc.weight`` and ``layers.0.*`` (no
``input_layernorm``, no embeddings or LM head: those are the target's).

- Random (default): fixed-seed weights. Such a head rarely predicts what the
  target will say, so almost every draft is rejected.
- ``mimic_target_layer=True``: the head *is* the target's layer 0 applied to
  the next token's embedding: ``fc = [I | 0]`` (the target hidden state is
  ignored) and ``layers.0`` copies the target's (``input_layernorm``
  included). On a target whose attention output is zeroed and whose later
  layers add nothing (a bigram model, see the tests), the head then computes
  the target's own pre-norm hidden state of the next token, so it predicts
  the target's next-next token and nearly every draft is accepted.

Qwen2 targets get a Qwen2 layer (q/k/v biases); Llama and Qwen3 targets a
Llama layer (vLLM has no EAGLE-1 format of its own for Qwen3).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

__all__ = ["write_tiny_eagle_head"]

_ARCH = {"llama": "EagleLlamaForCausalLM", "qwen2": "EagleQwen2ForCausalLM"}


def _text_config(cfg: dict) -> dict:
    """The decoder config inside a checkpoint's config.json (nested for VL / Omni models)."""
    for path in ((), ("text_config",), ("thinker_config", "text_config")):
        d = cfg
        for key in path:
            d = d.get(key) or {}
        if "hidden_size" in d and "num_attention_heads" in d:
            return (
                {"model_type": cfg.get("model_type"), **d}
                if "model_type" not in d
                else d
            )
    raise ValueError(
        "write_tiny_eagle_head: no decoder config (hidden_size, num_attention_heads) in config.json"
    )


def _target_weights(target: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def write_tiny_eagle_head(
    target: str | Path,
    path: str | Path,
    seed: int = 0,
    mimic_target_layer: bool = False,
) -> Path:
    """Write an EAGLE-1 head for the tiny checkpoint at ``target`` into ``path``; return ``path``."""
    target, path = Path(target), Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _text_config(json.loads((target / "config.json").read_text()))
    model_type = cfg["model_type"]
    if model_type.startswith(
        "qwen2"
    ):  # the text stack of Qwen2.5-VL / the Omni thinker is Qwen2's
        model_type = "qwen2"
    if mimic_target_layer:
        head_type = (
            model_type  # the copied layer keeps its own class (q/k norms, biases)
        )
    else:
        head_type = "qwen2" if model_type == "qwen2" else "llama"
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_theta",
            "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act")  # fmt: skip
    config = {k: cfg[k] for k in keep if k in cfg}
    rope = config.get("rope_parameters") or {}
    config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
    }
    if head_type != model_type:
        config.pop(
            "head_dim", None
        )  # a Llama head over a Qwen3 target: the plain hidden / heads split
    config.update(
        model_type=head_type,
        architectures=[
            _ARCH.get(head_type, f"Eagle{head_type.capitalize()}ForCausalLM")
        ],
        num_hidden_layers=1,
        torch_dtype="float32",
    )
    hidden = int(cfg["hidden_size"])
    if mimic_target_layer:
        tw = _target_weights(target)
        prefix = "model.layers.0."
        weights = {
            "layers.0." + k[len(prefix) :]: v.clone()
            for k, v in tw.items()
            if k.startswith(prefix)
        }
        fc = torch.zeros(hidden, 2 * hidden)
        fc[:, :hidden] = torch.eye(hidden)
        weights["fc.weight"] = fc
    else:
        weights = _random_head(config, head_type, seed)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    return path


def _random_head(config: dict, head_type: str, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])

    def w(*shape: int) -> torch.Tensor:
        return (
            0.25
            * torch.randn(*shape, generator=gen)
            / max(1.0, (shape[-1] / 64) ** 0.5)
        )

    p = "layers.0."
    out = {
        "fc.weight": w(hidden, 2 * hidden),
        p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
        p + "self_attn.k_proj.weight": w(kv * head_dim, hidden),
        p + "self_attn.v_proj.weight": w(kv * head_dim, hidden),
        p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
        p + "mlp.gate_proj.weight": w(inter, hidden),
        p + "mlp.up_proj.weight": w(inter, hidden),
        p + "mlp.down_proj.weight": w(hidden, inter),
        p + "post_attention_layernorm.weight": 1.0
        + 0.1 * torch.randn(hidden, generator=gen),
    }
    if head_type == "qwen2":
        for name, n in (("q", heads), ("k", kv), ("v", kv)):
            out[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(
                n * head_dim, generator=gen
            )
    return out
