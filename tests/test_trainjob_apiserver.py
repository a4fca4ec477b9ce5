"""TrainJobs, the goodput-nvrx runtime and the JobSet made of them, sent to a real kube-apiserver with the Trainer
v2.3 and JobSet v0.12 CRDs installed: accepted, and read back with nothing pruned; the launcher's Role allows
what the supervisor does and nothing more.

The server is the test session's own (``tests/k8s_apiserver.py``: started from ``../shared/k8s``, with these CRDs
adapted to its 1.20 API); without ``../shared`` the tests skip, unless ``GOODPUT_REQUIRE_APISERVER`` is set (CI).
Each run works in a namespace and under runtime names of its own.
"""

from __future__ import annotations

import base64
import uuid

import pytest

from components.train.pytorchjob import JobSpec
from components.train.trainjob import RuntimeSpec, runtime_manifest, trainjob_manifest
from trainer.launch import LaunchConfig

from tests.deploy_checks import DEPLOY, load_all
from tests.k8s_apiserver import apiserver
from tests.test_trainjob_build import IMG, effective_jobset

GROUP, VERSION = "trainer.kubeflow.org", "v1alpha1"


@pytest.fixture(scope="module")
def api():
    """The admin client of the session's API server (its CRDs installed by the harness)."""
    return apiserver().admin


@pytest.fixture(scope="module")
def ns(api):
    from kubernetes import client

    name = f"goodput-tj-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)     # no namespace controller here: it stays Terminating, and empty


@pytest.fixture(scope="module")
def runtime(api):
    from kubernetes import client

    rt = RuntimeSpec(name=f"goodput-nvrx-test-{uuid.uuid4().hex[:8]}")
    co = client.CustomObjectsApi(api)
    sent = runtime_manifest(rt)
    back = co.create_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", sent)
    yield rt, sent, back
    co.delete_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", rt.name)


def _same(sent: dict, back: dict) -> None:
    """Everything sent came back: the server pruned nothing (it adds metadata, defaults and status)."""
    for key in ("apiVersion", "kind"):
        assert back[key] == sent[key]
    for key, value in sent["metadata"].items():
        assert back["metadata"][key] == value, key
    _within(sent["spec"], back["spec"], "spec")


