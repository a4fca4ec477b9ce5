"""What the builder and deploy/ produce, as a real kube-apiserver takes it (``tests/k8s_apiserver.py``).

Every PyTorchJob variant the builder makes is created and read back whole: the CRD's structural schema
prunes fields it does not know, silently, so a field the Training Operator would never see shows up here
as missing. The deploy manifests pass a server-side dry run; the profile-namespace setup is applied as
deploy/profile/profile.yaml says and checked with ``kubectl auth can-i``, then the launcher runs under it.
"""

from __future__ import annotations

import json
import threading

import pytest
from kubernetes import client as k8s

from components.train.pytorchjob import INSTANCE_TYPES, JobSpec, job_manifest
from components.train.supervise import run_job
from trainer.launch import LaunchConfig

try:
    from tests.deploy_checks import DEPLOY, render
    from tests.k8s_apiserver import Operator, apiserver, make_namespace, wait_until
except ImportError:          # tests/ is not a package: pytest put it on sys.path
    from deploy_checks import DEPLOY, render
    from k8s_apiserver import Operator, apiserver, make_namespace, wait_until

try:
    from tests.test_pytorchjob_build import IMG, VARIANTS as BUILD_VARIANTS
except ImportError:          # tests/ is not a package: pytest put it on sys.path
    from test_pytorchjob_build import IMG, VARIANTS as BUILD_VARIANTS

BASE = {"image": IMG, "run_id": "run-1", "task_name": "train"}
# Every variant the builder's own tests make, and one whole-node job per documented instance type.
VARIANTS = {**BUILD_VARIANTS, **{f"instance {t}": {"instance_type": t, "gpus_per_node": shape.gpus, "nodes": 2}
                                 for t, shape in INSTANCE_TYPES.items()}}


def missing(sent, got, path: str = "") -> list[str]:
    """Paths of ``sent`` that ``got`` lacks or holds differently (``got`` may add defaults)."""
    if isinstance(sent, dict):
        if not isinstance(got, dict):
            return [path or "/"]
        return [p for k, v in sent.items()
                for p in (missing(v, got[k], f"{path}.{k}") if k in got else [f"{path}.{k}"])]
    if isinstance(sent, list):
        if not isinstance(got, list) or len(got) != len(sent):
            return [path]
        return [p for i, (a, b) in enumerate(zip(sent, got)) for p in missing(a, b, f"{path}[{i}]")]
    return [] if sent == got else [f"{path}: sent {sent!r}, read back {got!r}"]


@pytest.fixture(scope="module")
def admin_ns(tmp_path_factory):
    return make_namespace(apiserver(), "manifests", tmp=tmp_path_factory.mktemp("kube"))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_builder_variant_is_created_and_read_back_unpruned(admin_ns, variant):
    settings = {**BASE, "name": "v-" + "".join(c if c.isalnum() else "-" for c in variant.lower())[:40].strip("-"),
                **VARIANTS[variant], "namespace": admin_ns.name}
    m = job_manifest(JobSpec(**settings))
    name = m["metadata"]["name"]
    co = k8s.CustomObjectsApi(admin_ns.server.admin)
    co.create_namespaced_custom_object("kubeflow.org", "v1", admin_ns.name, "pytorchjobs", m)
    got = co.get_namespaced_custom_object("kubeflow.org", "v1", admin_ns.name, "pytorchjobs", name)
    assert missing(m["spec"], got["spec"], "spec") == []
    assert missing(m["metadata"]["labels"], got["metadata"]["labels"], "labels") == []


