"""One way to build the engine of any checkpoint: a stage engine, or a pipeline of them."""

from __future__ import annotations

from typing import Any

from omnistage.engine.arg_utils import EngineArgs
from omnistage.engine.omni.pipeline import OmniPipeline
from omnistage.engine.omni.qwen2_5_omni import OmniOptions, build_omni_pipeline
from omnistage.engine.omni.qwen3_omni import build_qwen3_omni_pipeline
from omnistage.engine.stage_engine import StageEngine
from omnistage.models.qwen2_5_omni import OmniModel, is_omni_checkpoint, load_qwen2_5_omni
from omnistage.models.qwen3_omni import Qwen3OmniModel, is_qwen3_omni_checkpoint, load_qwen3_omni

__all__ = ["Engine", "build_engine"]

# All offer add_request / abort_request / step / has_unfinished_requests / get_stats / held.
Engine = StageEngine | OmniPipeline  # | DataParallelEngine (engine.distributed) for data_parallel_size > 1


def build_engine(args: EngineArgs, options: OmniOptions | None = None, loaded: Any | None = None) -> Engine:
    """The engine for ``args.model``: the omni pipeline for a whole omni checkpoint
    (thinker + talker + token2wav), else one stage. ``loaded`` is a model already
    loaded (an ``OmniModel`` or a ``LoadedModel``) whose weights the engine shares.
    ``args.data_parallel_size > 1``: that many of these engines, each in a Ray
    actor, behind one ``DataParallelEngine`` (``engine.distributed``)."""
    if args.data_parallel_size > 1:
        if loaded is not None:
            raise ValueError(
                "data_parallel_size > 1 loads the model in every replica: pass a checkpoint path, not a loaded model"
            )
        from omnistage.engine.distributed.data_parallel import DataParallelEngine  # imports Ray

        return DataParallelEngine(args, options)  # type: ignore[return-value]
    if isinstance(loaded, Qwen3OmniModel) or (loaded is None and is_qwen3_omni_checkpoint(args.model)):
        q3 = loaded if isinstance(loaded, Qwen3OmniModel) else load_qwen3_omni(args.model, args.dtype, args.device)  # type: ignore[arg-type]
        return build_qwen3_omni_pipeline(args, q3, options)
    if isinstance(loaded, OmniModel) or (loaded is None and is_omni_checkpoint(args.model)):
        omni = loaded if isinstance(loaded, OmniModel) else load_qwen2_5_omni(args.model, args.dtype, args.device)  # type: ignore[arg-type]
        return build_omni_pipeline(args, omni, options)
    if options is not None and options != OmniOptions():
        raise ValueError(f"{args.model or 'the default model'!r} is not an omni checkpoint: talker options do not apply")
    return StageEngine(args, loaded)
