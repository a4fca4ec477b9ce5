"""The KFP client commands (upload, run, schedule, runs) against a loopback KFP API (tests/kfp_fake.py).

Each test runs the real ``goodput`` command through CliRunner and the real ``kfp.Client`` over HTTP, then
asserts what reached the server: paths, query parameters, headers and JSON/multipart bodies.
"""

import json

import kfp
import pytest
import yaml
from click.testing import CliRunner
from kfp import dsl

from pipelines.cli import main
from pipelines.compile import compile_pipeline

try:                                  # tests/ is a package when run from the repository root
    from tests.kfp_fake import FakeKfp
except ImportError:                   # pragma: no cover - tests/ on sys.path
    from kfp_fake import FakeKfp

API = "/apis/v2beta1"


@dsl.component(base_image="python:3.11-slim")
def _echo(text: str, steps: int, lr: float, fast: bool) -> str:
    return f"{text}{steps}{lr}{fast}"


@dsl.pipeline(name="tiny")
def _tiny(text: str = "hi", steps: int = 100, lr: float = 0.5, fast: bool = False, tags: list = []):  # noqa: B006
    _echo(text=text, steps=steps, lr=lr, fast=fast)


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    return compile_pipeline(tmp_path_factory.mktemp("pkg") / "tiny.yaml", _tiny)


