"""megaforge's in-process engine: :class:`EmbeddedEngine` (:mod:`.engine`, a Hugging Face CausalLM with
its own batched sampling loop), the sampling math (:mod:`.sampling`) and the fast CUDA-graph decoder
(:mod:`.fast`)."""
from megaforge.rollout.embedded.engine import EmbeddedEngine  # noqa: F401  (the wing's engine)
