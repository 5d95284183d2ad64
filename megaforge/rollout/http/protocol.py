"""SGLang's native HTTP API as megaforge speaks it: request schemas and the /generate answer.

Field names and types follow sglang 0.5.23 (``srt/managers/io_struct.py``: ``GenerateReqInput``,
``UpdateWeightsFromTensorReqInput``, ``UpdateWeightFromDiskReqInput``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``, ...; the
``sampling_params`` object of ``sglang/api/v1/api_types.py``). Weight versions are strings there
(``--weight-version``, default ``"default"``); megaforge sends ``str(int)`` and reads them back with
:func:`parse_version`.

:func:`validate` checks a JSON body against an endpoint's schema: an unknown field or a value of the
wrong type raises :class:`FieldError` naming the field by its dotted path (e.g.
``sampling_params[1].temperature``); the embedded server turns it into HTTP 400.

One ``/generate`` answer item (a list of them for a batch request)::

    {"text": str, "output_ids": [int],
     "meta_info": {"id": rid, "finish_reason": {"type": "stop", "matched": int|str}
                                              | {"type": "length", "length": int}
                                              | {"type": "abort", "message": str, ...},
                   "prompt_tokens": int, "completion_tokens": int, "cached_tokens": int,
                   "weight_version": str,
                   "output_token_logprobs": [[logprob, token_id, text|null], ...],   # return_logprob
                   "routed_experts": base64 text}}      # return_routed_experts (megaforge.rollout.routing)
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


class FieldError(ValueError):
    """A request field is unknown, missing or of the wrong type; ``.field`` is its dotted path."""

    def __init__(self, field: str, message: str):
        super().__init__(f"field `{field}`: {message}")
        self.field = field


class StateError(RuntimeError):
    """A well-formed request the server's state forbids (HTTP 400 ``{"error": {"message"}}``, as SGLang)."""


class LengthError(ValueError):
    """A prompt, or prompt + max_new_tokens, beyond the model's context (HTTP 400 ``{"error": {"message"}}``
    with SGLang's wording: :func:`input_too_long`, :func:`total_too_long`)."""


def input_too_long(n_input: int, context: int) -> str:
    """SGLang's message (``TokenizerManager._validate_one_request``) for an input of ``n_input`` tokens."""
    return f"The input ({n_input} tokens) is longer than the model's context length ({context} tokens)."


def total_too_long(n_input: int, max_new: int, context: int) -> str:
    """SGLang's message for ``n_input + max_new_tokens`` beyond the context."""
    return (f"Requested token count exceeds the model's maximum context length of {context} tokens. You requested "
            f"a total of {n_input + max_new} tokens: {n_input} tokens from the input messages and {max_new} tokens "
            f"for the completion. Please reduce the number of tokens in the input messages or the completion to "
            f"fit within the limit.")


# ------------------------------------------------------------------------------------ checkers
Check = Callable[[Any, str], Any]