@pytest.fixture
def api(monkeypatch, tmp_path):
    # kfp.Client reads (and in multi-user mode writes) ~/.config/kfp/context.json; keep the user's out of it.
    monkeypatch.setattr(kfp.Client, "_LOCAL_KFP_CONTEXT", str(tmp_path / "kfp-context.json"))
    for var in ("KFP_HOST", "KFP_NAMESPACE", "KFP_TOKEN", "KFP_COOKIE", "KFP_UI_HOST", "KF_PIPELINES_UI_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    with FakeKfp() as fake:
        yield fake


def goodput(api: FakeKfp, *args: str, env: dict | None = None, host: bool = True):
    env = {"KFP_HOST": api.url, **(env or {})} if host else env
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def only(api: FakeKfp, method: str, path: str):
    calls = api.calls(method, API + path)
    assert len(calls) == 1, [(r.method, r.path) for r in api.requests]
    return calls[0]


# --- upload ----------------------------------------------------------------------------------------------

def test_upload_creates_pipeline_then_adds_versions_by_content(api, package, tmp_path):
    res = goodput(api, "upload", "--package", str(package), "--name", "goodput-train", "--description", "d")
    assert res.exit_code == 0, res.output
    up = only(api, "POST", "/pipelines/upload")
    assert up.query["name"] == "goodput-train" and up.query["description"] == "d"
    assert up.files["uploadfile"] == package.read_bytes()
    assert "created pipeline 'goodput-train'" in res.output
    pid = next(iter(api.pipelines))
    assert f"{api.url}/#/pipelines/details/{pid}/version/" in res.output

    # The same package again: its spec is the first version's (named by KFP, not by content): nothing uploaded.
    res = goodput(api, "upload", "--package", str(package), "--name", "goodput-train")
    assert res.exit_code == 0 and "nothing uploaded" in res.output, res.output
    assert api.calls("POST", API + "/pipelines/upload_version") == []

    # Same name, changed package: a new version named after the content, on the existing pipeline.
    changed = tmp_path / "changed.yaml"
    changed.write_text(package.read_text().replace("pipelineInfo:", "pipelineInfo:\n  description: changed", 1))
    res = goodput(api, "upload", "--package", str(changed), "--name", "goodput-train")
    assert res.exit_code == 0, res.output
    ver = only(api, "POST", "/pipelines/upload_version")
    assert ver.query["pipelineid"] == pid
    assert ver.query["name"].startswith("sha256-") and len(ver.query["name"]) == 19
    assert ver.files["uploadfile"] == changed.read_bytes()
    assert len(api.calls("POST", API + "/pipelines/upload")) == 1

    # Unchanged package: nothing is uploaded.
    res = goodput(api, "upload", "--package", str(changed), "--name", "goodput-train")
    assert res.exit_code == 0 and "nothing uploaded" in res.output
    assert len(api.calls("POST", API + "/pipelines/upload_version")) == 1

    # An explicit version name.
    res = goodput(api, "upload", "--package", str(package), "--name", "goodput-train", "--version", "v7")
    assert res.exit_code == 0, res.output
    assert api.calls("POST", API + "/pipelines/upload_version")[-1].query["name"] == "v7"


def test_upload_namespace_goes_with_the_new_pipeline(api, package):
    res = goodput(api, "upload", "--package", str(package), "-n", "team-a")
    assert res.exit_code == 0, res.output
    assert only(api, "POST", "/pipelines/upload").query["namespace"] == "team-a"
    assert api.calls("GET", API + "/pipelines")[0].query["namespace"] == "team-a"


# --- run ---------------------------------------------------------------------------------------------------

def test_run_sends_typed_parameters_and_the_spec(api, package, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text("steps: 50\nlr: 0.25\ntext: from-file\ntags: [a, b]\n")
    res = goodput(api, "run", "--package", str(package), "--params-file", str(params), "-p", "steps=200",
                  "-p", "fast=true", "--experiment", "exp-1", "--run-name", "nightly", "--service-account", "trainer")
    assert res.exit_code == 0, res.output
    exp = only(api, "POST", "/experiments")
    assert exp.body["display_name"] == "exp-1"
    body = only(api, "POST", "/runs").body
    assert body["display_name"] == "nightly"
    assert body["experiment_id"] == next(iter(api.experiments))
    assert body["service_account"] == "trainer"
    # -p beats the file; every value is typed as the pipeline declares it.
    assert body["runtime_config"]["parameters"] == {"steps": 200, "lr": 0.25, "text": "from-file", "fast": True,
                                                    "tags": ["a", "b"]}
    spec = yaml.safe_load(package.read_text())
    assert body["pipeline_spec"]["pipelineInfo"] == spec["pipelineInfo"]
    assert body["pipeline_spec"]["root"] == json.loads(json.dumps(spec["root"]))
    run_id = next(iter(api.runs))
    assert f"{api.url}/#/runs/details/{run_id}" in res.output


def test_run_uses_an_existing_experiment(api, package):
    goodput(api, "run", "--package", str(package))
    goodput(api, "run", "--package", str(package))
    assert len(api.calls("POST", API + "/experiments")) == 1
    assert len(api.calls("POST", API + "/runs")) == 2
    lookup = api.calls("GET", API + "/experiments")[0]
    assert json.loads(lookup.query["filter"])["predicates"][0]["stringValue"] == "goodput"


def test_run_wait_follows_states_and_tasks(api, package):
    res = goodput(api, "run", "--package", str(package), "--wait", "--poll-interval", "0.01")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    states = [ln.split()[-1] for ln in lines if " run " in ln]
    assert states == ["PENDING", "RUNNING", "SUCCEEDED"]
    assert any("train" in ln and ln.endswith("RUNNING") for ln in lines)
    assert any("evaluate" in ln and ln.endswith("SUCCEEDED") for ln in lines)
    assert len(api.calls("GET")) >= 4


def test_run_wait_exits_nonzero_when_the_run_fails(api, package):
    api.run_script = [("RUNNING", {"train": "RUNNING"}), ("FAILED", {"train": "FAILED"})]
    res = goodput(api, "run", "--package", str(package), "--wait", "--poll-interval", "0.01")
    assert res.exit_code == 1
    assert "ended FAILED" in res.output


def test_run_an_uploaded_pipeline_version_by_name(api, package):
    pid = api.add_pipeline("goodput-train", versions=("old", "new"))
    for v in api.versions.values():
        v["pipeline_spec"] = {"pipeline_spec": yaml.safe_load(package.read_text()), "platform_spec": {}}
    new = [v for v in api.versions.values() if v["display_name"] == "new"][0]
    res = goodput(api, "run", "--pipeline", "goodput-train", "-p", "steps=3")
    assert res.exit_code == 0, res.output
    body = only(api, "POST", "/runs").body
    assert body["pipeline_version_reference"] == {"pipeline_id": pid, "pipeline_version_id": new["pipeline_version_id"]}
    assert "pipeline_spec" not in body
    assert body["runtime_config"]["parameters"] == {"steps": 3}

    res = goodput(api, "run", "--pipeline", "goodput-train", "-p", "nope=3")
    assert res.exit_code == 2 and "unknown parameter(s) nope" in res.output
    assert len(api.calls("POST", API + "/runs")) == 1


# --- auth and endpoints ------------------------------------------------------------------------------------

def test_bearer_token_namespace_and_ui_host(api, package):
    res = goodput(api, "run", "--package", str(package), "--namespace", "team-a", "--ui-host", "https://ui.example",
                  env={"KFP_TOKEN": "s3cr3t"})
    assert res.exit_code == 0, res.output
    assert all(r.headers.get("authorization") == "Bearer s3cr3t" for r in api.requests)
    assert only(api, "POST", "/experiments").body["namespace"] == "team-a"
    assert api.calls("GET", API + "/experiments")[0].query["namespace"] == "team-a"
    assert not api.calls("GET", API + "/healthz")         # a namespace was given: no need to ask
    assert f"https://ui.example/#/runs/details/{next(iter(api.runs))}" in res.output
    assert "s3cr3t" not in res.output


def test_session_cookie_for_multi_user_kubeflow(api, package):
    api.multi_user = True
    res = goodput(api, "runs", "list", "--cookie", "authservice_session=abc123", "-n", "team-a")
    assert res.exit_code == 0, res.output
    assert api.requests and all(r.headers.get("cookie") == "authservice_session=abc123" for r in api.requests)
    assert all("authorization" not in r.headers for r in api.requests)
    assert only(api, "GET", "/runs").query["namespace"] == "team-a"


def test_host_from_option_overrides_environment(api):
    res = goodput(api, "runs", "list", "--host", api.url, env={"KFP_HOST": "http://127.0.0.1:9"}, host=False)
    assert res.exit_code == 0, res.output
    assert api.calls("GET", API + "/runs")


def test_missing_or_bad_endpoint_fails_clearly(api, package):
    res = goodput(api, "runs", "list", host=False)
    assert res.exit_code == 2 and "pass --host or set KFP_HOST" in res.output
    res = goodput(api, "runs", "list", "--host", "kfp.example.com")
    assert res.exit_code == 2 and "needs a scheme" in res.output
    res = goodput(api, "runs", "list", "--cookie", "justavalue")
    assert res.exit_code == 2 and "NAME=VALUE" in res.output
    assert api.requests == []


def test_unreachable_host_fails_fast(api):
    import time

    t0 = time.monotonic()
    res = goodput(api, "runs", "list", "--host", "http://127.0.0.1:9")
    assert res.exit_code == 1 and "cannot reach the KFP API" in res.output
    assert time.monotonic() - t0 < 15


# --- schedule ----------------------------------------------------------------------------------------------

def test_schedule_weekly_cron(api, package):
    res = goodput(api, "schedule", "--name", "weekly-retrain", "--cron", "0 0 3 * * MON", "--package", str(package),
                  "--start", "2026-01-05T00:00:00Z", "--end", "2026-12-31", "--max-concurrency", "2",
                  "-p", "steps=1000", "--experiment", "retrain")
    assert res.exit_code == 0, res.output
    body = only(api, "POST", "/recurringruns").body
    assert body["display_name"] == "weekly-retrain"
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * MON", "start_time": "2026-01-05T00:00:00+00:00",
                                                 "end_time": "2026-12-31T00:00:00+00:00"}}
    assert str(body["max_concurrency"]) == "2"
    assert body["no_catchup"] is True and body["mode"] == "ENABLE"
    assert body["runtime_config"]["parameters"] == {"steps": 1000}
    assert "first run 2026-01-05 03:00:00 UTC" in res.output
    assert body["experiment_id"] == next(iter(api.experiments))
    assert body["pipeline_spec"]["pipelineInfo"]["name"] == "tiny"
    rid = next(iter(api.recurring))
    assert f"{api.url}/#/recurringrun/details/{rid}" in res.output


