"""Load-side code beyond the tiers: loads within a memory budget (`squishlike.load(path, max_memory=...)`).

budget.py decides, from the manifest alone, whether the whole model fits, whether a MoE model's experts are
streamed, or whether the load is refused; streamed.py runs a streamed load; experts.py is the cache of experts and
the expert stack that reads from it.

This package imports nothing itself: squishlike/__init__.py imports it when `squishlike` is imported, so that the
name `squishlike.load` stays the function (see there).
"""
