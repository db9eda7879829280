"""Compress options the tests share."""

# Round to nearest, no calibration: what a test of loading, tiers, tools or architectures needs from a store. The
# calibrated INT4 default (AWQ, GPTQ, clip search) takes minutes on SmolLM2 on two cores, and what it buys is
# tested once, in tests/integration/test_default_store.py.
ROUND_TO_NEAREST = {"awq": False, "gptq": False, "clip_search": False}
