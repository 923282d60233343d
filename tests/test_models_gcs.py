"""model.path=gs://...: a checkpoint in a bucket loads by ranged reads, bit for bit what the same
files give from disk, against a real GCS JSON API server (fake-gcs-server on 127.0.0.1)."""

import jax
import numpy as np
import pytest
from etils import epath

from qarl_jax import sharding as sh
from qarl_jax.config import ModelConfig
from qarl_jax.errors import ConfigError
from qarl_jax.models import Qwen3ForCausalLM, from_pretrained, init_params, preset, save_pretrained
from qarl_jax.models.hf_io import load_config, load_params
from qarl_jax.run.build import check_model_files, model_dir


@pytest.fixture
def bucket(gcs_bucket):
    """The session's bucket on the real GCS API server (tests/conftest.py's ``gcs_bucket``)."""
    return gcs_bucket


def test_gs_checkpoint_loads_sharded_bit_for_bit(tmp_path, bucket):
    config = preset("qwen3-moe-tiny").replace(tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    save_pretrained(tmp_path, config, init_params(model, jax.random.key(9)), max_shard_bytes=2 << 20)
    remote = epath.Path(f"{bucket}/models/moe")
    for f in tmp_path.iterdir():  # an index and several shards
        (remote / f.name).write_bytes(f.read_bytes())
    mesh = sh.make_mesh(sh.MeshConfig(data=1, fsdp=2, tensor=2, expert=2))
    shardings = sh.param_shardings(model, mesh)
    _, local, _ = from_pretrained(tmp_path, shardings=shardings)
    check_model_files(ModelConfig(path=f"{bucket}/models/moe"))
    arch = load_config(model_dir(f"{bucket}/models/moe"))
    assert arch == load_config(tmp_path)
    loaded = load_params(model_dir(f"{bucket}/models/moe"), arch, shardings)
    jax.tree.map(np.testing.assert_array_equal, loaded, local)
    assert jax.tree.structure(loaded) == jax.tree.structure(local)
    with pytest.raises(ConfigError, match=f"model.path {bucket}/nothing: no such directory"):
        check_model_files(ModelConfig(path=f"{bucket}/nothing"))


def test_export_to_gs_reloads(tmp_path, bucket):
    config = preset("qwen3-tiny")
    params = init_params(Qwen3ForCausalLM(config), jax.random.key(2))
    save_pretrained(f"{bucket}/models/export", config, params)
    _, loaded, _ = from_pretrained(f"{bucket}/models/export")
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
