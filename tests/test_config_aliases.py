"""Issue 41 point 4: keys of torchforge, TRL and verl configs get the megaforge key (megaforge.config.aliases),
not the nearest spelling (``training.learning_rate`` was "did you mean 'trainer.min_lr'")."""
import pytest

from megaforge.config import load_config
from megaforge.configtree import ConfigError

BASE = ["--model.config", "configs/models/tiny-qwen2", "--data.path", "arithmetic"]


def error(*argv, base=True) -> str:
    with pytest.raises(ConfigError) as e:
        load_config([*BASE, *argv] if base else list(argv))
    return str(e.value)


@pytest.mark.parametrize("key,value,advice", [
    ("training.learning_rate", "1e-6", "(torchforge's key) use trainer.lr"),
    ("training.gradient_accumulation_steps", "4", "trainer.mini_batches"),
    ("gradient_accumulation_steps", "4", "(TRL's key) no such key: gradients accumulate"),
    ("training.seq_len", "4096", "use data.max_prompt_len (prompt tokens) and rollout.max_new_tokens"),
    ("seq_len", "4096", "use data.max_prompt_len"),
    ("ref_model.with_gpus", "false", "use trainer.ref_device (cpu for with_gpus: false"),
    ("services.generator.procs", "1", "use rollout.tensor_parallel"),
    ("learning_rate", "1e-6", "(TRL's key) use trainer.lr"),
    ("num_generations", "8", "use grpo.n_samples"),
    ("max_completion_length", "256", "use rollout.max_new_tokens"),
    ("beta", "0.04", "use grpo.beta"),
    ("epsilon", "0.2", "use grpo.clip_low"),
    ("trainer.learning_rate", "1e-6", "(TRL's key) use trainer.lr"),
    ("actor_rollout_ref.actor.optim.lr", "1e-6", "(verl's key) use trainer.lr"),
    ("data.train_batch_size", "256", "(verl's key) use rollout.batch_size"),
    ("rollout.n", "8", "(verl's key) use grpo.n_samples"),
])
def test_other_frameworks_keys_name_the_megaforge_key(key, value, advice):
    msg = error(f"--{key}", value)
    assert msg.startswith(f"unknown config key '{key}': ") and advice in msg and "did you mean" not in msg, msg
    assert "\n" not in msg


def test_torchforge_yaml_sections_and_a_model_string(tmp_path):
    """The torchforge README's config/grpo_math.yaml, section by section."""
    p = tmp_path / "tf.yaml"
    p.write_text("training:\n  learning_rate: 1e-6\n  seq_len: 4096\n")
    msg = error("--config", str(p))
    assert msg.startswith("unknown config key 'training': training.learning_rate: (torchforge's key) use trainer.lr")
    assert "training.seq_len: (torchforge's key) use data.max_prompt_len" in msg
    p.write_text("services:\n  generator: {foo: 1}\n")
    msg = error("--config", str(p))
    assert "(torchforge's key) no such section: megaforge places its processes itself" in msg
    assert "metrics" not in msg.split(":", 1)[0]
    p.write_text('model: "Qwen/Qwen2.5-7B-Instruct"\ndata: {path: arithmetic}\n')
    msg = error("--config", str(p), base=False)
    assert msg.startswith("config key 'model': expected a mapping (ModelConfig), got 'Qwen/Qwen2.5-7B-Instruct'; "
                          "use model.path: 'Qwen/Qwen2.5-7B-Instruct'")


def test_a_typo_still_gets_the_nearest_key():
    assert error("--trainer.lrr", "1e-5") == "unknown config key 'trainer.lrr'; did you mean 'trainer.lr'?"
