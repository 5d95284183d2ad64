"""Multi-turn and agentic rollouts: the ``rollout.generate_fn`` drivers (:mod:`.multiturn`), tools and
their call syntax (:mod:`.tools`), and the code-execution sandbox (:mod:`.sandbox`, its sandboxed
side :mod:`.sandbox_child`)."""