def test_trainjobs_for_each_nvrx_release_and_a_runtime_with_the_node_health_daemon_are_taken_whole(admin_ns):
    """The runtime for 0.7 images on nodes with a health daemon (the socket directory mounted from the node), and
    TrainJobs on it: a 0.7 one (the runtime's command) and a 0.6 one with launch settings of its own (its own
    command); their JobSets too."""
    import uuid

    from components.train.trainjob import RuntimeSpec, runtime_manifest, trainjob_manifest
    from tests.test_trainjob_build import effective_jobset

    co = k8s.CustomObjectsApi(admin_ns.server.admin)
    endpoint = "/var/run/nvhcd/nvhcd.sock"
    rt = RuntimeSpec(name=f"goodput-nvrx-0-7-{uuid.uuid4().hex[:6]}", pods=JobSpec(
        image=IMG, scheduler="volcano", nvrx_release="0.7.0", node_health_check_endpoint=endpoint))
    sent = runtime_manifest(rt)
    back = co.create_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", sent)
    try:
        assert missing(sent["spec"], back["spec"], "spec") == []
        pod = sent["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        assert {"name": "node-health", "hostPath": {"path": "/var/run/nvhcd", "type": "DirectoryOrCreate"}} in \
            pod["volumes"]
        for release, launch, own_command in (("0.7.0", LaunchConfig(), False), ("0.6.0", LaunchConfig(max_restarts=7),
                                                                                True)):
            name = f"tj-nvrx-{release.replace('.', '-')}"
            job = trainjob_manifest(JobSpec(image=IMG, name=name, namespace=admin_ns.name, nodes=2, launch=launch,
                                            nvrx_release=release, node_health_check_endpoint=endpoint), rt)
            assert ("command" in job["spec"]["trainer"]) == own_command
            got = co.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", admin_ns.name, "trainjobs",
                                                     job)
            assert missing(job["spec"], got["spec"], "spec") == []
            jobset = effective_jobset(sent, job)
            got = co.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", admin_ns.name, "jobsets", jobset)
            assert missing(jobset["spec"], got["spec"], "spec") == []
    finally:
        co.delete_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", rt.name)


def test_yunikorn_task_group_asks_for_what_each_pod_requests(admin_ns):
    m = job_manifest(JobSpec(name="yk", **BASE, nodes=3, scheduler="yunikorn", instance_type="p5.48xlarge"))
    for spec in m["spec"]["pytorchReplicaSpecs"].values():
        pod = spec["template"]
        (group,) = json.loads(pod["metadata"]["annotations"]["yunikorn.apache.org/task-groups"])
        assert group["minMember"] == 3 and pod["spec"]["schedulerName"] == "yunikorn"
        assert group["minResource"] == pod["spec"]["containers"][0]["resources"]["requests"]
        assert pod["metadata"]["labels"]["applicationId"] == "yk"
    assert "schedulingPolicy" not in m["spec"]["runPolicy"], "no PodGroup: YuniKorn gangs by annotation"


# deploy/ ------------------------------------------------------------------------------------------

FSX = {"FSX_FILE_SYSTEM_ID": "fs-0123456789abcdef0", "FSX_DNS_NAME": "fs-0123.fsx.us-west-2.amazonaws.com",
       "FSX_MOUNT_NAME": "abcdefgh", "FSX_SUBNET_ID": "subnet-0123", "FSX_SECURITY_GROUP_ID": "sg-0123"}
DRY_RUN = ["rbac.yaml", "rbac-trainer.yaml", "fsx/pvc-dynamic.yaml",
           "fsx/static-pv.yaml", "fsx/storageclass.yaml", "fsx/init-job.yaml",
           "device-plugins/nvidia-device-plugin.yaml", "device-plugins/efa-device-plugin.yaml",
           "profile/profile.yaml", "kueue/queues/queues.yaml"]


@pytest.mark.parametrize("path", DRY_RUN)
def test_deploy_manifests_pass_a_server_side_dry_run(admin_ns, path):
    server = admin_ns.server
    server.kubectl("create", "namespace", "kubeflow", check=False)
    text = render(DEPLOY / path, PROFILE_NAMESPACE=admin_ns.name, **FSX)
    # Server-side apply checks every field against the server's schema: an unknown or misplaced field fails.
    out = server.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=text)
    assert "serverside-applied (server dry run)" in out.stdout, out.stdout


# The profile namespace -----------------------------------------------------------------------------

LAUNCHER_VERBS = [("create", "pytorchjobs.kubeflow.org"), ("get", "pytorchjobs.kubeflow.org"),
                  ("list", "pytorchjobs.kubeflow.org"), ("watch", "pytorchjobs.kubeflow.org"),
                  ("delete", "pytorchjobs.kubeflow.org"), ("list", "pods"), ("get", "pods/log"),
                  ("list", "events"), ("create", "secrets"), ("patch", "secrets"), ("delete", "secrets"),
                  ("list", "workloads.kueue.x-k8s.io")]
