"""Async HTTP client of SGLang's native API, for real SGLang servers and megaforge's embedded one.

One :class:`SGLangClient` per server URL. Every call:

* waits for a slot of the client's semaphore (``max_concurrency`` requests in flight);
* sends ``Authorization: Bearer <api_key>`` when a key is set;
* has a total timeout (``timeout_s``, per call overridable);
* retries connection errors with exponential backoff (``backoff_s * 2**k``, ``retries`` times): a
  refused connection always (nothing reached the server), a dropped one only for idempotent calls;
* raises :class:`EngineHTTPError` (endpoint, status, body) on a non-2xx answer, and on a 2xx answer
  whose JSON says ``"success": false``.

Request fields are sglang 0.5.23's (see :mod:`megaforge.rollout.http.protocol`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Optional

import aiohttp

from megaforge.rollout.http.protocol import parse_version

log = logging.getLogger("megaforge.rollout.http.client")


class EngineHTTPError(RuntimeError):
    def __init__(self, url: str, endpoint: str, status: int, body: str):
        super().__init__(f"{url}{endpoint} answered HTTP {status}: {body[:2000].strip()}")
        self.url, self.endpoint, self.status, self.body = url, endpoint, status, body


class EngineUnreachable(ConnectionError):
    def __init__(self, url: str, endpoint: str, attempts: int, cause: BaseException):
        super().__init__(f"{url}{endpoint}: no answer after {attempts} attempt(s): {type(cause).__name__}: {cause}")
        self.url, self.endpoint = url, endpoint


class SGLangClient:
    def __init__(self, url: str, api_key: str = "", timeout_s: float = 600.0, max_concurrency: int = 256,
                 retries: int = 3, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_concurrency = max_concurrency
        self._sem: Optional[asyncio.Semaphore] = None
        self._session: Optional[aiohttp.ClientSession] = None

    def _ensure(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._sem = asyncio.Semaphore(self.max_concurrency)
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=self.max_concurrency))
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def request(self, method: str, endpoint: str, payload: Any = None, *, timeout_s: Optional[float] = None,
                      idempotent: bool = True, params: Optional[dict] = None, retries: Optional[int] = None,
                      check_success: bool = True) -> Any:
        """The parsed JSON answer (text when the answer is not JSON); see the module docstring."""
        session = self._ensure()
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        attempts = (self.retries if retries is None else retries) + 1
        last: BaseException = RuntimeError("no attempt")
        for k in range(attempts):
            try:
                async with self._sem:
                    async with session.request(method, self.url + endpoint, json=payload, params=params,
                                               timeout=timeout) as resp:
                        text = await resp.text()
                        status = resp.status
                break
            except aiohttp.ClientConnectorError as e:  # never reached the server: always safe to retry
                last = e
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if not idempotent:
                    raise EngineUnreachable(self.url, endpoint, k + 1, e) from e
                last = e
            except asyncio.TimeoutError as e:
                raise EngineUnreachable(self.url, endpoint, k + 1,
                                        TimeoutError(f"no answer within {timeout.total:.0f} s")) from e
            if k + 1 < attempts:
                delay = self.backoff_s * (2 ** k)
                log.warning("%s%s: %s; retrying in %.1f s", self.url, endpoint, last, delay)
                await asyncio.sleep(delay)
        else:
            raise EngineUnreachable(self.url, endpoint, attempts, last) from last
        if not 200 <= status < 300:
            raise EngineHTTPError(self.url, endpoint, status, text)
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            return text
        if check_success and isinstance(data, dict) and data.get("success") is False:
            raise EngineHTTPError(self.url, endpoint, status, text)
        return data

    # ------------------------------------------------------------------------------------- generate
    async def generate(self, payload: dict, timeout_s: Optional[float] = None) -> Any:
        """POST /generate with a full GenerateReqInput body (single or batch)."""
        return await self.request("POST", "/generate", payload, timeout_s=timeout_s)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        await self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def flush_cache(self, wait_s: float = 60.0, poll_s: float = 0.5) -> None:
        """Flush the prefix cache, retrying while requests drain (SGLang refuses a busy flush)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                await self.request("POST", "/flush_cache")
                return
            except EngineHTTPError as e:
                if e.status != 400 or loop.time() >= deadline:
                    raise
            await asyncio.sleep(poll_s)

    # --------------------------------------------------------------------------------------- memory
    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        await self.request("POST", "/release_memory_occupation", {"tags": tags}, idempotent=False)

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        await self.request("POST", "/resume_memory_occupation", {"tags": tags}, idempotent=False)

    # -------------------------------------------------------------------------------------- weights
    async def begin_weight_update(self) -> None:
        await self.request("POST", "/begin_weight_update", {}, idempotent=False)

    async def end_weight_update(self) -> None:
        await self.request("POST", "/end_weight_update", {}, idempotent=False)

    async def update_weights_from_tensor(self, serialized_named_tensors: list[str], load_format: Optional[str] = None,
                                         flush_cache: bool = True, weight_version: Optional[str] = None) -> dict:
        return await self.request("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "flush_cache": flush_cache, "weight_version": weight_version})

    async def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                       weight_version: Optional[str] = None, flush_cache: bool = True) -> dict:
        return await self.request("POST", "/update_weights_from_disk", {
            "model_path": model_path, "load_format": load_format, "weight_version": weight_version,
            "flush_cache": flush_cache})

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                        group_name: str = "weight_update_group", backend: str = "nccl") -> dict:
        return await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, idempotent=False)

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group", flush_cache: bool = True,
                                              weight_version: Optional[str] = None,
                                              load_format: Optional[str] = None) -> dict:
        return await self.request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": flush_cache,
            "weight_version": weight_version, "load_format": load_format}, idempotent=False)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name}, idempotent=False)

    async def update_weight_version(self, new_version: str) -> dict:
        return await self.request("POST", "/update_weight_version", {"new_version": new_version})

    # ------------------------------------------------------------------------------ LoRA adapters
    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """POST /load_lora_adapter (sglang 0.5.16 ``LoadLoRAAdapterReqInput``: lora_name, lora_path; an
        answer ``{"success": false, "error_message": ...}`` comes with HTTP 400)."""
        return await self.request("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path},
                                  idempotent=False)

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        """POST /unload_lora_adapter (``UnloadLoRAAdapterReqInput``: lora_name). SGLang answers once the
        requests in flight with that adapter have finished (``LoRARegistry.wait_for_unload``)."""
        return await self.request("POST", "/unload_lora_adapter", {"lora_name": lora_name}, idempotent=False)

    # ---------------------------------------------------------------------------------------- state
    async def health(self, timeout_s: float = 10.0) -> bool:
        return await self._probe("/health", timeout_s)

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        return await self._probe("/health_generate", timeout_s)

    async def _probe(self, endpoint: str, timeout_s: float) -> bool:
        try:
            await self.request("GET", endpoint, timeout_s=timeout_s, retries=0)
            return True
        except (EngineHTTPError, EngineUnreachable):
            return False

    async def get_model_info(self) -> dict:
        return await self.request("GET", "/model_info")

    async def get_server_info(self) -> dict:
        return await self.request("GET", "/server_info")

    async def get_weight_version(self) -> int:
        """``weight_version`` of ``/model_info`` (sglang 0.5.23 has no ``/get_weight_version``)."""
        info = await self.get_model_info()
        return parse_version(info.get("weight_version"), f"{self.url}/model_info weight_version")