def test_schedule_interval_with_catchup_from_uploaded_pipeline(api, package):
    pid = api.add_pipeline("goodput-train")
    vid = next(iter(api.versions))
    api.versions[vid]["pipeline_spec"] = yaml.safe_load(package.read_text())
    res = goodput(api, "schedule", "create", "--name", "n", "--every", "7d", "--catchup", "--pipeline", "goodput-train")
    assert res.exit_code == 0, res.output
    body = only(api, "POST", "/recurringruns").body
    assert body["trigger"] == {"periodic_schedule": {"interval_second": 7 * 86400}}
    assert body["no_catchup"] is False
    assert body["pipeline_version_reference"] == {"pipeline_id": pid, "pipeline_version_id": vid}


def test_schedule_list_pause_resume_delete_by_name(api, package):
    assert goodput(api, "schedule", "--name", "weekly", "--cron", "@weekly", "--package", str(package)).exit_code == 0
    rid = next(iter(api.recurring))
    res = goodput(api, "schedule", "list")
    assert res.exit_code == 0 and "weekly" in res.output and "ENABLED" in res.output
    assert goodput(api, "schedule", "pause", "weekly").exit_code == 0
    only(api, "POST", f"/recurringruns/{rid}:disable")
    assert api.recurring[rid]["status"] == "DISABLED"
    assert goodput(api, "schedule", "resume", rid).exit_code == 0
    only(api, "POST", f"/recurringruns/{rid}:enable")
    assert goodput(api, "schedule", "delete", "weekly").exit_code == 0
    only(api, "DELETE", f"/recurringruns/{rid}")
    assert api.recurring == {}
    res = goodput(api, "schedule", "pause", "gone")
    assert res.exit_code == 1 and "HTTP 404" in res.output


