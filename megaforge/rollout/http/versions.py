"""Which SGLang releases megaforge speaks to, and what each one can do.

An HTTP engine learns its server's release from ``GET /server_info`` (``"version"``; megaforge's
embedded server reports ``"frontend": "megaforge-embedded"`` and the SGLang API it follows in
``"sglang_api"``) and derives its :class:`ServerCaps` from the release, not from probing endpoints
one by one. The differences that matter to an RL client, read from each release's
``srt/entrypoints/http_server.py`` and ``srt/managers/io_struct.py``:

=========================  ========  ========  ===========================================
ability                    0.5.16    0.5.23    first release with the change
=========================  ========  ========  ===========================================
``/begin_weight_update``   no        yes       0.5.21: ``update_weights_from_tensor`` and
``/end_weight_update``                         ``..._from_distributed`` fail outside a session
``/get_weight_version``    yes       no        0.5.21 (``/model_info`` has ``weight_version``
                                               in every release: megaforge reads that one)
``/weights_checker``       yes       yes       (``action: checksum``: per-tensor hashes)
``/get_weights_by_name``   llama-like families only (400 for Qwen2 / Qwen3)
=========================  ========  ========  ===========================================

The request fields megaforge sends (``/generate``, the weight updates, memory release/resume,
pause/continue, abort) are the same in every release from 0.5.16 to 0.5.23.

``TESTED`` says how each release was exercised. A release outside ``[MIN_VERSION, newest tested]``
is refused (older) or accepted with a warning (newer: it is assumed to behave as the newest).
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("megaforge.rollout.http.versions")

#: release -> how it was tested
TESTED = {
    "0.5.16": "real server on an H200 (tests/gpu, the main-path recipe, benchmarks); the newest release that "
              "pins torch 2.11",
    "0.5.23": "endpoints and request fields read from its source; the client runs against megaforge's "
              "embedded server speaking its API (--sglang-api 0.5.23) in CPU tests (it pins torch 2.14.1, "
              "which the GPU machine cannot run)",
}
MIN_VERSION = (0, 5, 16)
SESSION_SINCE = (0, 5, 21)  # /begin_weight_update .. /end_weight_update required around updates
EMBEDDED = "megaforge-embedded"


class UnsupportedServer(RuntimeError):
    pass


def parse_release(text: str) -> tuple[int, ...]:
    """``"0.5.16"`` / ``"0.5.15.post1"`` / ``"0.5.23rc1"`` -> (0, 5, 16) ... (post and rc tags dropped)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise UnsupportedServer(f"cannot read an SGLang release from {text!r}")
    return tuple(int(x) for x in m.groups(default="0"))


@dataclass(frozen=True)
class ServerCaps:
    """What one engine server can do (derived from its release)."""

    frontend: str  # "sglang" | "megaforge-embedded"
    version: str  # the release as the server reports it
    api: tuple  # the SGLang API release it follows
    weight_update_session: bool  # updates must sit between /begin_weight_update and /end_weight_update
    weights_checker: bool  # SGLang's /weights_checker (per-tensor hashes)
    weights_checksum: bool  # megaforge's /get_weights_checksum (sha256 in the engine's dtype)

    @property
    def label(self) -> str:
        api = ".".join(map(str, self.api))
        return f"sglang {self.version}" if self.frontend == "sglang" else f"{self.frontend} (SGLang API {api})"


def caps_for_release(version: str, frontend: str = "sglang", api: Optional[str] = None) -> ServerCaps:
    rel = parse_release(api or version)
    if rel < MIN_VERSION:
        raise UnsupportedServer(f"SGLang {api or version} is older than the oldest release megaforge supports "
                                f"({'.'.join(map(str, MIN_VERSION))}); tested: {', '.join(TESTED)}")
    newest = max(parse_release(v) for v in TESTED)
    if frontend == "sglang" and rel > newest:
        log.warning("SGLang %s is newer than the newest release megaforge is tested with (%s); assuming it behaves "
                    "as %s", version, ".".join(map(str, newest)), ".".join(map(str, newest)))
    embedded = frontend == EMBEDDED
    return ServerCaps(frontend=frontend, version=str(version), api=rel, weight_update_session=rel >= SESSION_SINCE,
                      weights_checker=not embedded, weights_checksum=embedded)


def caps_from_server_info(info: dict, url: str = "") -> ServerCaps:
    """Capabilities from a ``/server_info`` answer (real SGLang or megaforge's embedded server)."""
    if not isinstance(info, dict):
        raise UnsupportedServer(f"{url}/server_info answered {type(info).__name__}, not an object")
    if info.get("frontend") == EMBEDDED:
        return caps_for_release(info.get("version", "?"), EMBEDDED, info.get("sglang_api") or "0.5.23")
    if "version" not in info:
        raise UnsupportedServer(f"{url}/server_info has no 'version': not an SGLang server megaforge knows")
    return caps_for_release(info["version"])