NOT_GRANTED = [("update", "pytorchjobs.kubeflow.org"), ("patch", "pytorchjobs.kubeflow.org"),
               ("create", "pods"), ("delete", "pods"), ("get", "secrets"), ("create", "pods/exec"),
               ("watch", "pods"), ("create", "rolebindings.rbac.authorization.k8s.io"), ("list", "secrets"),
               ("get", "workloads.kueue.x-k8s.io"), ("patch", "workloads.kueue.x-k8s.io")]


def test_a_profile_namespace_runs_the_launcher_as_default_editor(tmp_path):
    server = apiserver()
    core = k8s.CoreV1Api(server.admin)
    # The namespace and its default-editor as Kubeflow's profile controller leaves them (no bindings yet) ...
    ns = make_namespace(server, "team", sa="default-editor", rbac="", tmp=tmp_path)
    # ... then the two commands of deploy/profile/profile.yaml.
    server.kubectl("apply", "-n", ns.name, "-l", "goodput.dev/rbac=role", "-f", str(DEPLOY / "rbac.yaml"))
    server.kubectl("apply", "-f", "-", input=render(DEPLOY / "profile" / "profile.yaml", PROFILE_NAMESPACE=ns.name,
                                                    **FSX))
    roles = k8s.RbacAuthorizationV1Api(server.admin)
    assert [b.metadata.name for b in roles.list_namespaced_role_binding(ns.name).items] == ["goodput-train-launcher"]
    pvc = core.read_namespaced_persistent_volume_claim("fsx-claim", ns.name)
    assert pvc.spec.volume_name == f"fsx-pv-{ns.name}"
    lq = k8s.CustomObjectsApi(server.admin).get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", ns.name,
                                                                         "localqueues", "goodput")
    assert lq["spec"]["clusterQueue"] == "goodput-gpu"      # Kueue's queue=goodput in the profile

    def can(verb: str, what: str, who: str = ns.user, where: str = ns.name) -> bool:
        resource, _, sub = what.partition("/")
        out = server.kubectl("auth", "can-i", verb, resource, *([f"--subresource={sub}"] if sub else []),
                             "-n", where, "--as", who, check=False)
        return out.stdout.strip() == "yes"

    assert [v for v in LAUNCHER_VERBS if not can(*v)] == []
    assert [v for v in NOT_GRANTED if can(*v)] == []
    assert not can("list", "pytorchjobs.kubeflow.org", where="default"), "nothing outside the profile"
    assert not can("create", "pytorchjobs.kubeflow.org", who="system:serviceaccount:kubeflow:pipeline-runner")

    op = Operator(ns)
    try:
        def scenario(op, name):
            master = op.add_pod(name, "Master", 0)
            op.set_phase(name, "Running")
            op.log(master, "hello from the profile")
            wait_until(lambda: any("hello from the profile" in ln for ln in lines), what="the log")
            op.terminate(master)
            op.set_phase(name, "Failed", message="1 Master replica(s) failed.")

        lines: list[str] = []
        op.play(scenario)
        m = job_manifest(JobSpec(name="gp-profile", **BASE, gpus_per_node=0, efa_per_node=0))
        result: list = []
        t = threading.Thread(target=lambda: result.append(_run(m, ns, lines)), daemon=True)
        t.start()
        t.join(60)
        op.join()
    finally:
        op.close()
    assert result and "failed" in result[0], result
    refused = [(e.what, e.code) for e in ns.launcher_requests() if e.code in (401, 403)]
    assert refused == [] and any(e.verb == "create" for e in ns.launcher_requests())


def _run(m: dict, ns, lines: list[str]) -> str:
    from components.train.supervise import JobFailed, SuperviseConfig

    try:
        run_job(m, namespace=ns.name, client=ns.launcher_client(), log=lines.append,
                cfg=SuperviseConfig(timeout_s=60, watch_timeout_s=5, pods_every_s=1, log_poll_s=0.1, backoff_s=0.1))
        return "succeeded"
    except JobFailed as e:
        return f"failed: {e}"