# --- runs ------------------------------------------------------------------------------------------------

def test_runs_list_and_get(api, package):
    goodput(api, "run", "--package", str(package), "--run-name", "first", "-p", "steps=7")
    goodput(api, "run", "--package", str(package), "--run-name", "second")
    res = goodput(api, "runs", "list", "--max", "5")
    assert res.exit_code == 0, res.output
    listing = only(api, "GET", "/runs")
    assert listing.query["page_size"] == "5" and listing.query["sort_by"] == "created_at desc"
    assert res.output.index("second") < res.output.index("first")

    rid = next(iter(api.runs))
    api.run_polls[rid] = 3                                            # the script's last state: SUCCEEDED
    res = goodput(api, "runs", "get", rid)
    assert res.exit_code == 0, res.output
    assert f"run 'first' ({rid}): SUCCEEDED" in res.output
    assert "steps = 7" in res.output and "task evaluate" in res.output
    res = goodput(api, "runs", "get", rid, "--json")
    assert json.loads(res.output)["run_id"] == rid

    res = goodput(api, "runs", "list", "--experiment", "no-such")
    assert res.exit_code == 2 and "no experiment called 'no-such'" in res.output


# --- rejected before any request -------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["run", "-p", "steps"], "malformed parameter 'steps'"),
    (["run", "-p", "=3"], "malformed parameter '=3'"),
    (["run", "-p", "stpes=3"], "unknown parameter(s) stpes"),
    (["run", "-p", "steps=many"], "parameter 'steps' expects integer, got 'many'"),
    (["run", "-p", "fast=maybe"], "parameter 'fast' expects boolean"),
    (["run", "--pipeline", "goodput-train", "-p", "oops"], "malformed parameter 'oops'"),
    (["schedule", "--name", "w", "--cron", "0 3 * * 1"], "did you mean '0 0 3 * * 1'?"),
    (["schedule", "--name", "w", "--cron", "0 0 25 * * *"], "hour: 25 is outside 0-23"),
    (["schedule", "--name", "w", "--cron", "0 0 3 * * FUNDAY"], "day-of-week"),
    (["schedule", "--name", "w", "--cron", "@fortnightly"], "unknown descriptor"),
    (["schedule", "--name", "w", "--cron", "@weekly", "--every", "7d"], "exactly one of --cron and --every"),
    (["schedule", "--name", "w", "--every", "7 days"], "interval '7 days'"),
    (["schedule", "--name", "w", "--every", "1d", "--start", "2026-02-01", "--end", "2026-01-01"], "is not after"),
    (["schedule", "--name", "w", "--every", "1d", "--max-concurrency", "11"], "1<=x<=10"),
    (["schedule", "--name", "w", "--cron", "0 0 0 30 2 *"], "never fires"),
    (["schedule", "--name", "w", "--cron", "@every 0h"], "would run every 1 s"),
    (["schedule", "--name", "w", "--cron", "0 0 3 * * MON", "--start", "2026-01-06", "--end", "2026-01-10"],
     "first fires at 2026-01-12 03:00:00 UTC, after --end 2026-01-10: the schedule would never run"),
    (["schedule", "--name", "w", "--every", "1d", "-p", "steps=x"], "expects integer"),
])
def test_bad_arguments_are_rejected_before_any_request(api, package, args, message):
    res = goodput(api, *args, *(["--package", str(package)] if "--pipeline" not in args else []))
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output
    assert api.requests == []


