"""An HTTP double of an SGLang 0.5.16 server for the CPU tests of LoRA adapter serving and of the
engine-served distillation teacher. It serves a real Hugging Face model (prompt log-probs are that
model's), and the LoRA adapters it is told to load are read from their PEFT folders.

Accepted request fields, field by field, from sglang 0.5.16's ``srt/managers/io_struct.py``
(``pip download sglang==0.5.16 --no-deps``; every ``BaseReq`` also has ``rid`` and ``http_worker_ipc``):

* ``LoadLoRAAdapterReqInput``: ``lora_name: str`` (required), ``lora_path: str`` (required),
  ``pinned: bool = False``, ``lora_id: Optional[str] = None``;
* ``UnloadLoRAAdapterReqInput``: ``lora_name: str`` (required), ``lora_id: Optional[str] = None``;
* ``ReleaseMemoryOccupationReqInput`` / ``ResumeMemoryOccupationReqInput``: ``tags: Optional[List[str]]``;
* ``UpdateWeightVersionReqInput``: ``new_version: str`` (required), ``abort_all_requests: bool = True``
  (0.5.16 aborts the requests in flight unless told otherwise);
* ``GenerateReqInput`` (a stdlib dataclass): the fields in :data:`GENERATE_FIELDS`, among them
  ``lora_path: Optional[Union[List[Optional[str]], str]]`` (an adapter *name*: the tokenizer manager
  resolves it in its LoRA registry, ``_resolve_lora_path``), ``logprob_start_len``, ``return_logprob``.

Answers as 0.5.16's ``http_server.py``: the LoRA routes answer ``LoRAUpdateOutput`` (``success``,
``error_message``, ``loaded_adapters``) with HTTP 200, or 400 when ``success`` is false; an unknown
adapter name in ``/generate`` is HTTP 400 (``"Got LoRA adapter that has never been loaded: ..."``).
Prompt log-probs (``max_new_tokens`` 0, ``return_logprob``, ``logprob_start_len`` 0) come as
``meta_info.input_token_logprobs = [[None, id_0, None], [lp_1, id_1, None], ...]`` (the scheduler's
``[None] + input_token_logprobs[:-1]``, ``logprob_result_processor.py``), log_softmax of the raw
logits: no temperature (``logprob_processor.py``).

One deliberate difference: real SGLang *ignores* unknown fields (``extra_behavior="ignore"`` in
``msgspec_utils.msgspec_struct_pydantic_core_schema``; pydantic's default for ``GenerateReqInput``), so
a misspelled field would be dropped silently there; this double answers 422 naming it, so megaforge's
requests are held to the real field names.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading

import torch
from aiohttp import web

BASE = {"rid", "http_worker_ipc"}
LOAD_FIELDS = BASE | {"lora_name", "lora_path", "pinned", "lora_id"}
UNLOAD_FIELDS = BASE | {"lora_name", "lora_id"}
VERSION_FIELDS = BASE | {"new_version", "abort_all_requests"}
MEMORY_FIELDS = BASE | {"tags"}  # Release/ResumeMemoryOccupationReqInput
GENERATE_FIELDS = {
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "use_audio_in_video", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "token_ids_logprob", "return_sampling_mask", "return_text_in_logprobs", "stream", "log_metrics",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk", "modalities",
    "session_params", "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "disagg_prefill_dp_rank", "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning",
    "priority", "extra_key", "no_logs"}


class SGLangDouble:
    """``SGLangDouble(model, eos_id).start()``; ``.url``; ``.calls`` [(endpoint, body)]; ``.loaded``
    {name: folder}; ``.inflight_hook``: called with the body inside every /generate (tests block there)."""

    def __init__(self, model: torch.nn.Module | None = None, eos_id: int = 0, version: str = "0.5.16"):
        self.model, self.eos_id, self.version = model, eos_id, version
        self.calls: list[tuple[str, dict]] = []
        self.loaded: dict[str, str] = {}
        self.weight_version = "0"
        self.inflight_hook = None
        self._loop = asyncio.new_event_loop()
        self._runner = None
        self.url = ""

    # ------------------------------------------------------------------------------- plumbing
    def start(self) -> "SGLangDouble":
        app = web.Application()
        app.router.add_get("/server_info", self._server_info)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_get("/health", self._health)
        app.router.add_get("/health_generate", self._health)
        app.router.add_post("/load_lora_adapter", self._load)
        app.router.add_post("/unload_lora_adapter", self._unload)
        app.router.add_post("/update_weight_version", self._version)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/release_memory_occupation", self._memory)
        app.router.add_post("/resume_memory_occupation", self._memory)
        ready = threading.Event()

        async def up():
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            ready.set()

        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(up(), self._loop)
        assert ready.wait(10), "the SGLang double did not start"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _body(self, request, fields: set, required: set, endpoint: str):
        body = await request.json()
        unknown = sorted(set(body) - fields)
        missing = sorted(required - set(body))
        if unknown or missing:
            raise web.HTTPUnprocessableEntity(text=json.dumps({"detail": f"unknown {unknown}, missing {missing}"}))
        self.calls.append((endpoint, body))
        return body

    @staticmethod
    def _lora_answer(ok: bool, msg: str | None, loaded: dict):
        return web.json_response({"success": ok, "error_message": msg, "loaded_adapters": dict(loaded)},
                                 status=200 if ok else 400)

    # ------------------------------------------------------------------------------- routes
    async def _server_info(self, request):
        return web.json_response({"version": self.version})

    async def _health(self, request):
        return web.Response(text="")

    async def _model_info(self, request):
        return web.json_response({"weight_version": self.weight_version})

    async def _load(self, request):
        b = await self._body(request, LOAD_FIELDS, {"lora_name", "lora_path"}, "/load_lora_adapter")
        name, path = b["lora_name"], b["lora_path"]
        if name in self.loaded:
            return self._lora_answer(False, f"The LoRA adapter {name!r} is already loaded", self.loaded)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            if not os.path.exists(os.path.join(path, f)):
                return self._lora_answer(False, f"Failed to load LoRA adapter {name}: no {f} in {path}", self.loaded)
        self.loaded[name] = path
        return self._lora_answer(True, None, self.loaded)

    async def _unload(self, request):
        b = await self._body(request, UNLOAD_FIELDS, {"lora_name"}, "/unload_lora_adapter")
        if b["lora_name"] not in self.loaded:
            return self._lora_answer(False, f"LoRA adapter {b['lora_name']!r} is not registered", self.loaded)
        del self.loaded[b["lora_name"]]
        return self._lora_answer(True, None, self.loaded)

    async def _version(self, request):
        b = await self._body(request, VERSION_FIELDS, {"new_version"}, "/update_weight_version")
        self.weight_version = b["new_version"]
        return web.json_response({"success": True, "message": ""})

    async def _memory(self, request):
        await self._body(request, MEMORY_FIELDS, set(), request.path)
        return web.json_response({})

    async def _generate(self, request):
        b = await self._body(request, GENERATE_FIELDS, set(), "/generate")
        ids = b["input_ids"]
        n = len(ids)
        loras = b.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * n
        for name in loras:
            if name is not None and name not in self.loaded:
                return web.json_response({"error": {"message": f"Got LoRA adapter that has never been loaded: "
                                                               f"{name}\nAll loaded adapters: {list(self.loaded)}."}},
                                         status=400)
        if self.inflight_hook is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.inflight_hook, b)
        sps = b.get("sampling_params") or [{}] * n
        start = b.get("logprob_start_len")
        out = []
        for i in range(n):
            meta = {"id": b["rid"][i] if b.get("rid") else str(i), "weight_version": self.weight_version,
                    "prompt_tokens": len(ids[i])}
            if sps[i].get("max_new_tokens") == 0:
                meta.update(finish_reason={"type": "length", "length": 0}, output_token_logprobs=[],
                            completion_tokens=0)
                if b.get("return_logprob") and start == 0:
                    meta["input_token_logprobs"] = self._prompt_logprobs(ids[i])
                out.append({"text": "", "output_ids": [], "meta_info": meta})
            else:  # one token: the end of sequence (LoRA tests look at the requests, not at the text)
                meta.update(finish_reason={"type": "stop", "matched": self.eos_id}, completion_tokens=1,
                            output_token_logprobs=[[-0.25, self.eos_id, None]])
                out.append({"text": "", "output_ids": [self.eos_id], "meta_info": meta})
        return web.json_response(out)

    def _prompt_logprobs(self, ids: list[int]) -> list:
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return [[None, ids[0], None]] + [[float(v), t, None] for v, t in zip(lp.tolist(), ids[1:])]
