"""The tensor prefix cache: per-token tensors kept beside the KV blocks.

- ``OmniTensorPrefixCache`` (``cache``): the block-paged store of per-token
  hidden states and multimodal outputs, mirroring the KV cache's block table.
  Its vllm-omni-shaped methods are the conformance surface the first seed
  (``tests/conformance/test_prefix_cache.py``) pins down.
- ``StepTensorCache`` (``step_cache``): drives one from a runner's steps
  (writes, invalidations, merges on hits, deferred commits), sized from the
  KV pool and following the policy the model declares
  (``omnistage.models.interface.TensorCachePolicy``).
- ``deferred_rows`` and ``payload``: the staging of outputs known only after
  sampling, and the splitting of step tensors among requests.
"""

from omnistage.worker.tensor_prefix_cache.cache import HIDDEN_KEY, OmniTensorPrefixCache
from omnistage.worker.tensor_prefix_cache.step_cache import StepTensorCache

__all__ = ["HIDDEN_KEY", "OmniTensorPrefixCache", "StepTensorCache"]