@pytest.fixture(scope="module")
def goodput_package(tmp_path_factory):
    return compile_pipeline(tmp_path_factory.mktemp("goodput") / "goodput.yaml")


@pytest.mark.parametrize("args, message", [
    (["run", "-p", "max_steps=-5"], "--max-steps must be at least 1, got -5"),
    (["run", "--inject-fault", "boom@3"], "bad fault 'boom@3'"),
    (["run", "-p", "parallel=tp"], "parallel.parallel: 'tp' is not one of fsdp, ddp"),
    (["run", "-p", "nodes=0"], "nodes must be at least 1, got 0"),
    (["run", "-p", "gpus_per_node=-3"], "gpus_per_node must be at least -1"),
    (["run", "-p", "train_timeout_s=0"], "train_timeout_s must be above 0"),
    (["run", "-p", "require_beat_baseline=true"], "require_beat_baseline needs a baseline"),
    (["run", "-p", "model=llama", "-p", "model_flavor=llama3-2b"], "llama has the flavors"),
    (["schedule", "--name", "w", "--every", "1d", "-p", "model_config={n_layers: 2}"], "not valid JSON"),
    (["schedule", "--name", "w", "--every", "1d", "-p", "evaluate_gpu_resource=a100"], "evaluate_gpu_resource"),
])
def test_settings_the_check_settings_step_rejects_fail_here_in_one_line(api, goodput_package, args, message):
    res = goodput(api, *args, "-p", "dataset_source=s3://b/p/", "--package", str(goodput_package))
    assert res.exit_code == 2 and message in res.output, res.output
    assert res.output.strip().startswith("Error: ") and len(res.output.strip().splitlines()) == 1, res.output
    assert api.requests == []


@pytest.mark.parametrize("args, message", [
    (["--fsx-root", "fsx"], "--fsx-root: only for --local runs; leave it out"),
    (["--verbose"], "--verbose: only for --local runs; leave it out"),
    (["-v", "--wait"], "--verbose: only for --local runs; leave it out"),
    (["--timeout", "60"], "--timeout: only with --wait; leave it out"),
    (["--poll-interval", "1", "--timeout", "5"], "--timeout, --poll-interval: only with --wait; leave them out"),
])
def test_options_a_cluster_run_would_not_apply_are_refused(api, package, args, message):
    res = goodput(api, "run", "--package", str(package), *args)
    assert res.exit_code == 2, res.output
    assert res.output.strip() == f"Error: {message}", res.output
    assert api.requests == []


def test_params_file_errors_are_rejected_before_any_request(api, package, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    res = goodput(api, "run", "--package", str(package), "--params-file", str(bad))
    assert res.exit_code == 2 and "expected a mapping" in res.output
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("stepz: 3\n")
    res = goodput(api, "run", "--package", str(package), "--params-file", str(unknown))
    assert res.exit_code == 2 and "unknown parameter(s) stepz" in res.output
    assert api.requests == []


def test_run_without_a_package_sends_this_checkouts_pipeline(api):
    res = goodput(api, "run", "-p", "max_steps=10")
    assert res.exit_code == 2 and "missing required parameter(s): dataset_source" in res.output
    res = goodput(api, "run", "-p", "max_stepz=10", "-p", "dataset_source=s3://b/p/")
    assert res.exit_code == 2 and "unknown parameter(s) max_stepz" in res.output
    assert api.requests == []
    res = goodput(api, "run", "-p", "dataset_source=s3://b/corpus/", "-p", "nodes=4", "--inject-fault", "kill@100:3")
    assert res.exit_code == 0, res.output
    body = only(api, "POST", "/runs").body
    assert body["runtime_config"]["parameters"] == {"dataset_source": "s3://b/corpus/", "nodes": 4,
                                                    "inject_fault": "kill@100:3"}
    # The compiled pipeline with its Kubernetes platform spec (PVC mounts, secrets) goes along.
    assert body["pipeline_spec"]["pipeline_spec"]["pipelineInfo"]["name"] == "goodput-train"
    executors = body["pipeline_spec"]["platform_spec"]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert executors["exec-evaluate-op"]["pvcMount"][0]["mountPath"] == "/fsx"
