"""Held-out sets: prompt keys, the held-out part of data.path (left out of training), and the refusal
of a set that shares a prompt with the training data, naming the set and the row."""
import json
import unicodedata

import pytest

from megaforge.config import load_config
from megaforge.data.holdout import choose_held_out, key_digest, prompt_key
from megaforge.data.prompts import PromptSource, prompt_renderer
from megaforge.data.sources import DataError
from megaforge.build import RunBuilder


def write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def load_eval_sets(cfg, tokenizer):
    """The run's eval sets, as the build step reads them from the tree."""
    return RunBuilder(cfg).eval_sets(tokenizer)


def cfg_for(train, *extra):
    return load_config(["--model.config", "configs/models/tiny-qwen2", "--model.tokenizer", "assets/tiny-tokenizer",
                        "--data.path", train, "--max_steps", "1", *extra])


def test_prompt_key_normalises_whitespace_and_drops_sft_targets(tokenizer):
    assert prompt_key("What is  2 +\n2?") == prompt_key(" What is 2 + 2? ")
    assert prompt_key("What is 2 + 2?") != prompt_key("What is 2 + 3?")
    chat = [{"role": "user", "content": "hi  there"}]
    assert prompt_key(chat + [{"role": "assistant", "content": "hello"}]) == prompt_key(chat)
    assert prompt_key("   ") is None and prompt_key(3) is None and prompt_key([{"role": "user"}]) is None
    render = prompt_renderer(tokenizer, cfg_for("x.jsonl").data)  # the chat template: what the model sees
    assert prompt_key(chat, render) == prompt_key("hi there", render) != prompt_key("hi there")
    system = [{"role": "system", "content": "hi there"}]  # another role is another model input
    assert prompt_key(system, render) != prompt_key(chat, render)


# Issue 40 case 5: the same model input written another way was accepted as held out.
TRAIN_PROMPT = "Café: what is 12 + 7?"
SAME_PROMPT = {
    "one-message chat list": [{"role": "user", "content": TRAIN_PROMPT}],
    "chat list with the SFT target": [{"role": "user", "content": TRAIN_PROMPT}, {"role": "assistant", "content": "19"}],
    "case": TRAIN_PROMPT.upper(),
    "zero-width space": "Caf\u200bé: what is 1\u200b2 + 7?\ufeff",
    "NFD": unicodedata.normalize("NFD", TRAIN_PROMPT),
    "full-width digits": "Café: what is \uff11\uff12 + \uff17?",
    "whitespace": " Café:\twhat  is 12 +\n7? ",
}


@pytest.mark.parametrize("variant", sorted(SAME_PROMPT))
def test_the_same_prompt_written_another_way_is_not_held_out(tmp_path, tokenizer, variant):
    assert SAME_PROMPT[variant] != TRAIN_PROMPT
    train = write(tmp_path / "train.jsonl", [{"prompt": p, "answer": "1"} for p in (TRAIN_PROMPT, "Q1", "Q2")])
    test = write(tmp_path / "test.jsonl", [{"prompt": "fresh", "answer": "1"}, {"prompt": SAME_PROMPT[variant], "answer": "19"}])
    args = ["--eval.sets", f"[{{name: t, path: {test}}}]", "--eval.interval", "1"]
    with pytest.raises(DataError, match=r"eval set 't': row .*test.jsonl:2 has the same prompt as training row "
                                        r".*train.jsonl:1 \(1 of its 2 rows"):
        load_eval_sets(cfg_for(train, *args), tokenizer)


def test_held_out_variants_leave_the_training_data_together(tmp_path, tokenizer):
    """Rows of data.path that are one prompt written in several ways are held out together."""
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]
    rows += [{"prompt": [{"role": "user", "content": f"WHAT IS \uff11{i} + 1?"}], "answer": "x"} for i in range(10)]
    cfg = cfg_for(write(tmp_path / "t.jsonl", rows), "--eval.sets", "[{name: held, holdout: 0.5}]",
                  "--eval.interval", "1")
    _, held = load_eval_sets(cfg, tokenizer)
    assert len(held) == 10  # 20 distinct prompts: the 10 variants are prompts 10..19
    src = PromptSource(cfg.data, tokenizer, cfg.seed, exclude=held)
    kept = {r.where.rsplit(":", 1)[1] for r in src._rows}  # data lines (1-based) left for training
    for i in range(10):  # prompt 10 + i (line 11 + i) and its variant (line 21 + i): out together or in together
        assert (str(11 + i) in kept) == (str(21 + i) in kept)
    assert src.held_out == 30 - len(kept) == 15  # the 10 held-out prompts: 5 with a variant, 5 without


