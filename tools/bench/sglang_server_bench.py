"""The SGLang side of ``bench_rollout.py --sglang``: what the fast engine is measured against.

A real SGLang server (``python -m sglang.launch_server``), or megaforge's embedded server speaking the
same protocol (``--sglang_server embedded``: the CPU check of this code path), started with the command
line and environment a run gives its SGLang engine (:func:`server_launch`), serving a shape's random
weights saved with a tokenizer folder. Measured: the server's sampled tokens per second over one
batched ``/generate`` of B prompts (``input_ids``, temperature 1, ``ignore_eos``, logprobs returned,
as megaforge's rollout asks), a warm-up run, then ``--repeats`` timed runs with the prefix cache
flushed after each, the median reported (:func:`measure_sglang`); one server per attention backend
(``--sglang_attention``) at every batch size, the last one's memory released before the fast engine's
runs on the same requests (:func:`sglang_rows`). bench_rollout.py runs the fast engine's side and the
ratios; this module does not import it.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/: common.py
from common import ROOT, Stopwatch, timed_runs  # noqa: E402

TOKENIZER = os.path.join(ROOT, "assets", "tiny-tokenizer")


def backend_suffix(attention: str | None) -> str:
    """The suffix of an attention backend's row (``sglang`` + it) and ratios (``ratio<variant>`` + it):
    ``_<backend>`` with ``--sglang_attention``, nothing for the one ``--sglang_args`` names."""
    return "" if attention is None else f"_{attention}"


def with_attention(server_args: str, attention: str | None) -> list[str]:
    """``server_args`` split, with ``--attention-backend`` set to ``attention`` (replaced where the args
    name one, appended where not); None leaves them as they are."""
    argv = server_args.split()
    if attention is None:
        return argv
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--attention-backend":
            skip = True
        elif not a.startswith("--attention-backend="):
            out.append(a)
    return out + ["--attention-backend", attention]


def server_launch(model_dir: str, args, attention: str | None = None):
    """The server this bench starts, built as a run builds its engines' servers: the engine kind's
    :class:`~megaforge.rollout.http.start.Servers` (megaforge.rollout.http.sglang, or embedded_server
    for ``--sglang_server embedded``), a run config with the bench's settings and the
    :class:`~megaforge.rollout.http.start.ServerStart`. Settings: ``rollout.engine_python`` =
    ``--sglang_python``, ``rollout.engine_env`` = what ``--sglang_env_sh`` sets, ``rollout.mem_fraction``
    = ``--sglang_mem``, ``rollout.extra_args`` = ``--sglang_args`` (SGLang only), ``model.dtype`` the
    bench's; colocated (``rollout.num_gpus 0``: SGLang's memory saver, which the release of its memory
    before the fast engine's runs needs), TP 1 on 127.0.0.1, seed 0, ``rollout.engine_batch_size`` 4096
    (the embedded server), no training steps (``max_steps 0``: no data), no API key, the tokenizer saved
    beside the weights. Returns (servers, spec, start): ``spec`` the EngineSpec a run gives its engine kind."""
    from megaforge.build import RunBuilder
    from megaforge.config import config_from_dict
    from megaforge.rollout.http import embedded_server, sglang
    from megaforge.rollout.http.start import ServerStart
    from megaforge.supervise import env_from_script

    real = args.sglang_server == "sglang"
    cfg = config_from_dict({"seed": 0, "max_steps": 0, "model": {"path": model_dir, "dtype": args.dtype_name}, "rollout": {
        "engine": "sglang" if real else "embedded_server", "device": args.device, "host": "127.0.0.1",
        "num_gpus": 0, "tensor_parallel": 1, "mem_fraction": args.sglang_mem, "engine_python": args.sglang_python,
        "engine_env": env_from_script(args.sglang_env_sh) if args.sglang_env_sh and real else {},
        "extra_args": with_attention(args.sglang_args, attention) if real else [], "engine_batch_size": 4096}})
    return ((sglang if real else embedded_server).SERVERS, RunBuilder(cfg).engine_spec(),
            ServerStart(model_dir, "", "", [], torch.device(args.device)))


class SGLangServer:
    """A server of ``model_dir`` on this machine's GPU (``--sglang_server sglang``), or megaforge's
    embedded server speaking the same protocol (``embedded``: the CPU check of this code path), started
    with the command line and environment a run gives its engine (:func:`server_launch`)."""

    def __init__(self, model_dir: str, args, log_path: str, attention: str | None = None):
        import asyncio
        import functools

        from megaforge.rollout.http.client import SGLangClient
        from megaforge.rollout.http.processes import ServerProcess

        servers, cfg, start = server_launch(model_dir, args, attention)
        proc = ServerProcess(args.sglang_server, functools.partial(servers.command, cfg, start), log_path,
                             host=cfg.rollout.host, env=servers.env(cfg, start), hold_socket=servers.hold_socket)
        with Stopwatch() as w:
            self.proc = proc.start_ready(900.0)
        self.start_s = w.seconds
        self.loop = asyncio.new_event_loop()
        self.client = SGLangClient(self.proc.url, timeout_s=1800.0)
        self.info = self.call(self.client.get_server_info())

    def call(self, coro):
        return self.loop.run_until_complete(coro)

    def stop(self) -> None:
        self.call(self.client.close())
        self.proc.stop()
        self.loop.close()


def measure_sglang(srv: SGLangServer, prompts, new: int, repeats: int = 1) -> dict:
    """A warm-up run, then ``repeats`` timed runs of one batched /generate (the prefix cache flushed
    after each); the median by tok/s (:func:`timed_runs`)."""
    payload = {"input_ids": prompts.tolist(), "return_logprob": True,
               "sampling_params": [{"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": new,
                                    "ignore_eos": True}] * prompts.shape[0]}

    def once():
        with Stopwatch() as w:
            outs = srv.call(srv.client.generate(payload))
        return sum(len(o["output_ids"]) for o in outs), w.seconds

    w_tok, w_wall = once()
    srv.call(srv.client.flush_cache())
    runs = []
    for _ in range(repeats):
        runs.append(once())
        srv.call(srv.client.flush_cache())
    return dict(timed_runs(runs), warmup_s=round(w_wall, 3), capped=min(t for t, _ in runs) < prompts.shape[0] * new)


def sglang_rows(shape: str, model, args, dev, tmp: str, fast_rows, guard, say) -> dict:
    """SGLang at every batch size, then the fast engine on the same requests: the shape's weights saved
    with the tokenizer under ``tmp``, B random prompts per batch size (seed B), one server per attention
    backend (``--sglang_attention``, else the one ``--sglang_args`` names; each stopped before the next
    starts) measured into ``rows[B]["sglang" + backend_suffix]``; with the last server's memory
    released (the fast engine's model idle on the GPU until then), ``fast_rows(prompts, rows)`` adds
    the fast engine's rows. ``guard(fn)`` runs one measurement (a failure becomes a note), ``say``
    logs. Returns the servers' info (``servers``: per backend with ``--sglang_attention``) and
    ``batches``: {str(B): row}."""
    from transformers import AutoTokenizer

    d = os.path.join(tmp, shape)
    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(d)
    V = model.config.vocab_size
    prompts = {B: torch.randint(3, V, (B, args.prompt), generator=torch.Generator().manual_seed(B)).to(dev)
               for B in args.batches}
    rows = {str(B): {} for B in args.batches}
    out = {}
    backends = args.sglang_attention or [None]
    for i, attn in enumerate(backends):  # one server per attention backend, each stopped before the next starts
        key = "sglang" + backend_suffix(attn)
        say(f"{shape}: starting the {args.sglang_server} server" + (f" (--attention-backend {attn})" if attn else ""))
        srv = SGLangServer(d, args, os.path.join(tmp, f"{shape}-{key}-server.log"), attention=attn)
        info = {"server_start_s": round(srv.start_s, 1), "server_version": srv.info.get("version"),
                "cuda_graph_max_bs": srv.info.get("cuda_graph_max_bs"), "attention_backend": srv.info.get("attention_backend")}
        if attn is None:
            out.update(info)
        else:
            out.setdefault("servers", {})[attn] = info
        last = i == len(backends) - 1
        try:
            for B in args.batches:
                say(f"{shape} B={B}: {key}")
                rows[str(B)][key] = guard(lambda: measure_sglang(srv, prompts[B], args.new, args.repeats))
                say(f"  {key}: {rows[str(B)][key].get('tok_s')} tok/s")
            if last:  # the fast engine runs while the last server's memory is released
                srv.call(srv.client.release_memory_occupation(["kv_cache", "weights"]))
                fast_rows(prompts, rows)
        finally:
            srv.stop()
    out["batches"] = rows
    return out
