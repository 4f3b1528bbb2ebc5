"""Test and benchmark helpers: tiny models and real verl-layout FSDP2 checkpoints.

Nothing here is needed at runtime by the merge engine; ``transformers`` and
``tokenizers`` are imported lazily and only by the helpers that need them.
"""
