"""Where a model comes from (pagedllm/entrypoints/model_dir.py): a local directory, or a Hugging
Face hub id found in the local cache with no download; and which generation_config.json keys
become sampling defaults."""

from __future__ import annotations

import json
import os

import pytest

from pagedllm.engine.errors import InvalidRequestError
from pagedllm.entrypoints import model_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "Qwen/Qwen3-0.6B"


def fake_cache(root, model: str, repo_id: str = REPO_ID, commit: str = COMMIT) -> str:
    """The hub cache layout `models--Org--Name/{refs/main, snapshots/<commit>/}` with the model's
    files linked in; returns the snapshot directory."""
    repo = os.path.join(root, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    for name in os.listdir(model):
        os.symlink(os.path.join(model, name), os.path.join(snapshot, name))
    return snapshot


@pytest.fixture
def no_hf_env(monkeypatch):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_a_hub_id_resolves_from_hf_hub_cache(tmp_path, tiny_models, no_hf_env):
    snapshot = fake_cache(tmp_path / "hub", tiny_models["qwen3"])
    no_hf_env.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_dir.resolve_model_path(REPO_ID) == snapshot
    assert model_dir.resolve_model_path(REPO_ID, revision=COMMIT) == snapshot  # a commit: no refs needed
    assert model_dir.resolve_model_path(REPO_ID, revision="main") == snapshot


def test_hf_home_and_download_dir_are_other_places_to_look(tmp_path, tiny_models, no_hf_env):
    snapshot = fake_cache(tmp_path / "home" / "hub", tiny_models["qwen3"])
    no_hf_env.setenv("HF_HOME", str(tmp_path / "home"))
    assert model_dir.resolve_model_path(REPO_ID) == snapshot
    elsewhere = fake_cache(tmp_path / "mine", tiny_models["qwen3"])
    assert model_dir.resolve_model_path(REPO_ID, download_dir=str(tmp_path / "mine")) == elsewhere
    no_hf_env.delenv("HF_HOME")
    no_hf_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_dir.hub_cache_dir() == str(tmp_path / "xdg" / "huggingface" / "hub")


def test_a_hub_id_not_in_the_cache_is_refused_without_downloading(tmp_path, tiny_models, no_hf_env):
    no_hf_env.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(InvalidRequestError, match="not in the local Hugging Face cache.*does not download") as e:
        model_dir.resolve_model_path(REPO_ID)
    assert e.value.param == "model" and str(tmp_path) in str(e.value)
    fake_cache(tmp_path, tiny_models["qwen3"])
    with pytest.raises(InvalidRequestError, match="at revision 'v2'"):
        model_dir.resolve_model_path(REPO_ID, revision="v2")
    with pytest.raises(InvalidRequestError, match="does not exist") as e:
        model_dir.resolve_model_path(str(tmp_path / "no" / "such dir"), param="tokenizer")
    assert e.value.param == "tokenizer"


def test_revision_and_download_dir_with_a_local_directory_are_refused(tiny_models):
    for name in ("revision", "download_dir"):
        with pytest.raises(InvalidRequestError, match="local directory") as e:
            model_dir.resolve_model_path(tiny_models["qwen3"], **{name: "x"})
        assert e.value.param == name


def test_llm_loads_a_cached_hub_id_and_accepts_vllm_neutral_arguments(tmp_path, tiny_models, no_hf_env):
    from pagedllm import LLM, SamplingParams

    snapshot = fake_cache(tmp_path, tiny_models["qwen3"])
    no_hf_env.setenv("HF_HUB_CACHE", str(tmp_path))
    greedy = SamplingParams(temperature=0, max_tokens=4)
    with LLM(
        REPO_ID, device="cpu", num_kv_blocks=16, trust_remote_code=True, quantization=None, enable_chunked_prefill=True
    ) as llm:
        assert llm.model_path == snapshot
        via_hub = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(tiny_models["qwen3"], device="cpu", num_kv_blocks=16) as llm:
        assert llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids == via_hub


def test_penalties_in_generation_config_become_sampling_defaults(tmp_path, caplog):
    cfg = {"temperature": 0.6, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    (tmp_path / "generation_config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING", logger="pagedllm"):
        defaults = model_dir.generation_defaults(str(tmp_path))
    assert defaults == cfg and not caplog.records
    from pagedllm.engine.sampling_params import sampling_params_with_defaults

    sp = sampling_params_with_defaults(defaults)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.1, 0.5, 0.25)
    assert sampling_params_with_defaults(defaults, repetition_penalty=1.0).repetition_penalty == 1.0  # request wins
