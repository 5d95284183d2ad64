"""A toy rollout engine kind for the engine-kind registry test: one module plus one registration
(the last line), loaded by a run through ``algo.plugins``. The toy engine is megaforge's embedded
engine counting the sequences it generates; its preflight refuses top-k sampling."""
from megaforge.configtree import ConfigError
from megaforge.engine_kinds import ENGINE_KINDS, EngineKind

#: sequences the toy engines of this process generated, and how many toy engines were built
COUNTS = {"built": 0, "generated": 0}


def preflight(spec) -> None:
    """``spec``: the run's EngineSpec (megaforge.specs): its ``rollout`` and ``model`` sections and more."""
    if spec.rollout.top_k != -1:
        raise ConfigError(f"config key 'rollout.top_k': the toy engine samples from the whole vocabulary "
                          f"(-1), got {spec.rollout.top_k}")


def build(spec, tokenizer):
    from megaforge.rollout.embedded import EmbeddedEngine  # lazy: torch

    class ToyEngine(EmbeddedEngine):
        def generate(self, requests):
            out = super().generate(requests)
            COUNTS["generated"] += len(out)
            return out

    COUNTS["built"] += 1
    return ToyEngine.from_spec(spec, tokenizer)


ENGINE_KINDS.register("toy", EngineKind(build=build, in_process=True, max_tp=1, preflight=preflight))
