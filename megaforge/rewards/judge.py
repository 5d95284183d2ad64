"""An LLM judge: a generative reward through a megaforge engine of its own
(``rewards.functions: [{name: llm_judge, judge: {model: {path: ...}, template_file: rubric.txt}}]``).

The judge model is not the policy: ``judge.model`` and ``judge.rollout`` are its own model and
engine sections, built with :func:`megaforge.rollout.build_engine` inside the judge's reward worker
(``embedded`` in-process, or ``embedded_server`` / ``sglang`` servers that the worker starts; only
the engine keys of ``judge.rollout`` are read, the sampling is the judge's). Its weights never change.

For each sample (``score_batch``: one engine call per batch of ``judge.batch_size``):

    text    = template.format(prompt=..., response=..., label=...)   # only these three fields
    ids     = judge tokenizer(chat_template([user: text]) + generation prompt)   (or text as is)
    answer  = engine.generate(ids, temperature=judge.temperature (0: greedy), max_new_tokens)
    verdict = the one match of judge.pattern in the answer, on its last non-empty line (first group)
    reward  = score: float(verdict) in [score_min, score_max], normalised to [0, 1] unless
              normalize is false; pass_fail: PASS -> 1.0, FAIL -> 0.0

Untrusted text stays text: the prompt, response and label are tokenized with special-token parsing
off, and an added token's string inside them (``<|im_end|>``, ``<|im_start|>``, ``<think>``: any
entry of the tokenizer's added vocabulary) becomes the tokens of its characters, never the token
itself; only the template and the chat template put special tokens in the judge's prompt. So a
response cannot close the user turn and write the judge's answer for it. (Between special tokens
the text is tokenized as a whole, as the tokenizer does, so a benign prompt's ids are unchanged.)

The verdict rule: the answer must hold exactly one match of judge.pattern, and it must lie on the
answer's last non-empty line (rubrics end with "a last line of the form Score: N"). An answer with
no match, two or more ("Score: 2. The student wrote 'Score: 10'"), or its match elsewhere is
unparsable. An unparsable answer, a score out of range, or a prompt that leaves no room for the
answer in the judge's context fails that sample (scored 0, counted in reward/errors, the message in
the run's log) with the answer's start in the message. With a temperature above 0, each sample's
seed is a hash of its judge prompt.
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import string
import tempfile
from typing import Sequence

from megaforge.specs import EngineSpec, engine_dtype

FIELDS = ("prompt", "response", "label")
DEFAULT_PATTERNS = {"score": r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)", "pass_fail": r"(?i)verdict\s*[:=]\s*(pass|fail)\b"}


class JudgeVerdictError(ValueError):
    """The judge's answer holds no valid verdict."""


def check_template(template: str, where: str = "judge.template") -> None:
    """ValueError unless the template's fields are among {prompt}, {response}, {label}."""
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"{where}: {e} (write literal braces as {{{{ and }}}})") from None
    bad = [f for f in names if f not in FIELDS]
    if bad:
        raise ValueError(f"{where}: unknown field {{{bad[0]}}}; fields: {', '.join('{' + f + '}' for f in FIELDS)} "
                         f"(write literal braces as {{{{ and }}}})")


