"""A plug-in rollout engine kind for the LoRA run test: megaforge's HTTPEngine (the SGLang client, as
``rollout.engine: sglang`` builds it) over the SGLang double of tests/sglang_double.py, taking the
adapters as a folder like ``sglang``. Loaded by a run through ``algo.plugins``; the doubles it
started are in :data:`DOUBLES` (the test reads their calls and stops them)."""
from megaforge.engine_kinds import ENGINE_KINDS, EngineKind

DOUBLES: list = []


def build(spec, tokenizer, node=None):
    from sglang_double import SGLangDouble

    from megaforge.rollout.http.engine import HTTPEngine

    d = SGLangDouble(eos_id=tokenizer.eos_token_id).start()
    DOUBLES.append(d)
    return HTTPEngine([d.url])


ENGINE_KINDS.register("sglang_double", EngineKind(build=build, lora_adapters="folder"))
