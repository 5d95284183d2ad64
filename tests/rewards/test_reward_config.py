"""The typed rewards keys: service keys only on the reward that reads them, required ones named."""
import pytest

from megaforge.config import config_from_dict
from megaforge.configtree import ConfigError


def cfg(*functions, **rewards):
    return config_from_dict({"model": {"config": "x"}, "data": {"path": "x"},
                             "rewards": {"functions": list(functions), **rewards}})


@pytest.mark.parametrize("entry,message", [
    ({"name": "remote"}, r"'rewards.functions\[0\].url': the remote reward needs an http\(s\) URL, got ''"),
    ({"name": "remote", "url": "ftp://x"}, r"'rewards.functions\[0\].url': the remote reward needs an http\(s\) URL"),
    ({"name": "remote", "url": "http://h:1", "api_key": "a", "api_key_env": "B"},
     r"'rewards.functions\[0\].api_key': give api_key or api_key_env, not both"),
    ({"name": "remote", "url": "http://h:1", "max_concurrency": 0}, r"'rewards.functions\[0\].max_concurrency': must be >= 1"),
    ({"name": "math", "url": "http://h:1"}, r"'rewards.functions\[0\].url': only the remote reward reads it"),
    ({"name": "math", "reward_model": {"path": "x"}}, r"'rewards.functions\[0\].reward_model': only the reward_model"),
    ({"name": "reward_model"}, r"'rewards.functions\[0\].reward_model.path': set the reward model's checkpoint"),
    ({"name": "reward_model", "reward_model": {"path": "x", "template": "raw"}},
     r"'rewards.functions\[0\].reward_model.template': expected one of 'chat', 'concat'"),
    ({"name": "llm_judge", "judge": {"model": {"path": "j"}}},
     r"'rewards.functions\[0\].judge.template': set one of judge.template and judge.template_file"),
    ({"name": "llm_judge", "judge": {"model": {"path": "j"}, "template": "{response}", "score_min": 5, "score_max": 5}},
     r"'rewards.functions\[0\].judge.score_min': must be < judge.score_max"),
    ({"name": "llm_judge", "judge": {"template": "{response}"}}, r"'rewards.functions\[0\].judge.model.path': set the judge"),
    ({"name": "math", "workers": 0}, r"'rewards.functions\[0\].workers': must be >= 1"),
    ({"name": "remote", "url": "http://h:1", "retrys": 2}, r"unknown config key 'rewards.functions\[0\].retrys'; did you "
                                                            r"mean 'rewards.functions\[0\].retries'"),
])
def test_bad_entries_are_named(entry, message):
    with pytest.raises(ConfigError, match=message):
        cfg(entry)


def test_labels_are_unique_and_good_entries_pass():
    with pytest.raises(ConfigError, match=r"'rewards.functions\[1\].label': reward label 'remote' is already used"):
        cfg({"name": "remote", "url": "http://a:1"}, {"name": "remote", "url": "http://b:1"})
    c = cfg({"name": "remote", "url": "http://a:1", "label": "rm_a", "batch_size": 8, "api_key_env": "TOKEN"},
            {"name": "remote", "url": "http://b:1", "label": "rm_b"},
            {"name": "llm_judge", "judge": {"model": {"path": "j"}, "template_file": "r.txt", "verdict": "pass_fail"}},
            stream_prompts=4)
    assert [f.label for f in c.rewards.functions] == ["rm_a", "rm_b", ""] and c.rewards.stream_prompts == 4
    with pytest.raises(ConfigError, match=r"'rewards.stream_prompts': must be >= 0"):
        cfg({"name": "math"}, stream_prompts=-1)
