"""Held-out evaluation (``eval:`` config section): sets (:mod:`.sets`), the engine pass
(:mod:`.runner`) and the pure statistics, pass@k and per-set aggregation (:mod:`.stats`)."""
from megaforge.eval.stats import SampleResult, mean_pass_at_k, pass_at_k, summarize

__all__ = ["SampleResult", "mean_pass_at_k", "pass_at_k", "summarize"]
