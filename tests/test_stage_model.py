"""Staging an ``init_from`` model directory from S3 (moto's real S3 server) to FSx: complete or absent, never
half-copied; a rerun of an unchanged prefix copies nothing; a changed one is swapped in whole."""

import uuid

import pytest

from components.stage.model import STAGED_FILE, stage_model, staged_model_dir
from tests.llama_dirs import save_small_llama


@pytest.fixture
def model_prefix(s3, tmp_path):
    """s3://<bucket>/llama/: a transformers-saved Llama directory."""
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    local = save_small_llama(tmp_path / "src")
    for f in local.iterdir():
        client.upload_file(str(f), bucket, f"llama/{f.name}")
    return client, bucket, local


def _files(d):
    return {p.name: p.read_bytes() for p in d.iterdir() if p.name != STAGED_FILE}


def test_staged_once_then_unchanged_then_swapped_in_whole(s3, model_prefix, tmp_path):
    import transformers

    client, bucket, local = model_prefix
    source = f"s3://{bucket}/llama"
    dest = staged_model_dir(str(tmp_path / "fsx"), source)
    first = stage_model(source, dest, s3.url)
    assert first["transferred"] == first["objects"] == len(list(local.iterdir()))
    assert _files(tmp_path / "fsx" / "pretrained" / bucket / "llama") == _files(local)
    transformers.LlamaForCausalLM.from_pretrained(dest)            # what the trainer is given loads
    assert stage_model(source, dest, s3.url)["transferred"] == 0, "an unchanged prefix copies nothing"
    # A new model under the same prefix is copied again and replaces the old one whole.
    newer = save_small_llama(tmp_path / "newer", seed=1)
    client.upload_file(str(newer / "model.safetensors"), bucket, "llama/model.safetensors")
    assert stage_model(source, dest, s3.url)["transferred"] >= 1
    assert _files(tmp_path / "fsx" / "pretrained" / bucket / "llama")["model.safetensors"] == \
        (newer / "model.safetensors").read_bytes()
    left = sorted(p.name for p in (tmp_path / "fsx" / "pretrained" / bucket).iterdir())
    assert left == [".llama.lock", "llama"], "no work directory or old copy left over"


def test_a_failed_copy_leaves_no_half_copied_directory(s3, model_prefix, tmp_path, monkeypatch):
    from components.stage import dataset as stage
    from components.stage.dataset import StageError

    _, bucket, local = model_prefix
    source, dest = f"s3://{bucket}/llama", str(tmp_path / "fsx" / "llama")
    placed = []
    real = stage._Finisher._place

    def place_one_then_fail(self, obj, target):      # the copy dies after its first file
        if placed:
            raise OSError("disk gone")
        placed.append(obj.rel)
        real(self, obj, target)

    monkeypatch.setattr(stage._Finisher, "_place", place_one_then_fail)
    with pytest.raises(StageError, match="rerun to resume"):
        stage_model(source, dest, s3.url)
    assert not (tmp_path / "fsx" / "llama").exists(), "the trainer's directory is absent, not half there"
    monkeypatch.setattr(stage._Finisher, "_place", real)
    again = stage_model(source, dest, s3.url)
    assert again["transferred"] == again["objects"] - 1, "the rerun resumed: the verified file was kept"
    assert _files(tmp_path / "fsx" / "llama") == _files(local)


def test_a_prefix_without_a_model_is_refused_before_anything_is_written(s3, model_prefix, tmp_path):
    client, bucket, _ = model_prefix
    client.put_object(Bucket=bucket, Key="notes/README", Body=b"no model")
    with pytest.raises(ValueError, match="holds no config.json"):
        stage_model(f"s3://{bucket}/notes", str(tmp_path / "fsx" / "notes"), s3.url)
    assert not (tmp_path / "fsx").exists() or not any((tmp_path / "fsx").rglob("*"))
    assert stage_model("", str(tmp_path / "x"))["transferred"] == 0      # no init_from: nothing to do
