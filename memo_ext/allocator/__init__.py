"""The run-time side of a memory plan: tensors served at their planned offsets in one region.

Nothing is served yet: ``memo_ext.planner`` makes plans (``tools/plan_memory.py``) and the
trainer allocates through PyTorch's caching allocator.
"""
