"""Run arguments: parsed, merged (-p over file) and typed against the compiled pipeline's inputs."""

import pytest

from pipelines.params import ParamError, check_settings, load_pipeline_spec, parse_pairs, resolve_arguments

SPEC = {"root": {"inputDefinitions": {"parameters": {
    "name": {"parameterType": "STRING", "defaultValue": "x", "isOptional": True},
    "steps": {"parameterType": "NUMBER_INTEGER", "defaultValue": 10.0, "isOptional": True},
    "lr": {"parameterType": "NUMBER_DOUBLE", "defaultValue": 0.1, "isOptional": True},
    "spot": {"parameterType": "BOOLEAN", "defaultValue": False, "isOptional": True},
    "tags": {"parameterType": "LIST", "defaultValue": [], "isOptional": True},
    "extra": {"parameterType": "STRUCT", "defaultValue": {}, "isOptional": True},
    "source": {"parameterType": "STRING"},
}}}}


def test_pairs_keep_everything_after_the_first_equals():
    assert parse_pairs(["a=1", "b=x=y", "c="]) == {"a": "1", "b": "x=y", "c": ""}


@pytest.mark.parametrize("pair", ["a", "=1", "a b=1", "a-b=1"])
def test_malformed_pairs(pair):
    with pytest.raises(ParamError, match="malformed parameter"):
        parse_pairs([pair])


def test_duplicate_pair():
    with pytest.raises(ParamError, match="given twice"):
        parse_pairs(["a=1", "a=2"])


def test_types_follow_the_pipeline(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("steps: 5\nspot: true\nname: 1.0\nsource: s3://b/p\nextra: {k: 1}\n")
    args = resolve_arguments(SPEC, ["steps=7", "lr=3", "tags=[1, 2]"], f)
    assert args == {"steps": 7, "lr": 3.0, "spot": True, "name": "1.0", "source": "s3://b/p", "tags": [1, 2],
                    "extra": {"k": 1}}
    assert isinstance(args["lr"], float)


@pytest.mark.parametrize("pairs, message", [
    (["source=s", "steps=1.5"], "expects integer"),
    (["source=s", "spot=yes"], "expects boolean"),
    (["source=s", "lr=fast"], "expects float"),
    (["source=s", "tags=a,b"], "expects list"),
    (["source=s", "extra=[1]"], "expects dict"),
    (["source=s", "stpes=1"], "unknown parameter(s) stpes; the pipeline takes: extra, lr, name, source, spot"),
    ([], "missing required parameter(s): source"),
])
def test_rejected(pairs, message):
    with pytest.raises(ParamError) as e:
        resolve_arguments(SPEC, pairs)
    assert message in str(e.value)


def test_typed_file_values_are_checked_too(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("source: s\nsteps: true\n")
    with pytest.raises(ParamError, match="'steps' expects integer, got True"):
        resolve_arguments(SPEC, [], f)


@pytest.fixture(scope="module")
def goodput_spec(tmp_path_factory):
    from pipelines.compile import compile_pipeline

    return load_pipeline_spec(compile_pipeline(tmp_path_factory.mktemp("spec") / "goodput.yaml"))


def test_check_settings_runs_the_check_settings_step_as_the_pipeline_binds_it(goodput_spec):
    check_settings(goodput_spec, {"dataset_source": "s3://b/p/"})             # the defaults pass
    with pytest.raises(ParamError, match="--max-steps must be at least 1, got -5"):
        check_settings(goodput_spec, resolve_arguments(goodput_spec, ["max_steps=-5", "dataset_source=s3://b/"]))
    # trainer_image reaches the step's `image` input through the exit handler's DAG: the binding is read
    # from the compiled pipeline, not repeated here.
    with pytest.raises(ParamError, match="an image is required"):
        check_settings(goodput_spec, {"trainer_image": "", "dataset_source": "s3://b/"})
    with pytest.raises(ParamError, match="nodes must be at least 1, got 0"):
        check_settings(goodput_spec, {"nodes": 0})
    # The model, as the step's trainer checks it (torch is installed here).
    with pytest.raises(ParamError, match="llama has the flavors"):
        check_settings(goodput_spec, {"model": "llama", "model_flavor": "llama3-2b"})
    with pytest.raises(ParamError, match="llama has no field"):
        check_settings(goodput_spec, {"model": "llama", "model_config": '{"n_layer": 2}'})
    with pytest.raises(ParamError, match="bytegpt has the flavors default"):
        check_settings(goodput_spec, {"model_flavor": "llama3-1b"})       # the form's model is bytegpt
    check_settings(goodput_spec, {"model": "llama", "model_flavor": "debug", "model_config": '{"n_layers": 2}'})


def test_check_settings_before_submitting_leaves_what_only_the_cluster_has_to_the_step(goodput_spec):
    """FSx, the registry and a model package only the trainer image has are not here: not looked up."""
    check_settings(goodput_spec, {"init_from": "/fsx/models/llama/v3"})
    check_settings(goodput_spec, {"init_from": "production"})
    check_settings(goodput_spec, {"model": "acme.models:build_spec"})
    with pytest.raises(ParamError, match="no config.json"):
        check_settings(goodput_spec, {"init_from": "/fsx/models/llama/v3"}, reachable=True)
    with pytest.raises(ParamError, match="not valid JSON"):      # what needs nothing of the cluster is checked
        check_settings(goodput_spec, {"model": "acme.models:build_spec", "model_config": "{n_layers: 2}"})


def test_a_check_before_the_run_records_no_run(goodput_spec, tmp_path):
    """The run does not exist yet: a check before it (``goodput run``) writes no run record, so the next run
    with other settings is not held to this one's."""
    here = {"dataset_source": str(tmp_path), "fsx_root": str(tmp_path)}
    check_settings(goodput_spec, {**here, "batch_size": 32}, reachable=True)
    check_settings(goodput_spec, {**here, "batch_size": 128}, reachable=True)
    assert not (tmp_path / "runs").exists()


def test_check_settings_leaves_a_pipeline_without_that_step_alone():
    check_settings(SPEC, {"steps": -5})
