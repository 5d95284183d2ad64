"""The OpenAI-compatible endpoints of the embedded server (the routes real SGLang serves beside its native API):

* ``GET /v1/models``: the served model (``--served-model-name``, default ``--model``), ``max_model_len``.
* ``POST /v1/completions``: ``prompt`` as a string, strings, token ids or lists of token ids; ``n``
  samples per prompt (choice ``index = prompt * n + sample``); ``max_tokens`` (default 16),
  ``temperature``, ``top_p``, ``stop``, ``seed`` (sample ``j`` uses ``seed + j``), ``logprobs: 0``
  (``tokens``, ``token_logprobs``, ``text_offset``), ``echo`` (the prompt text before the completion),
  ``stream``.
* ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template
  (``add_generation_prompt``; ``tools`` and ``chat_template_kwargs`` passed to it), ``n``,
  ``max_tokens`` / ``max_completion_tokens`` (default: the context left after the prompt), ``logprobs``
  (``content[i] = {token, logprob, bytes, top_logprobs: []}``), ``stream``.

Both accept SGLang's extensions ``top_k``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``no_stop_trim``. What the embedded engine cannot do is refused with 400 naming the field, never ignored:
alternatives per token (``logprobs`` > 0, ``top_logprobs`` > 0; the engine returns the sampled token's
logprob only), ``echo`` with ``logprobs`` (no prompt logprobs), penalties, ``logit_bias``, ``suffix``,
``best_of`` other than ``n``, non-text message parts, unknown fields. Tool calls are not parsed out of
the answer (the text is the model's; ``tool_choice`` may be ``"auto"`` or ``"none"``).

Streaming (``stream: true``): Server-Sent Events in OpenAI's chunk shapes ending with ``data: [DONE]``
(``stream_options.include_usage`` adds the usage chunk). The embedded engine decodes a request's batch
in one call, so the chunks are written when the batch ends: one content chunk per choice, then its
finish chunk (SGLang writes a chunk per decoding step).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` (400 with ``param`` naming the
field; 401 for a missing or wrong bearer key). Body size, body deadline, readers, connection bound,
auth and abandoned-client aborts are the native endpoints' (:mod:`megaforge.rollout.server.routes`).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web

from megaforge.rollout.http import protocol as P
from megaforge.rollout.http.protocol import (REQUIRED, FieldError, choice, list_of, one_or_list, opt, t_bool, t_float,
                                             t_int, t_object, t_str)

MAX_N = 128  # samples per prompt (OpenAI's limit)
ROLES = ("system", "developer", "user", "assistant", "tool")


def openai_error(status: int, message: str, param=None, code=None) -> web.Response:
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "server_error")
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


def _t_prompt(v, p):
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return v
    if isinstance(v, list) and v:
        return P.t_input_ids(v, p)
    raise FieldError(p, f"expected a string, an array of strings, of token ids or of token-id arrays (non-empty), "
                        f"got {json.dumps(v)[:80]}")


def _t_count(lo: int, hi: int):
    def run(v, p):
        t_int(v, p)
        if not lo <= v <= hi:
            raise FieldError(p, f"must be in [{lo}, {hi}], got {v}")
        return v
    return run


_COMMON = {  # fields of both endpoints
    "model": (opt(t_str), None), "n": (_t_count(1, MAX_N), 1), "temperature": (opt(t_float), None),
    "top_p": (opt(t_float), None), "stop": (opt(one_or_list(t_str, "a string or an array of strings")), None),
    "stream": (t_bool, False), "stream_options": (opt(t_object), None), "seed": (opt(t_int), None),
    "user": (opt(t_str), None), "max_tokens": (opt(t_int), None),
    "frequency_penalty": (opt(t_float), None), "presence_penalty": (opt(t_float), None),
    "logit_bias": (opt(t_object), None),
    # SGLang's extensions
    "top_k": (opt(t_int), None), "min_p": (opt(t_float), None), "repetition_penalty": (opt(t_float), None),
    "ignore_eos": (t_bool, False), "stop_token_ids": (opt(list_of(t_int)), None),
    "skip_special_tokens": (t_bool, True), "no_stop_trim": (t_bool, False),
}
COMPLETIONS = {**_COMMON, "prompt": (_t_prompt, REQUIRED), "logprobs": (opt(_t_count(0, 5)), None),
               "echo": (t_bool, False), "best_of": (opt(t_int), None), "suffix": (opt(t_str), None)}
CHAT = {**_COMMON, "messages": (list_of(t_object, "a non-empty array of message objects"), REQUIRED),
        "max_completion_tokens": (opt(t_int), None), "logprobs": (t_bool, False),
        "top_logprobs": (opt(_t_count(0, 20)), None), "tools": (opt(list_of(t_object)), None),
        "tool_choice": (opt(choice("auto", "none")), None), "parallel_tool_calls": (opt(t_bool), None),
        "response_format": (opt(t_object), None), "chat_template_kwargs": (opt(t_object), None)}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal"}


def _sampling(b: dict, max_new: int) -> dict:
    """The native sampling params of an OpenAI body (checked by :func:`protocol.validate_sampling`,
    whose field names are mapped back to OpenAI's)."""
    sp = {"max_new_tokens": max_new, "ignore_eos": b["ignore_eos"], "skip_special_tokens": b["skip_special_tokens"],
          "no_stop_trim": b["no_stop_trim"], "stop": b["stop"], "stop_token_ids": b["stop_token_ids"]}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty"):
        if b[name] is not None:
            sp[name] = b[name]
    if b["seed"] is not None:
        sp["sampling_seed"] = b["seed"]
    try:
        return P.validate_sampling(sp, "")
    except FieldError as e:
        field = e.field.lstrip(".").replace("max_new_tokens", "max_tokens").replace("sampling_seed", "seed")
        raise FieldError(field, str(e).split(": ", 1)[1]) from None


def _refuse_unsupported(b: dict) -> None:
    if b["logit_bias"]:
        raise FieldError("logit_bias", "not supported by megaforge's embedded engine")
    if b["stream_options"] is not None:
        if not b["stream"]:
            raise FieldError("stream_options", "only allowed with stream: true")
        P.validate({"include_usage": (t_bool, False), "continuous_usage_stats": (t_bool, False)}, b["stream_options"],
                   "stream_options")
    if isinstance(b["stop"], list) and not all(b["stop"]):
        raise FieldError("stop", "stop strings must be non-empty")


def _check_messages(msgs: list) -> list[dict]:
    """The messages as the chat template gets them (text parts joined); 400 naming ``messages[i].key``."""
    if not msgs:
        raise FieldError("messages", "must hold at least one message")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        unknown = sorted(set(m) - _MESSAGE_KEYS)
        if unknown:
            raise FieldError(f"{where}.{unknown[0]}", f"unknown message field; expected among {sorted(_MESSAGE_KEYS)}")
        role = m.get("role")
        if role not in ROLES:
            raise FieldError(f"{where}.role", f"expected one of {list(ROLES)}, got {json.dumps(role)[:40]}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise FieldError(f"{where}.content[{j}]", "only text parts {\"type\": \"text\", \"text\": str} are "
                                                              "supported by megaforge's embedded server")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise FieldError(f"{where}.content", "missing (null is allowed only for an assistant message with "
                                                     "tool_calls)")
        elif not isinstance(content, str):
            raise FieldError(f"{where}.content", f"expected a string or an array of text parts, got "
                                                 f"{type(content).__name__}")
        for key in ("name", "tool_call_id", "reasoning_content", "refusal"):
            if key in m and m[key] is not None and not isinstance(m[key], str):
                raise FieldError(f"{where}.{key}", "expected a string")
        if "tool_calls" in m and not isinstance(m["tool_calls"], (list, type(None))):
            raise FieldError(f"{where}.tool_calls", "expected an array")
        out.append({**m, "content": content})
    return out


class OpenAIRoutes:
    """``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` over one
    :class:`megaforge.rollout.server.routes.Routes` (its server, body reading and client watch)."""

    def __init__(self, routes, gone):
        self.routes, self.srv, self.gone = routes, routes.srv, gone

    @property
    def model_name(self) -> str:
        return self.srv.args.served_model_name or self.srv.args.model

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(self.srv.started), "owned_by": "megaforge",
            "root": self.srv.args.model, "max_model_len": self.srv.context}]})

    async def body(self, request, schema: dict) -> dict:
        b = P.validate(schema, await self.routes.read_json(request))
        _refuse_unsupported(b)
        return b

    async def generate(self, request, native: dict, prompt_field: str) -> list:
        """The native answers of ``native``; a refused prompt is named by ``prompt_field`` (OpenAI's name)."""
        try:
            return await self.srv.generate(native, gone=lambda: self.gone(request))
        except FieldError as e:
            if e.field.startswith(("input_ids", "text")):
                raise FieldError(prompt_field, str(e).split(": ", 1)[1]) from None
            raise

    # -------------------------------------------------------------------------------- completions
    async def completions(self, request):
        b = await self.body(request, COMPLETIONS)
        if b["best_of"] not in (None, 1, b["n"]):
            raise FieldError("best_of", f"only null or n ({b['n']}) is supported: the embedded server returns every sample")
        if b["suffix"]:
            raise FieldError("suffix", "not supported by megaforge's embedded server")
        if b["logprobs"]:
            raise FieldError("logprobs", "the embedded engine returns the sampled token's logprob only: use logprobs 0 "
                                         "(tokens and token_logprobs; top_logprobs are not computed)")
        if b["echo"] and b["logprobs"] is not None:
            raise FieldError("echo", "echo with logprobs needs prompt logprobs, which the embedded server does not compute")
        prompt, n = b["prompt"], b["n"]
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt[0], (str, list)):
            prompts = prompt
        else:
            prompts = [prompt]
        sp = _sampling(b, 16 if b["max_tokens"] is None else b["max_tokens"])
        native = {"sampling_params": [self.seeded(sp, b["seed"], j) for _ in prompts for j in range(n)],
                  "return_logprob": b["logprobs"] is not None}
        key = "text" if isinstance(prompts[0], str) else "input_ids"
        native[key] = [p for p in prompts for _ in range(n)]
        outs = await self.generate(request, self.native_body(native), "prompt")
        tok = self.srv.tokenizer
        choices = []
        for k, o in enumerate(outs):
            head = ""
            if b["echo"]:
                p = prompts[k // n]
                head = p if isinstance(p, str) else (tok.decode(p) if tok is not None else "")
            lp = self.completion_logprobs(o, len(head)) if b["logprobs"] is not None else None
            choices.append({"index": k, "text": head + o["text"], "logprobs": lp, **self.finish(o)})
        return await self.answer(request, b, "cmpl", "text_completion", choices, outs, n)

    # --------------------------------------------------------------------------------------- chat
    async def chat(self, request):
        b = await self.body(request, CHAT)
        if b["top_logprobs"]:
            raise FieldError("top_logprobs", "the embedded engine returns the sampled token's logprob only: use "
                                             "top_logprobs 0 (or leave it out)")
        if b["response_format"] not in (None, {"type": "text"}):
            raise FieldError("response_format", "only {\"type\": \"text\"} is supported by megaforge's embedded server")
        tok = self.srv.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise FieldError("messages", "the model's tokenizer has no chat template: use /v1/completions")
        msgs = _check_messages(b["messages"])
        kwargs = dict(b["chat_template_kwargs"] or {})

        def render():
            text = tok.apply_chat_template(msgs, tools=b["tools"], add_generation_prompt=True, tokenize=False, **kwargs)
            return tok(text, add_special_tokens=False)["input_ids"]

        try:  # the template runs off the event loop
            ids = await asyncio.get_running_loop().run_in_executor(None, render)
        except Exception as e:  # noqa: BLE001  (a template's own error, e.g. "roles must alternate")
            raise FieldError("messages", f"the chat template refused them: {type(e).__name__}: {e}") from None
        if b["max_tokens"] is not None and b["max_completion_tokens"] is not None:
            raise FieldError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        max_new = b["max_completion_tokens"] if b["max_tokens"] is None else b["max_tokens"]
        if max_new is None:
            max_new = max(self.srv.context - len(ids), 1)  # the context left (a too long prompt is 400 below)
        sp = _sampling(b, max_new)
        n = b["n"]
        outs = await self.generate(request, self.native_body({
            "input_ids": [ids] * n, "sampling_params": [self.seeded(sp, b["seed"], j) for j in range(n)],
            "return_logprob": b["logprobs"]}), "messages")
        choices = [{"index": k, "message": {"role": "assistant", "content": o["text"]},
                    "logprobs": {"content": self.chat_logprobs(o)} if b["logprobs"] else None, **self.finish(o)}
                   for k, o in enumerate(outs)]
        return await self.answer(request, b, "chatcmpl", "chat.completion", choices, outs, n)

    # ------------------------------------------------------------------------------------ helpers
    @staticmethod
    def native_body(native: dict) -> dict:
        return P.validate(P.SCHEMAS["/generate"], native)

    @staticmethod
    def seeded(sp: dict, seed, j: int) -> dict:
        """Sample ``j``'s sampling params: ``seed + j`` (n samples of one seed must differ)."""
        out = {k: v for k, v in sp.items() if v is not None and k != "sampling_seed"}
        if seed is not None:
            out["sampling_seed"] = (seed + j) % (1 << 63)
        return out

    @staticmethod
    def finish(o: dict) -> dict:
        fr = o["meta_info"]["finish_reason"]
        return {"finish_reason": fr["type"], "matched_stop": fr.get("matched")}

    def token_texts(self, ids: list[int]) -> list[str]:
        tok = self.srv.tokenizer
        return [tok.decode([t]) for t in ids] if tok is not None else [str(t) for t in ids]

    def completion_logprobs(self, o: dict, offset: int) -> dict:
        lps = o["meta_info"].get("output_token_logprobs") or []
        tokens = self.token_texts([t for _, t, _ in lps])
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _, _ in lps], "top_logprobs": None,
                "text_offset": offsets}

    def chat_logprobs(self, o: dict) -> list:
        lps = o["meta_info"].get("output_token_logprobs") or []
        return [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for (lp, _, _), t in zip(lps, self.token_texts([t for _, t, _ in lps]))]

    async def answer(self, request, b: dict, prefix: str, obj: str, choices: list, outs: list, n: int):
        prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs[::n])
        completion_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        head = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
                "model": self.model_name}
        if not b["stream"]:
            return web.json_response({**head, "choices": choices, "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        chunk = {**head, "object": obj + ".chunk"} if obj == "chat.completion" else head

        async def send(payload) -> None:
            await resp.write(b"data: " + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
                             + b"\n\n")

        try:
            await self.stream_choices(send, chunk, obj, choices)
            if (b["stream_options"] or {}).get("include_usage"):
                await send({**chunk, "choices": [], "usage": usage})
            await send(b"[DONE]")
            await resp.write_eof()
        except ConnectionError:  # the client left during the stream: nothing to answer
            pass
        return resp

    @staticmethod
    async def stream_choices(send, chunk: dict, obj: str, choices: list) -> None:
        for c in choices:
            if obj == "chat.completion":
                await send({**chunk, "choices": [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
                await send({**chunk, "choices": [{"index": c["index"], "delta": {"content": c["message"]["content"]},
                                                  "logprobs": c["logprobs"], "finish_reason": None}]})
                await send({**chunk, "choices": [{"index": c["index"], "delta": {}, "logprobs": None,
                                                  "finish_reason": c["finish_reason"],
                                                  "matched_stop": c["matched_stop"]}]})
            else:
                await send({**chunk, "choices": [{**c, "finish_reason": None, "matched_stop": None}]})
                await send({**chunk, "choices": [{"index": c["index"], "text": "", "logprobs": None,
                                                  "finish_reason": c["finish_reason"],
                                                  "matched_stop": c["matched_stop"]}]})

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
