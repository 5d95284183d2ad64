"""A reward computed by an HTTP service (``rewards.functions: [{name: remote, url: ...}]``).

Wire format (slime's, plus a batched form; :mod:`megaforge.rewards.serve` speaks both):

* single: ``POST url`` with the JSON object ``{"prompt": str, "response": str, "label": any}``,
  answered (HTTP 200) by a JSON number or an object ``{"reward": number}``.
* batched (``batch_size`` > 0): ``POST url`` with a JSON list of such objects, answered by a JSON
  list as long, in the same order; each entry a number, ``{"reward": number}``, or
  ``{"error": str}`` for a sample the service could not score (that sample fails alone).

Every request carries ``Authorization: Bearer <token>`` when a token is configured (``api_key``,
or the environment variable named by ``api_key_env``); the token appears in no message. A call of
the reward scores its samples with up to ``max_concurrency`` requests in flight (one per sample,
or one per ``batch_size`` samples). Each attempt of a request, from connecting to the answer's last
byte, has ``request_timeout_s``, and an answer is read up to ``max_response_mb`` MiB (a longer one,
declared or streamed, fails the request without being read further). Redirects are not followed
(a 3xx fails the request naming its ``Location``: the samples go to the configured URL only).
Connection errors (refused, reset, dropped) and HTTP 502 / 503 / 504 are retried ``retries`` times
after ``backoff_s * 2**k`` seconds (scoring is a pure function of the request, so a repeated
request is harmless).

A sample fails (scored 0 by the manager, counted in ``reward/errors``; a request past its timeout
in ``reward/timeouts``) with a message naming the URL and the problem when the service is down, too
slow, answers a status other than 200, too much, non-JSON, or a list of the wrong length; an entry
that is not a reward (a number, or ``{"reward": number}``, within the bound of
:mod:`megaforge.rewards.values`: a string, a bool, NaN, 1e300 or a 401-digit integer is refused)
fails its own sample only.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
from typing import Any, Optional, Sequence

from megaforge.rewards.values import reward_value

RETRY_STATUS = (502, 503, 504)


class RewardServiceError(RuntimeError):
    """The service failed a sample (the message names the URL and the problem)."""


class RewardServiceTimeout(TimeoutError):
    """No answer within ``request_timeout_s`` (counted in reward/timeouts)."""


def _short(v: Any, n: int = 200) -> str:
    s = v if isinstance(v, str) else json.dumps(v, allow_nan=True, default=str)
    return s if len(s) <= n else s[:n] + "..."


def parse_reward(value: Any, where: str) -> float:
    """A reward from one answer entry: a number or ``{"reward": number}``, finite."""
    if isinstance(value, dict):
        if "reward" not in value:
            if "error" in value:
                raise RewardServiceError(f"{where}: the service failed this sample: {_short(value['error'])}")
            raise RewardServiceError(f"{where}: answered an object without 'reward': {_short(value)}")
        value = value["reward"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardServiceError(f"{where}: answered {_short(value)}, not a number or {{\"reward\": number}}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RewardServiceError(f"{where}: answered a non-finite reward {value}")
    try:
        return reward_value(value)
    except ValueError as e:
        raise RewardServiceError(f"{where}: {str(e).replace('returned', 'answered', 1)}") from None


def _json_int(digits: str):
    """JSON integers as ints, except past Python's conversion limit (4300 digits): inf (refused)."""
    return int(digits) if len(digits) < 4300 else math.inf


def parse_answer(answer: Any, n: int, batched: bool, where: str) -> list:
    """The values (a float, or the exception failing that sample) of one request's ``n`` samples."""
    if not batched:
        try:
            return [parse_reward(answer, where)]
        except RewardServiceError as e:
            return [e]
    if not isinstance(answer, list):
        raise RewardServiceError(f"{where}: answered {type(answer).__name__} {_short(answer, 100)} to a batch of {n}, "
                                 f"not a list")
    if len(answer) != n:
        raise RewardServiceError(f"{where}: answered a list of {len(answer)} rewards for {n} samples")
    out = []
    for k, v in enumerate(answer):
        try:
            out.append(parse_reward(v, f"{where} (entry {k})"))
        except RewardServiceError as e:
            out.append(e)
    return out