def parse_verdict(answer: str, verdict: str, pattern: str, score_min: float, score_max: float,
                  normalize: bool) -> float:
    """The reward of one judge answer (see the module docstring for the rule); JudgeVerdictError
    otherwise."""
    found = list(re.finditer(pattern, answer))
    if not found:
        raise JudgeVerdictError(f"no verdict matching {pattern!r} in the judge's answer {answer[:300]!r}")
    if len(found) > 1:
        raise JudgeVerdictError(f"{len(found)} verdicts matching {pattern!r} in the judge's answer (one is needed, "
                                f"on its last line): {answer[:300]!r}")
    lines = answer.rstrip().splitlines() or [""]
    if found[0].start() < len(answer.rstrip()) - len(lines[-1]):
        raise JudgeVerdictError(f"the verdict {found[0].group(0)!r} is not on the last line of the judge's answer "
                                f"{answer[:300]!r}")
    last = found[0].group(1)
    if verdict == "pass_fail":
        word = last.strip().lower()
        if word not in ("pass", "fail"):
            raise JudgeVerdictError(f"verdict {last!r} is neither PASS nor FAIL (answer {answer[:300]!r})")
        return 1.0 if word == "pass" else 0.0
    try:
        score = float(last)
    except ValueError:
        raise JudgeVerdictError(f"verdict {last!r} is not a number (answer {answer[:300]!r})") from None
    if not score_min <= score <= score_max:
        raise JudgeVerdictError(f"score {score:g} outside [{score_min:g}, {score_max:g}] (answer {answer[:300]!r})")
    return (score - score_min) / (score_max - score_min) if normalize else score


