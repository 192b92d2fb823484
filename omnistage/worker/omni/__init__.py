"""Stage runners of omni pipelines (thinker, talker)."""