class RemoteReward:
    """An HTTP reward service client (see the module docstring). A batched reward for the executor:
    ``score_batch`` takes up to :attr:`batch_size` samples (``max_concurrency`` requests' worth)."""

    def __init__(self, url: str, api_key: str = "", batch_size: int = 0, max_concurrency: int = 8,
                 request_timeout_s: float = 10.0, retries: int = 3, backoff_s: float = 0.5,
                 max_response_mb: float = 4.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"remote reward: url must be http(s)://..., got {url!r}")
        self.url, self._token = url, api_key
        self.per_request, self.max_concurrency = int(batch_size), max(1, int(max_concurrency))
        self.request_timeout_s, self.retries, self.backoff_s = float(request_timeout_s), int(retries), float(backoff_s)
        self.max_response_mb = float(max_response_mb)
        self.max_response_bytes = int(self.max_response_mb * (1 << 20))
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._session = None

    @classmethod
    def from_spec(cls, spec) -> "RemoteReward":
        token = spec.api_key
        if spec.api_key_env:
            token = os.environ.get(spec.api_key_env, "")
            if not token:
                raise ValueError(f"remote reward {spec.url}: api_key_env names the environment variable "
                                 f"{spec.api_key_env!r}, which is not set (or empty) in the reward workers")
        return cls(spec.url, token, spec.batch_size, spec.max_concurrency, spec.request_timeout_s, spec.retries,
                   spec.backoff_s, spec.max_response_mb)

    def __repr__(self) -> str:  # no token
        return f"RemoteReward({self.url!r}, batch_size={self.per_request}, auth={'yes' if self._token else 'no'})"

    @property
    def batch_size(self) -> int:
        """Samples per :meth:`score_batch` call: max_concurrency requests of their samples each."""
        return max(1, self.per_request) * self.max_concurrency

    def __call__(self, prompt: str, response: str, target) -> float:
        (v,) = self.score_batch([prompt], [response], [target])
        if isinstance(v, BaseException):
            raise v
        return v

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence) -> list:
        """One value per sample: a float, or the exception that failed it."""
        items = [{"prompt": p, "response": r, "label": t} for p, r, t in zip(prompts, responses, targets)]
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self._score(items))

    def close(self) -> None:
        if self._loop is not None:
            if self._session is not None:
                self._loop.run_until_complete(self._session.close())
            self._loop.close()
        self._loop = self._session = None

    # ------------------------------------------------------------------------------- internals
    def _ensure_session(self):
        import aiohttp

        if self._session is None:
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            self._session = aiohttp.ClientSession(headers=headers,
                                                  connector=aiohttp.TCPConnector(limit=self.max_concurrency))
        return self._session

    async def _score(self, items: list[dict]) -> list:
        session = self._ensure_session()
        size = self.per_request or 1
        parts = [list(range(s, min(s + size, len(items)))) for s in range(0, len(items), size)]
        sem = asyncio.Semaphore(self.max_concurrency)
        out: list = [None] * len(items)

        async def one(idx: list[int]) -> None:
            batched = self.per_request > 0
            async with sem:
                try:
                    answer = await self._post(session, [items[i] for i in idx] if batched else items[idx[0]])
                    values = parse_answer(answer, len(idx), batched, self.url)
                except (RewardServiceError, RewardServiceTimeout) as e:
                    values = [e] * len(idx)
            for i, v in zip(idx, values):
                out[i] = v

        await asyncio.gather(*(one(idx) for idx in parts))
        return out

    async def _read(self, resp) -> str:
        """The answer's body, at most ``max_response_bytes`` (RewardServiceError beyond, unread)."""
        too_long = RewardServiceError(f"{self.url}: answered more than max_response_mb={self.max_response_mb:g} MiB")
        if resp.content_length is not None and resp.content_length > self.max_response_bytes:
            raise too_long
        data = bytearray()
        while True:
            chunk = await resp.content.read(1 << 16)
            if not chunk:
                return data.decode("utf-8", errors="replace")
            data += chunk
            if len(data) > self.max_response_bytes:
                raise too_long

    async def _attempt(self, session, body) -> tuple[int, str]:
        """(status, body) of one attempt; a redirect is an error naming its Location."""
        async with session.post(self.url, json=body, allow_redirects=False) as resp:
            if 300 <= resp.status < 400:
                where = resp.headers.get("Location", "")
                where = str(resp.url.join(type(resp.url)(where))) if where else "(no Location)"
                raise RewardServiceError(f"{self.url}: HTTP {resp.status} redirect to {_short(where, 200)}: "
                                         f"redirects are not followed")
            return resp.status, await self._read(resp)

    async def _post(self, session, body) -> Any:
        import aiohttp

        for k in range(self.retries + 1):
            last = k == self.retries
            try:
                # the deadline covers connecting, the headers and the whole body
                status, text = await asyncio.wait_for(self._attempt(session, body), self.request_timeout_s)
            except TimeoutError:  # asyncio's and aiohttp's (ServerTimeoutError) timeouts
                raise RewardServiceTimeout(f"{self.url}: no answer within request_timeout_s="
                                           f"{self.request_timeout_s:g} s") from None
            except aiohttp.ClientConnectionError as e:  # refused, reset, dropped
                if last:
                    raise RewardServiceError(f"{self.url}: unreachable after {k + 1} attempt(s): "
                                             f"{type(e).__name__}: {e}") from None
            except aiohttp.ClientError as e:  # a malformed answer (payload, headers)
                raise RewardServiceError(f"{self.url}: bad answer: {type(e).__name__}: {e}") from None
            else:
                if status in RETRY_STATUS and not last:
                    pass
                elif status != 200:
                    raise RewardServiceError(f"{self.url}: HTTP {status}"
                                             f"{' after ' + str(k + 1) + ' attempts' if status in RETRY_STATUS else ''}"
                                             f": {_short(text.strip(), 300)}")
                else:
                    try:
                        return json.loads(text, parse_int=_json_int)
                    except ValueError:
                        raise RewardServiceError(f"{self.url}: answered non-JSON (HTTP 200): {_short(text, 200)!r}") \
                            from None
            await asyncio.sleep(self.backoff_s * 2 ** k)
        raise AssertionError("unreachable")
