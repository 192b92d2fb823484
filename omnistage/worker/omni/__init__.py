"""Stage runners of omni pipelines (thinker, talker) and the tensor prefix cache's driver.

``ThinkerStageRunner`` and ``TalkerStageRunner`` are ``ModelRunner``s: each owns
its stage's paged KV cache and persistent batch. ``StepTensorCache`` feeds an
``OmniTensorPrefixCache`` from the scheduler's decisions, for models that
declare per-token tensors a downstream stage needs (``TensorCachePolicy``).
"""

from omnistage.worker.omni.step_tensor_cache import StepTensorCache
from omnistage.worker.omni.tensor_cache_policy import NO_TENSOR_CACHE, TensorCachePolicy, tensor_cache_policy_of

__all__ = ["NO_TENSOR_CACHE", "StepTensorCache", "TensorCachePolicy", "tensor_cache_policy_of"]
