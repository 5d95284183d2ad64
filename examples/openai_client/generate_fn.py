"""A ``rollout.generate_fn`` that talks to the engine through the official ``openai`` client.

Use it as ``rollout.generate_fn: examples.openai_client.generate_fn:openai_rollout`` with an HTTP engine
(``rollout.engine: embedded_server`` or ``sglang``): both serve OpenAI's ``/v1`` routes, and
``engine.openai_base_urls`` / ``engine.api_key`` say where (the router's when there is one). The same
pattern lets an agent framework written against an OpenAI-compatible endpoint produce the episodes.

The OpenAI API returns text, not token ids: the response is re-tokenized. Its logprobs are the API's
``token_logprobs`` when the re-tokenized ids decode to exactly the tokens the server reports, else 0.0
with ``metadata["episode"]["retokenized"] = 1`` (averaged into ``episode/retokenized``), so that
algorithms reading rollout logprobs (``algo.tis``) see where they are missing. megaforge's own rollouts
use the native ``/generate``, which returns the exact ids and logprobs.
"""
from __future__ import annotations

from megaforge.types import Sample


def openai_rollout(engine, requests, rows, tokenizer, ctx, model: str = "default") -> list[Sample]:
    """``ctx``: the run's :class:`~megaforge.specs.GenerateContext` (unused: each request carries its
    sampling); ``model``: the name sent to the server (a ``rollout.generate_kwargs`` key)."""
    import openai  # the optional dependency of this example

    if not hasattr(engine, "openai_base_urls"):
        raise ValueError("rollout.generate_fn openai_rollout needs an HTTP engine (rollout.engine: embedded_server or "
                         "sglang); the in-process engine has no URL")
    client = openai.OpenAI(base_url=engine.openai_base_urls[0], api_key=engine.api_key or "none")
    samples = []
    for req in requests:
        sp = req.sampling
        out = client.completions.create(model=model, prompt=list(req.input_ids), max_tokens=sp.max_new_tokens,
                                        temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                                        stop=list(sp.stop) or None, logprobs=0)
        choice = out.choices[0]
        ids = tokenizer(choice.text, add_special_tokens=False)["input_ids"][: sp.max_new_tokens]
        aligned = [tokenizer.decode([i]) for i in ids] == list(choice.logprobs.tokens)
        logprobs = list(choice.logprobs.token_logprobs) if aligned else [0.0] * len(ids)
        samples.append(Sample(prompt_ids=list(req.input_ids), response_ids=ids, rollout_logprobs=logprobs, group_id=0,
                              finish_reason=choice.finish_reason or "length", response_text=choice.text,
                              metadata={"episode": {"retokenized": 0.0 if aligned else 1.0}}))
    return samples