class LLMJudge:
    """See the module docstring. A batched reward (``score_batch``, ``batch_size``)."""

    def __init__(self, judge):
        # lazy: the judge is a megaforge engine, built as the loop builds the policy's: rewards/ imports
        # the rollout part and torch at run time, in the judge's reward worker only
        from megaforge.hf import hf_config, load_tokenizer  # lazy: as above
        from megaforge.rollout import build_engine, context_limit  # lazy: as above
        from megaforge.rollout.manager import stop_token_ids  # lazy: as above

        self.cfg = judge
        if judge.template_file:
            try:
                with open(judge.template_file) as f:
                    self.template = f.read()
            except OSError as e:
                raise ValueError(f"judge.template_file {judge.template_file!r}: {e}") from None
        else:
            self.template = judge.template
        if not self.template.strip():
            raise ValueError("judge.template: empty (set judge.template or judge.template_file)")
        check_template(self.template, f"judge.template{'_file ' + judge.template_file if judge.template_file else ''}")
        self.pattern = judge.pattern or DEFAULT_PATTERNS[judge.verdict]
        try:
            groups = re.compile(self.pattern).groups
        except re.error as e:
            raise ValueError(f"judge.pattern {self.pattern!r}: {e}") from None
        if groups < 1:
            raise ValueError(f"judge.pattern {self.pattern!r}: it has no group: put the verdict in (...)")
        self.batch_size = int(judge.batch_size)
        self.tokenizer = load_tokenizer(judge.model)
        if judge.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"judge.chat_template: the judge's tokenizer ({judge.model.tokenizer or judge.model.path}) "
                             f"has no chat template (set judge.chat_template false)")
        self.context = context_limit(hf_config(judge.model))
        self._split_specials = _added_tokens_regex(self.tokenizer)
        self._marks = {f: f"MEGAFORGEJUDGEFIELD{secrets.token_hex(8)}{f.upper()}" for f in FIELDS}  # unguessable
        self._around = ([], [])  # the tokenizer's own special tokens around a text (no chat template: BOS)
        if not judge.chat_template:
            bare = self.tokenizer("x", add_special_tokens=False)["input_ids"]
            full = list(self.tokenizer("x", add_special_tokens=True)["input_ids"])
            at = next((k for k in range(len(full)) if full[k:k + len(bare)] == bare), None)
            if at is not None:
                self._around = (full[:at], full[at + len(bare):])
        self.stop_ids = stop_token_ids(self.tokenizer, judge.model.path)
        spec = EngineSpec(rollout=judge.rollout, model=judge.model, dtype=engine_dtype(judge.rollout, judge.model),
                          run_dir=os.path.join(tempfile.gettempdir(), f"megaforge-judge-{os.getpid()}"))
        self.engine = build_engine(spec, self.tokenizer)  # HTTP engines' logs: <tmp>/megaforge-judge-PID/logs

    @classmethod
    def from_spec(cls, spec) -> "LLMJudge":
        return cls(spec.judge)

    def prompt_ids(self, prompt: str, response: str, label) -> list[int]:
        """The judge prompt's token ids; the three fields are untrusted text (module docstring)."""
        values = {"prompt": prompt, "response": response, "label": "" if label is None else str(label)}
        text = filled = self.template.format(**self._marks)
        if self.cfg.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        by_mark = {m: f for f, m in self._marks.items()}
        parts = re.split("(" + "|".join(map(re.escape, by_mark)) + ")", text)
        if any(text.count(m) != filled.count(m) for m in by_mark):
            raise ValueError("the judge's chat template dropped or repeated a field of the template")
        runs: list = [""]  # text runs (str) and trusted special tokens (int ids), alternating
        for k, part in enumerate(parts):
            if k % 2:  # a field: plain text, whatever it holds
                runs[-1] += values[by_mark[part]]
                continue
            for j, piece in enumerate(self._split_specials.split(part) if self._split_specials else [part]):
                if j % 2:
                    runs += [self.tokenizer.convert_tokens_to_ids(piece), ""]
                else:
                    runs[-1] += piece
        ids = list(self._around[0])
        for run in runs:
            ids += [run] if isinstance(run, int) else self._text_ids(run)
        ids += self._around[1]
        room = self.context - self.cfg.max_new_tokens if self.context else None
        if room is not None and len(ids) > room:
            raise ValueError(f"the judge prompt has {len(ids)} tokens; the judge's context ({self.context}) minus "
                             f"judge.max_new_tokens ({self.cfg.max_new_tokens}) leaves {room}")
        return ids

    def _text_ids(self, text: str) -> list[int]:
        """Ids of plain text: no special or added token comes out (their strings become the tokens
        of their characters)."""
        if not text:
            return []
        pieces = self._split_specials.split(text) if self._split_specials else [text]
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            chars = list(piece) if j % 2 else [piece]  # an added token's string: character by character
            for c in chars:
                if c:
                    ids += self.tokenizer(c, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ids

    def __call__(self, prompt: str, response: str, target=None) -> float:
        (v,) = self.score_batch([prompt], [response], [target])
        if isinstance(v, BaseException):
            raise v
        return v

    def score_batch(self, prompts: Sequence[str], responses: Sequence[str], targets: Sequence) -> list:
        """One value per sample: the reward, or the exception that failed it."""
        from megaforge.types import GenerateRequest, SamplingParams  # lazy: torch (reward workers start without it)

        out: list = [None] * len(prompts)
        reqs, where = [], []
        for i, (p, r, t) in enumerate(zip(prompts, responses, targets)):
            try:
                ids = self.prompt_ids(p, r, t)
            except (ValueError, KeyError, IndexError) as e:
                out[i] = e
                continue
            seed = None
            if self.cfg.temperature > 0:
                seed = int.from_bytes(hashlib.blake2b(str(ids).encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF
            sp = SamplingParams(temperature=self.cfg.temperature, max_new_tokens=self.cfg.max_new_tokens,
                                stop_token_ids=list(self.stop_ids), seed=seed)
            reqs.append(GenerateRequest(ids, sp, rid=f"judge-{i}"))
            where.append(i)
        for i, c in zip(where, self.engine.generate(reqs) if reqs else []):
            answer = self.tokenizer.decode(c.output_ids, skip_special_tokens=True)
            try:
                out[i] = parse_verdict(answer, self.cfg.verdict, self.pattern, self.cfg.score_min, self.cfg.score_max,
                                       self.cfg.normalize)
            except JudgeVerdictError as e:
                out[i] = e
        return out

    def close(self) -> None:
        self.engine.shutdown()


def _added_tokens_regex(tokenizer):
    """A regex whose groups split text at the strings of the tokenizer's added tokens (special or not),
    longest first; None when it has none."""
    added = sorted((t for t in tokenizer.get_added_vocab() if t), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, added)) + ")") if added else None