def test_holdout_rows_leave_the_training_data(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {i % 40} + 1?", "answer": str(i % 40 + 1)} for i in range(120)]  # 40 prompts x 3
    cfg = cfg_for(write(tmp_path / "t.jsonl", rows), "--eval.sets", "[{name: held, holdout: 0.25}]",
                  "--eval.interval", "1")
    sets, held = load_eval_sets(cfg, tokenizer)
    assert [s.name for s in sets] == ["held"] and len(held) == 10
    assert len(sets[0].rows) == 10  # one row per held-out prompt, the first row that has it
    lines = [int(r.where.rsplit(":", 1)[1]) for r in sets[0].rows]
    render = prompt_renderer(tokenizer, cfg.data)
    assert {key_digest(prompt_key(rows[i - 1]["prompt"], render)) for i in lines} == held and max(lines) <= 40
    assert all(r.label == rows[i - 1]["answer"] for r, i in zip(sets[0].rows, lines))
    src = PromptSource(cfg.data, tokenizer, cfg.seed, exclude=held)
    assert len(src) == 90 and src.held_out == 30
    trained = {key_digest(prompt_key(r.prompt_text.split("user\n")[1].split("<|im_end|>")[0], render))
               for r in src.next_batch(90)}
    assert len(trained) == 30 and not trained & held


def test_a_set_sharing_a_training_prompt_is_refused_naming_set_and_row(tmp_path, tokenizer):
    train = write(tmp_path / "train.jsonl", [{"prompt": f"Q{i}", "answer": "1"} for i in range(5)])
    test = write(tmp_path / "test.jsonl", [{"q": "fresh", "a": "1"}, {"q": " Q3 ", "a": "1"}])
    args = ["--eval.sets", f"[{{name: t, path: {test}, input_key: q, label_key: a}}]", "--eval.interval", "1"]
    with pytest.raises(DataError, match=r"eval set 't': row .*test.jsonl:2 has the same prompt as training row "
                                        r".*train.jsonl:4 \(1 of its 2 rows"):
        load_eval_sets(cfg_for(train, *args), tokenizer)
    sets, held = load_eval_sets(cfg_for(train, *args, "--eval.check_disjoint", "false"), tokenizer)
    assert len(sets[0].rows) == 2 and held == frozenset()
    # the SFT data counts as training data when the warm start runs
    sft = write(tmp_path / "sft.jsonl", [{"prompt": "fresh", "response": "x"}])
    with pytest.raises(DataError, match="sft.jsonl:1"):
        load_eval_sets(cfg_for(train, *args[:2], "--eval.sets", f"[{{name: t, path: {test}, input_key: q, "
                               f"label_key: a, max_rows: 1}}]", "--eval.interval", "1", "--sft.max_steps", "1",
                               "--sft.data", f"{{path: {sft}}}"), tokenizer)


def test_a_datasets_split_is_a_set(tmp_path, tokenizer):
    """eval.sets[].path can be a `datasets` dataset: here a DatasetDict saved to disk, whose ``split``
    (default ``test``) is read, not its train split; its rows name the dataset and split."""
    datasets = pytest.importorskip("datasets")
    train = write(tmp_path / "train.jsonl", [{"prompt": f"Q{i}", "answer": "1"} for i in range(5)])
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"question": ["Q0", "Q1"], "label": ["1", "1"]}),
        "test": datasets.Dataset.from_dict({"question": ["What is 2 + 2?", "What is 3 + 3?", "What is 4 + 4?"],
                                            "label": ["4", "6", "8"]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    spec = f"{{name: t, path: {tmp_path / 'dd'}, format: hf, input_key: question, label_key: label}}"
    sets, held = load_eval_sets(cfg_for(train, "--eval.sets", f"[{spec}]", "--eval.interval", "1"), tokenizer)
    assert [r.label for r in sets[0].rows] == ["4", "6", "8"] and held == frozenset()
    assert sets[0].rows[1].where.endswith("[test]:row 1")
    # the train split shares the run's training prompts: asking for it is refused, naming the split's row
    with pytest.raises(DataError, match=r"eval set 't': row .*dd\[train\]:row 0 has the same prompt"):
        load_eval_sets(cfg_for(train, "--eval.sets", f"[{spec[:-1]}, split: train}}]", "--eval.interval", "1"),
                       tokenizer)


def test_bad_rows_and_empty_sets_name_the_set(tmp_path, tokenizer):
    train = write(tmp_path / "train.jsonl", [{"prompt": "Q", "answer": "1"}])
    bad = write(tmp_path / "bad.jsonl", [{"prompt": "fine", "answer": "1"}, {"prompt": "no label"}])
    with pytest.raises(DataError, match=r"eval set 'b': .*bad.jsonl:2: missing field 'answer'"):
        load_eval_sets(cfg_for(train, "--eval.sets", f"[{{name: b, path: {bad}}}]", "--eval.interval", "1"), tokenizer)
    sets, _ = load_eval_sets(cfg_for(train, "--eval.sets", f"[{{name: b, path: {bad}, max_rows: 1}}]",
                                     "--eval.interval", "1"), tokenizer)
    assert len(sets[0].rows) == 1


@pytest.mark.parametrize("args,msg", [
    (["--eval.sets", "[{name: a, holdout: 0.1}]"], "never evaluated"),
    (["--eval.sets", "[{name: a}]", "--eval.interval", "1"], "eval.sets[0].holdout"),
    (["--eval.sets", "[{name: a, path: x.jsonl, holdout: 0.1}]", "--eval.interval", "1"], "eval.sets[0].holdout"),
    (["--eval.sets", "[{name: a/b, holdout: 0.1}]", "--eval.interval", "1"], "eval.sets[0].name"),
    (["--eval.sets", "[{name: a, path: x}, {name: a, path: y}]", "--eval.interval", "1"], "names more than one"),
    (["--eval.sets", "[{name: a, holdout: 0.1}, {name: b, holdout: 0.1}]", "--eval.interval", "1"], "at most one"),
    (["--eval.n_samples", "4", "--eval.pass_k", "[1, 8]"], "eval.pass_k"),
    (["--eval.correct_reward", "maths"], "eval.correct_reward"),
    (["--eval.greedy", "false", "--eval.sets", "[{name: a, path: x}]", "--eval.interval", "1"], "eval.greedy"),
])
def test_config_errors_name_the_key(args, msg):
    from megaforge.configtree import ConfigError

    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        cfg_for("x.jsonl", *args)


def test_unknown_eval_key_suggests_the_nearest():
    from megaforge.configtree import ConfigError

    with pytest.raises(ConfigError, match=r"did you mean 'eval.sets\[0\].holdout'"):
        cfg_for("x.jsonl", "--eval.sets", "[{name: a, holdot: 0.1}]", "--eval.interval", "1")
    with pytest.raises(ConfigError, match="did you mean 'eval.before_train'"):
        cfg_for("x.jsonl", "--eval.before_trian", "true")


def test_eval_response_limit_must_fit_the_context():
    from megaforge.configtree import ConfigError
    from megaforge.rollout import check_context

    # tiny-qwen2 serves 512 positions: 64 prompt tokens + 448 response tokens fit, 449 do not
    args = ["--data.max_prompt_len", "64", "--eval.sets", "[{name: a, holdout: 0.1}]", "--eval.interval", "1"]
    cfg = cfg_for("x.jsonl", *args, "--eval.max_new_tokens", "448")
    check_context(cfg.model, cfg.data, cfg.rollout, cfg.eval)
    with pytest.raises(ConfigError, match=r"'eval.max_new_tokens' \(449\) = 513 tokens exceed the model's context of 512"):
        cfg = cfg_for("x.jsonl", *args, "--eval.max_new_tokens", "449")
        check_context(cfg.model, cfg.data, cfg.rollout, cfg.eval)


@pytest.mark.parametrize("given,label", [("", "r"), ("pkg.mod:fn", "mine"), ("fn", "mine"), ("mine", "mine"),
                                         ("math", "math")])
def test_correct_reward_resolves_to_the_components_label(given, label):
    """Samples' reward components are keyed by label: eval.correct_reward given as a name, the name's
    last part or the label resolves to it (a labelled plug-in was looked up by its function name)."""
    from megaforge.config.evaluation import correct_reward_label

    cfg = cfg_for("x.jsonl", "--rewards.functions",
                  "[{name: math, label: r}, {name: 'pkg.mod:fn', label: mine}, {name: math, label: math2}]"
                  if given == "" else "[{name: 'pkg.mod:fn', label: mine}, {name: math}]",
                  *(["--eval.correct_reward", given] if given else []))
    assert correct_reward_label(cfg.eval, cfg.rewards) == label