def _type_name(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _expect(ok: bool, v: Any, path: str, what: str) -> None:
    if not ok:
        raise FieldError(path, f"expected {what}, got {_type_name(v)} {v!r:.80}")


def t_str(v, p):
    _expect(isinstance(v, str), v, p, "a string")
    return v


def t_int(v, p):
    _expect(isinstance(v, int) and not isinstance(v, bool), v, p, "an integer")
    return v


def t_float(v, p):
    _expect(isinstance(v, (int, float)) and not isinstance(v, bool), v, p, "a number")
    _expect(math.isfinite(v), v, p, "a finite number")  # JSON's NaN / Infinity extensions are refused
    return float(v)


def t_bool(v, p):
    _expect(isinstance(v, bool), v, p, "a boolean")
    return v


def opt(check: Check) -> Check:
    return lambda v, p: None if v is None else check(v, p)


def list_of(check: Check, what: str = "an array") -> Check:
    def run(v, p):
        _expect(isinstance(v, list), v, p, what)
        return [check(x, f"{p}[{i}]") for i, x in enumerate(v)]
    return run


def one_or_list(check: Check, what: str) -> Check:
    """A value, or an array of values (batch requests)."""
    def run(v, p):
        if isinstance(v, list):
            return [check(x, f"{p}[{i}]") for i, x in enumerate(v)]
        try:
            return check(v, p)
        except FieldError:
            raise FieldError(p, f"expected {what}, got {_type_name(v)} {v!r:.80}") from None
    return run


def choice(*values: str) -> Check:
    def run(v, p):
        _expect(isinstance(v, str) and v in values, v, p, f"one of {list(values)}")
        return v
    return run


def t_input_ids(v, p):
    _expect(isinstance(v, list) and len(v) > 0, v, p, "a non-empty array of token ids (or of arrays)")
    if all(isinstance(x, list) for x in v):
        return [list_of(t_int)(x, f"{p}[{i}]") for i, x in enumerate(v)]
    return list_of(t_int)(v, p)


def t_object(v, p):
    _expect(isinstance(v, dict), v, p, "an object")
    return v


# ------------------------------------------------------------------------------------- schemas
REQUIRED = object()

SAMPLING_PARAMS: dict[str, tuple[Check, Any]] = {
    "temperature": (t_float, 1.0), "top_p": (t_float, 1.0), "top_k": (t_int, -1),
    "max_new_tokens": (t_int, 128), "stop": (opt(one_or_list(t_str, "a string or an array of strings")), None),
    "stop_token_ids": (opt(list_of(t_int)), None), "no_stop_trim": (t_bool, False),
    "skip_special_tokens": (t_bool, True), "spaces_between_special_tokens": (t_bool, True),
    "sampling_seed": (opt(t_int), None),
    "ignore_eos": (t_bool, False),
    # accepted at their default value only (the embedded engine has no such control)
    "min_p": (t_float, 0.0), "frequency_penalty": (t_float, 0.0), "presence_penalty": (t_float, 0.0),
    "repetition_penalty": (t_float, 1.0), "min_new_tokens": (t_int, 0), "n": (t_int, 1),
}
SAMPLING_EPS = 1e-6
DEFAULT_ONLY = ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n")

_RID = {"rid": (opt(t_str), None)}
SCHEMAS: dict[str, dict[str, tuple[Check, Any]]] = {
    "/generate": {
        "rid": (opt(one_or_list(t_str, "a string or an array of strings")), None),
        "text": (opt(one_or_list(t_str, "a string or an array of strings")), None),
        "input_ids": (opt(t_input_ids), None),
        "sampling_params": (opt(one_or_list(t_object, "an object or an array of objects")), None),
        "return_logprob": (opt(one_or_list(t_bool, "a boolean or an array of booleans")), None),
        "logprob_start_len": (opt(one_or_list(t_int, "an integer or an array of integers")), None),
        "top_logprobs_num": (opt(one_or_list(t_int, "an integer or an array of integers")), None),
        "return_text_in_logprobs": (t_bool, False),
        "stream": (t_bool, False),
        "return_routed_experts": (t_bool, False),
        "routed_experts_start_len": (t_int, 0),
    },
    "/update_weights_from_tensor": {
        **_RID, "serialized_named_tensors": (list_of(t_str, "an array of base64 strings"), REQUIRED),
        "load_format": (opt(t_str), None), "flush_cache": (t_bool, True), "abort_all_requests": (t_bool, False),
        "weight_version": (opt(t_str), None), "torch_empty_cache": (t_bool, False),
        "selector": (choice("target", "all"), "all"),
    },
    "/update_weights_from_disk": {
        **_RID, "model_path": (t_str, REQUIRED), "load_format": (opt(t_str), None),
        "abort_all_requests": (t_bool, False), "weight_version": (opt(t_str), None), "flush_cache": (t_bool, True),
        "torch_empty_cache": (t_bool, False),
    },
    "/init_weights_update_group": {
        **_RID, "master_address": (t_str, REQUIRED), "master_port": (t_int, REQUIRED),
        "rank_offset": (t_int, REQUIRED), "world_size": (t_int, REQUIRED),
        "group_name": (t_str, "weight_update_group"), "backend": (t_str, "nccl"),
    },
    "/update_weights_from_distributed": {
        **_RID, "names": (list_of(t_str), REQUIRED), "dtypes": (list_of(t_str), REQUIRED),
        "shapes": (list_of(list_of(t_int)), REQUIRED), "group_name": (t_str, "weight_update_group"),
        "flush_cache": (t_bool, True), "abort_all_requests": (t_bool, False), "weight_version": (opt(t_str), None),
        "load_format": (opt(t_str), None), "torch_empty_cache": (t_bool, False), "selector": (choice("target", "all"), "all"),
    },
    "/destroy_weights_update_group": {**_RID, "group_name": (t_str, "weight_update_group")},
    "/begin_weight_update": {**_RID, "selector": (choice("target", "all"), "all")},
    "/end_weight_update": {**_RID},
    "/update_weight_version": {**_RID, "new_version": (t_str, REQUIRED), "abort_all_requests": (t_bool, False)},
    "/release_memory_occupation": {**_RID, "tags": (opt(list_of(choice(*MEMORY_TAGS))), None)},
    "/resume_memory_occupation": {**_RID, "tags": (opt(list_of(choice(*MEMORY_TAGS))), None)},
    "/abort_request": {"rid": (opt(t_str), ""), "abort_all": (t_bool, False)},
    "/pause_generation": {**_RID, "mode": (choice("abort", "retract", "in_place"), "abort")},
    "/continue_generation": {**_RID, "torch_empty_cache": (t_bool, True)},
    # sync.check_equal: /get_weights_by_name as sglang 0.5.23; /get_weights_checksum is megaforge's
    "/get_weights_by_name": {**_RID, "name": (t_str, REQUIRED), "truncate_size": (t_int, 100)},
    "/get_weights_checksum": {**_RID, "names": (opt(list_of(t_str)), None), "hash": (t_bool, True)},
}


def validate(fields: dict[str, tuple[Check, Any]], body: Any, prefix: str = "") -> dict:
    """``body`` checked against ``fields``; missing optional fields get their default."""
    where = prefix or "request body"
    if not isinstance(body, dict):
        raise FieldError(prefix or "<body>", f"{where} must be a JSON object, got {_type_name(body)}")
    unknown = [k for k in body if k not in fields]
    if unknown:
        path = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise FieldError(path, f"unknown field; expected one of {sorted(fields)}")
    out = {}
    for name, (check, default) in fields.items():
        path = f"{prefix}.{name}" if prefix else name
        if name in body:
            out[name] = check(body[name], path)
        elif default is REQUIRED:
            raise FieldError(path, "missing required field")
        else:
            out[name] = default
    return out


def validate_sampling(sp: Optional[dict], path: str) -> dict:
    out = validate(SAMPLING_PARAMS, sp or {}, path)
    for name in DEFAULT_ONLY:
        if out[name] != SAMPLING_PARAMS[name][1]:
            raise FieldError(f"{path}.{name}", f"only the default value {SAMPLING_PARAMS[name][1]!r} is "
                                               f"supported by megaforge's embedded server")
    if out["max_new_tokens"] < 1:
        raise FieldError(f"{path}.max_new_tokens", "must be >= 1 (the embedded server returns no prompt logprobs)")
    if not 0.0 < out["top_p"] <= 1.0:
        raise FieldError(f"{path}.top_p", f"must be in (0, 1], got {out['top_p']}")
    if out["temperature"] < 0:
        raise FieldError(f"{path}.temperature", f"must be a non-negative finite number, got {out['temperature']}")
    if out["temperature"] < SAMPLING_EPS:  # as SGLang: a temperature below 1e-6 is greedy decoding
        out["temperature"] = 0.0
    if out["top_k"] < 1 and out["top_k"] != -1:
        raise FieldError(f"{path}.top_k", f"must be -1 (disable) or at least 1, got {out['top_k']}")
    if out["sampling_seed"] is not None and not 0 <= out["sampling_seed"] < 1 << 63:
        raise FieldError(f"{path}.sampling_seed", f"must be in [0, 2**63), got {out['sampling_seed']}")
    return out


# ------------------------------------------------------------------------------ /generate answer
def finish_reason_json(reason: str, output_ids: list[int], stop_ids: list[int], stop_strs: list[str], text: str) -> dict:
    if reason == "stop":
        if output_ids and output_ids[-1] in stop_ids:
            return {"type": "stop", "matched": output_ids[-1]}
        return {"type": "stop", "matched": next((s for s in stop_strs if s in text), None)}
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def parse_version(v: Any, where: str = "weight_version") -> int:
    """An SGLang weight version string as megaforge's int (``"default"``, a fresh server, is 0)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if v == "default":
        return 0
    if isinstance(v, str) and v.lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"{where}: {v!r} is not an integer weight version (megaforge sets versions with str(int))")


def completion_from_output(out: dict, endpoint: str = "/generate", routed_prompt_len: Optional[int] = None):
    """A :class:`megaforge.types.Completion` from one /generate answer item requested with ``return_logprob``
    (and ``return_routed_experts`` when ``routed_prompt_len``, the request's prompt length, is given: its
    ``routed_experts`` decoded to [prompt + output - 1, layers * topk] int32)."""
    from megaforge.types import Completion  # lazy: torch; the aiohttp client imports this module

    try:
        meta = out["meta_info"]
        ids = [int(x) for x in out["output_ids"]]
        lps = meta["output_token_logprobs"]
        reason = meta["finish_reason"]
        version = meta["weight_version"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{endpoint}: answer item lacks {e} (have {sorted(out) if isinstance(out, dict) else type(out)})") from None
    if len(lps) != len(ids) or any(int(lp[1]) != t for lp, t in zip(lps, ids)):
        raise ValueError(f"{endpoint} ({meta.get('id')}): meta_info.output_token_logprobs does not match output_ids "
                         f"({len(lps)} logprobs for {len(ids)} tokens)")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"{endpoint} ({meta.get('id')}): unknown meta_info.finish_reason {reason!r}")
    routed = None
    if routed_prompt_len is not None and kind != "abort":
        from megaforge.rollout.routing import decode  # lazy: torch, as above

        where = f"{endpoint} ({meta.get('id')})"
        if "routed_experts" not in meta:
            raise ValueError(f"{where}: no meta_info.routed_experts although return_routed_experts was asked (start the "
                             f"server with --enable-return-routed-experts)")
        routed = decode(meta["routed_experts"], routed_prompt_len + len(ids) - 1, where)
    return Completion(rid=str(meta.get("id", "")), output_ids=ids, output_logprobs=[float(lp[0]) for lp in lps],
                      finish_reason=kind, weight_version=parse_version(version, f"{endpoint} meta_info.weight_version"),
                      text=out.get("text", ""), routed_experts=routed)