def _within(want, got, path: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        for k, v in want.items():
            assert k in got, f"{path}.{k} was pruned"
            _within(v, got[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(want, got)):
            _within(a, b, f"{path}[{i}]")
    else:
        assert want == got, f"{path}: {want!r} came back as {got!r}"


def test_the_runtime_is_accepted_unpruned(runtime):
    _, sent, back = runtime
    _same(sent, back)


JOBS = {
    "defaults": dict(),
    "spot-queue-kfp": dict(nodes=4, spot=True, node_group="p5-spot", scheduler="volcano", queue="research",
                           run_id="3fa85f64-5717-4562-b3fc-2c963f66afa6", task_name="train", labels={"team": "a"}),
    "launch-deadline-env": dict(nodes=2, launch=LaunchConfig(max_restarts=7), active_deadline_s=3600,
                                env={"NCCL_DEBUG": "INFO"}, service_account="trainer", termination_grace_s=300,
                                tolerations=[{"key": "m", "operator": "Exists", "effect": "NoExecute",
                                              "tolerationSeconds": 60}]),
}


@pytest.mark.parametrize("variant", sorted(JOBS))
def test_trainjobs_and_their_jobsets_are_accepted_unpruned(api, ns, runtime, variant):
    from kubernetes import client

    rt, rt_sent, _ = runtime
    co = client.CustomObjectsApi(api)
    name = f"tj-{variant}"
    job = trainjob_manifest(JobSpec(image=IMG, name=name, namespace=ns, **JOBS[variant]), rt)
    try:
        _same(job, co.create_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", job))
        _same(job, co.get_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", name))
        jobset = effective_jobset(rt_sent, job)
        _same(jobset, co.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets", jobset))
    finally:
        for group, version, plural in ((GROUP, VERSION, "trainjobs"), ("jobset.x-k8s.io", "v1alpha2", "jobsets")):
            try:
                co.delete_namespaced_custom_object(group, version, ns, plural, name)
            except client.ApiException as e:
                if e.status != 404:
                    raise


def test_the_server_check_is_real(api, ns, runtime):
    """Not vacuous: the server rejects a wrong type, and prunes a field the schema does not know, which the
    comparison above would report."""
    from kubernetes import client

    rt, _, _ = runtime
    co = client.CustomObjectsApi(api)
    job = trainjob_manifest(JobSpec(image=IMG, name="tj-bad", namespace=ns), rt)
    bad = {**job, "spec": {**job["spec"], "trainer": {**job["spec"]["trainer"], "numNodes": "two"}}}
    with pytest.raises(client.ApiException) as err:
        co.create_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", bad)
    assert err.value.status == 422
    extra = {**job, "spec": {**job["spec"], "trainer": {**job["spec"]["trainer"], "numNode": 2}}}
    back = co.create_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", extra)
    try:
        with pytest.raises(AssertionError, match="numNode was pruned"):
            _same(extra, back)
    finally:
        co.delete_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", "tj-bad")


def test_the_launcher_role_allows_what_the_supervisor_does_and_no_edits(api, ns, runtime):
    """deploy/trainer-v2/rbac.yaml bound to a service account, which then acts with its own token."""
    from kubernetes import client

    rt, _, _ = runtime
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    docs = {d["kind"]: d for d in load_all(DEPLOY / "trainer-v2" / "rbac.yaml")}
    for binding in (docs["RoleBinding"], docs["ClusterRoleBinding"]):
        binding["subjects"] = [{"kind": "ServiceAccount", "name": "launcher", "namespace": ns}]
    docs["ClusterRoleBinding"]["metadata"]["name"] += f"-{ns}"
    core.create_namespaced_service_account(ns, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="launcher")))
    rbac.create_namespaced_role(ns, docs["Role"])
    rbac.create_namespaced_role_binding(ns, docs["RoleBinding"])
    try:
        rbac.create_cluster_role(docs["ClusterRole"])
    except client.ApiException as e:
        if e.status != 409:          # another test's namespace bound it already
            raise
    rbac.create_cluster_role_binding(docs["ClusterRoleBinding"])
    token = core.create_namespaced_service_account_token("launcher", ns, client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[]))).status.token
    cfg = client.Configuration()
    cfg.host, cfg.ssl_ca_cert = api.configuration.host, api.configuration.ssl_ca_cert
    if not cfg.ssl_ca_cert and api.configuration.verify_ssl:
        pytest.skip("the kubeconfig's CA is not in a file")
    cfg.api_key = {"authorization": f"Bearer {token}"}
    co = client.CustomObjectsApi(client.ApiClient(cfg))
    job = trainjob_manifest(JobSpec(image=IMG, name="tj-rbac", namespace=ns), rt)
    co.create_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", job)
    co.get_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", "tj-rbac")
    co.list_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", field_selector="metadata.name=tj-rbac")
    with pytest.raises(client.ApiException) as err:        # allowed (not 403): there is no JobSet of that name
        co.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets", "tj-rbac")
    assert err.value.status == 404
    co.get_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", rt.name)    # the runtime check
    client.BatchV1Api(client.ApiClient(cfg)).list_namespaced_job(ns)                    # the failure's rule
    client.CoreV1Api(client.ApiClient(cfg)).list_namespaced_pod(ns)
    for forbidden in (lambda: co.patch_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", "tj-rbac",
                                                                {"metadata": {"labels": {"x": "y"}}}),
                      lambda: co.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", ns, "jobsets",
                                                                 {"apiVersion": "jobset.x-k8s.io/v1alpha2",
                                                                  "kind": "JobSet", "metadata": {"name": "x"},
                                                                  "spec": {}}),
                      lambda: co.delete_cluster_custom_object(GROUP, VERSION, "clustertrainingruntimes", rt.name)):
        with pytest.raises(client.ApiException) as err:
            forbidden()
        assert err.value.status == 403
    co.delete_namespaced_custom_object(GROUP, VERSION, ns, "trainjobs", "tj-rbac")
    assert base64.b64decode(token.split(".")[1] + "==")     # a real signed service-account token
