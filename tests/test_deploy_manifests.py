"""The Kubernetes manifests of ``deploy/``: FSx (CSI driver pin, StorageClass, static PV/PVC), the Training
Operator and Volcano pins, RBAC, and the observability kit (PodMonitor, Grafana dashboard).

Kubernetes objects go through the official client models, the PodMonitor through the prometheus-operator CRD
schema, the PyTorchJob it scrapes through the Training Operator CRD in ``../shared/schemas``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from components.train.pytorchjob import CONTAINER_NAME, JobSpec, job_manifest
from trainer.config import MetricsConfig, parse_config

from tests.deploy_checks import (DEPLOY, SHARED_SCHEMAS, crd_validator, load_all, model_roundtrip_problems,
                                 placeholders, schema_errors)

DATA = Path(__file__).parent / "data"
FSX = dict(FSX_SUBNET_ID="subnet-0123456789abcdef0", FSX_SECURITY_GROUP_ID="sg-0123456789abcdef0",
           FSX_FILE_SYSTEM_ID="fs-0123456789abcdef0", FSX_DNS_NAME="fs-0123456789abcdef0.fsx.us-west-2.amazonaws.com",
           FSX_MOUNT_NAME="abcdefgh")
# StorageClass parameters aws-fsx-csi-driver v1.9.0 reads (pkg/driver/controller.go volumeParams*).
FSX_CSI_PARAMETERS = {"subnetId", "securityGroupIds", "autoImportPolicy", "s3ImportPath", "s3ExportPath",
                      "deploymentType", "kmsKeyId", "perUnitStorageThroughput", "storageType", "driveCacheType",
                      "automaticBackupRetentionDays", "dailyAutomaticBackupStartTime", "copyTagsToBackups",
                      "dataCompressionType", "weeklyMaintenanceStartTime", "fileSystemTypeVersion", "extraTags",
                      "efaEnabled", "metadataConfigurationMode", "metadataIops"}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "patches", "namespace", "configMapGenerator", "images",
                      "labels", "components", "generatorOptions", "replacements"}
PINNED_REMOTES = {
    "training-operator": ("github.com/kubeflow/training-operator.git/manifests/overlays/standalone", r"v1\.9\.\d+"),
    "aws-fsx-csi-driver": ("github.com/kubernetes-sigs/aws-fsx-csi-driver/deploy/kubernetes/overlays/stable",
                           r"v\d+\.\d+\.\d+"),
    "volcano": ("https://raw.githubusercontent.com/volcano-sh/volcano/", r"v\d+\.\d+\.\d+"),
    "kueue": ("https://github.com/kubernetes-sigs/kueue/releases/download/", r"v\d+\.\d+\.\d+"),
    "trainer": ("github.com/kubeflow/trainer.git/manifests/overlays/manager", r"v2\.\d+\.\d+"),
}


def _fsx_docs(name: str) -> list[dict]:
    path = DEPLOY / "fsx" / name
    return load_all(path, **{k: v for k, v in FSX.items() if k in placeholders(path.read_text())})


# FSx -------------------------------------------------------------------------------------------------------

def test_fsx_objects_are_valid_kubernetes_objects():
    docs = _fsx_docs("storageclass.yaml") + _fsx_docs("pvc-dynamic.yaml") + _fsx_docs("static-pv.yaml")
    assert [d["kind"] for d in docs] == ["StorageClass", "PersistentVolumeClaim", "PersistentVolume",
                                         "PersistentVolumeClaim"]
    for d in docs:
        assert model_roundtrip_problems(d) == [], d["kind"]


def test_dynamic_storage_class_makes_a_file_system_that_can_be_linked_to_s3():
    (sc,) = _fsx_docs("storageclass.yaml")
    assert sc["provisioner"] == "fsx.csi.aws.com"
    assert set(sc["parameters"]) <= FSX_CSI_PARAMETERS
    assert all(isinstance(v, str) for v in sc["parameters"].values())      # StorageClass parameters are strings
    # Data repository associations (goodput fsx link) exist only on PERSISTENT_2, without automatic backups.
    assert sc["parameters"]["deploymentType"] == "PERSISTENT_2"
    assert sc["parameters"]["automaticBackupRetentionDays"] == "0"
    assert sc["reclaimPolicy"] == "Retain"                                   # checkpoints outlive the claim
    (pvc,) = _fsx_docs("pvc-dynamic.yaml")
    assert pvc["spec"]["storageClassName"] == sc["metadata"]["name"]
    # PERSISTENT_2 sizes come in 1200 GiB steps.
    assert int(pvc["spec"]["resources"]["requests"]["storage"].removesuffix("Gi")) % 1200 == 0


def test_both_claims_are_the_one_the_trainer_pods_mount():
    spec = JobSpec(image="x")
    (dynamic,) = _fsx_docs("pvc-dynamic.yaml")
    pv, static = _fsx_docs("static-pv.yaml")
    for pvc in (dynamic, static):
        assert pvc["metadata"]["name"] == spec.pvc                            # JobSpec.pvc, the pipeline's fsx_pvc
        assert pvc["metadata"]["namespace"] == "kubeflow"                     # where the pipeline runs its jobs
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]                # every pod of every node
    assert static["spec"]["volumeName"] == pv["metadata"]["name"] and static["spec"]["storageClassName"] == ""
    assert pv["spec"]["csi"]["driver"] == "fsx.csi.aws.com"
    assert pv["spec"]["csi"]["volumeHandle"] == FSX["FSX_FILE_SYSTEM_ID"]
    assert set(pv["spec"]["csi"]["volumeAttributes"]) == {"dnsname", "mountname"}
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"


# Operators (pinned remotes) ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["training-operator/kustomization.yaml",
                                  "training-operator/volcano/kustomization.yaml", "fsx/csi-driver/kustomization.yaml",
                                  "device-plugins/kustomization.yaml", "observability/kustomization.yaml",
                                  "kueue/kustomization.yaml", "trainer-v2/kustomization.yaml",
                                  "trainer-v2/v2.4/kustomization.yaml"])
def test_kustomizations_are_well_formed_and_pinned(path):
    (k,) = load_all(DEPLOY / path)
    assert (k["apiVersion"], k["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    assert set(k) <= KUSTOMIZATION_KEYS
    base = (DEPLOY / path).parent
    for r in k.get("resources", []):
        if "://" in r or r.startswith("github.com/"):
            (name,) = [n for n, (prefix, _) in PINNED_REMOTES.items() if r.startswith(prefix)]
            version = PINNED_REMOTES[name][1]
            # A release tag, never a branch: ?ref=vX.Y.Z, or /vX.Y.Z/ in a raw URL.
            assert re.search(rf"\?ref={version}$", r) or re.search(rf"/{version}/", r), r
        else:
            assert (base / r).exists(), r


def test_training_operator_is_v1_9_and_volcano_switches_on_its_gang_scheduler():
    (k,) = load_all(DEPLOY / "training-operator" / "kustomization.yaml")
    assert k["resources"] == ["github.com/kubeflow/training-operator.git/manifests/overlays/standalone?ref=v1.9.0"]
    # The CRD our jobs validate against is the release-1.9 PyTorchJob.
    assert (SHARED_SCHEMAS / "kubeflow.org_pytorchjobs.yaml").is_file()
    (v,) = load_all(DEPLOY / "training-operator" / "volcano" / "kustomization.yaml")
    assert v["resources"][0] == ".."
    (patch,) = v["patches"]
    assert patch["target"] == {"group": "apps", "version": "v1", "kind": "Deployment", "name": "training-operator",
                               "namespace": "kubeflow"}
    ops = yaml.safe_load(patch["patch"])
    # The operator's Deployment runs command ["/manager"] (manifests/base/deployment.yaml at v1.9.0).
    assert ops == [{"op": "add", "path": "/spec/template/spec/containers/0/command/-",
                    "value": "--gang-scheduler-name=volcano"}]
    # ...which is what the builder's scheduler=volcano expects: pods with schedulerName volcano, a PodGroup.
    m = job_manifest(JobSpec(image="x", nodes=2, scheduler="volcano", queue="research"))
    pod = m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["schedulerName"] == "volcano" and m["spec"]["runPolicy"]["schedulingPolicy"]["queue"] == "research"


def test_rbac_objects_are_valid():
    for d in load_all(DEPLOY / "rbac.yaml"):
        assert model_roundtrip_problems(d) == []


# Observability -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def podmonitor() -> dict:
    (pm,) = load_all(DEPLOY / "observability" / "podmonitor.yaml")
    return pm


def test_podmonitor_validates_against_the_prometheus_operator_crd(podmonitor):
    validator = crd_validator(DATA / "monitoring.coreos.com_podmonitors.yaml", "v1")
    assert schema_errors(validator, podmonitor) == []
    bad = json.loads(json.dumps(podmonitor))
    bad["spec"]["podMetricsEndpoint"] = bad["spec"].pop("podMetricsEndpoints")
    assert schema_errors(validator, bad)                                    # the check is strict
    # kube-prometheus-stack's Prometheus selects PodMonitors by its release label.
    assert podmonitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_podmonitor_scrapes_every_rank_of_every_builder_pod(podmonitor):
    validator = crd_validator(SHARED_SCHEMAS / "kubeflow.org_pytorchjobs.yaml", "v1")
    ports = {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]}
    for spec in (JobSpec(image="x", nodes=2, run_id="run-1", task_name="train"),      # 8 ranks per pod
                 JobSpec(image="x", nodes=1, gpus_per_node=4, efa_per_node=16),          # 4
                 JobSpec(image="x", nodes=2, gpus_per_node=0, nproc_per_node=2)):        # CPU, 2
        m = job_manifest(spec)
        assert schema_errors(validator, m) == []
        for replica in m["spec"]["pytorchReplicaSpecs"].values():
            template = replica["template"]
            labels = template["metadata"]["labels"]
            assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
            (c,) = [c for c in template["spec"]["containers"] if c["name"] == CONTAINER_NAME]
            metrics = {p["name"]: p["containerPort"] for p in c["ports"] if p["name"].startswith("metrics-")}
            # One port per local rank, at --metrics-port + local rank, each one scraped.
            assert metrics == {f"metrics-{i}": 9500 + i for i in range(spec.procs)}
            assert set(metrics) <= ports
            assert all(len(name) <= 15 for name in metrics)                 # IANA_SVC_NAME limit
            # The trainer is told the same port.
            cmd = c["command"]
            assert parse_config(cmd[cmd.index("trainer") + 1:], validate=False).metrics.metrics_port == 9500
    assert "goodput.dev/job" in podmonitor["spec"]["podTargetLabels"]
    assert MetricsConfig().metrics_port == 0                                 # off outside the cluster


def test_metrics_off_in_the_builder_means_no_ports_and_no_flag():
    m = job_manifest(JobSpec(image="x", metrics_port=0))
    c = m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert [p["name"] for p in c["ports"]] == ["pytorchjob-port"] and "metrics_port" not in " ".join(c["command"])
    # An explicit trainer flag wins, and the ports follow it.
    m = job_manifest(JobSpec(image="x", trainer={"metrics": {"metrics_port": 9600}}))
    c = m["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert {p["containerPort"] for p in c["ports"] if p["name"].startswith("metrics-")} == set(range(9600, 9608))
    with pytest.raises(ValueError, match="clear of master_port"):
        JobSpec(image="x", metrics_port=23450).validate()                     # 23450..23457 hits 23456


def test_dcgm_exporter_values_cover_every_gpu_node():
    values = yaml.safe_load((DEPLOY / "observability" / "dcgm-exporter-values.yaml").read_text())
    assert values["tolerations"] == [{"operator": "Exists"}]
    assert values["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    sm = values["serviceMonitor"]
    # honorLabels keeps DCGM's pod label (the training pod) instead of renaming it exported_pod.
    assert sm["enabled"] and sm["honorLabels"] and sm["additionalLabels"]["release"] == "kube-prometheus-stack"


# The Grafana dashboard ----------------------------------------------------------------------------------------

DCGM_SERIES = {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless", "inf", "nan"}
# Labels a query may use: the trainer's own (layer, le), the target labels Prometheus adds to what the
# PodMonitor scrapes (podTargetLabels become goodput_dev_job, goodput_dev_kfp_run_id) and DCGM's (honorLabels).
TARGET_LABELS = {"pod", "namespace", "container", "instance", "job", "endpoint"}


def promql_series(expr: str) -> set[str]:
    """Metric names in a PromQL expression (not functions, keywords, label names, strings or durations)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)                      # strings
    e = re.sub(r"\{[^}]*\}", "", e)                                  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                                 # ranges
    e = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", e)     # grouping label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group() in PROMQL_WORDS:
            continue
        names.add(m.group())
    return names


def promql_labels(expr: str) -> set[str]:
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", " ".join(re.findall(r"\{[^}]*\}", e))))
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", e):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    return labels


def test_promql_parsing_finds_series_and_labels():
    expr = ('histogram_quantile(0.5, sum by (le) (rate(goodput_step_seconds_bucket{goodput_dev_job=~"$job"}'
            '[$__rate_interval]))) / max(goodput_x) + avg by (pod) (DCGM_FI_DEV_GPU_UTIL{pod=~"a-(b|c)"})')
    assert promql_series(expr) == {"goodput_step_seconds_bucket", "goodput_x", "DCGM_FI_DEV_GPU_UTIL"}
    assert promql_labels(expr) == {"le", "goodput_dev_job", "pod"}


def exported_series(tmp_path) -> set[str]:
    """Every sample name a trainer process serves, scraped from a real exporter (run-wide series included)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from trainer.events import Event, EventLog
    from trainer.metrics import MetricsExporter

    from tests.test_metrics import free_ports

    log = EventLog(tmp_path / "events.jsonl", 0)
    log.emit(Event.RUN_START, world_size=1, restart_count=0, run_id="r", agent_attempts={}, agent_restart_counts={})
    log.close()
    port = free_ports(1)
    exporter = MetricsExporter(MetricsConfig(metrics_port=port, metrics_addr="127.0.0.1"), rank=0, local_rank=0,
                               world_size=1, events_path=tmp_path / "events.jsonl")
    try:
        exporter.observe_step(1, 0.1, 1000)
        exporter.observe_checkpoint(0.01)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        exporter.close()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_grafana_dashboard_queries_only_series_that_exist(tmp_path, podmonitor):
    (k,) = load_all(DEPLOY / "observability" / "kustomization.yaml")
    (gen,) = k["configMapGenerator"]
    assert gen["files"] == ["grafana-dashboard.json"] and gen["options"]["labels"] == {"grafana_dashboard": "1"}
    dash = json.loads((DEPLOY / "observability" / "grafana-dashboard.json").read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    # A 24-column grid without overlaps.
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine

    exported = exported_series(tmp_path)
    target_labels = {re.sub(r"[^A-Za-z0-9_]", "_", label) for label in podmonitor["spec"]["podTargetLabels"]}
    allowed_labels = target_labels | TARGET_LABELS | {"layer", "le", "rank", "local_rank", "world_size"}
    used = set()
    # The job picker lists the values of a label the PodMonitor adds, on a series the trainer exports.
    metric, label = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variables["job"]["definition"]).groups()
    assert metric in exported and label in target_labels
    for expr in [t["expr"] for p in panels for t in p["targets"]]:
        series = promql_series(expr)
        unknown = series - exported - DCGM_SERIES
        assert not unknown, f"{expr}: {unknown}"
        assert promql_labels(expr) <= allowed_labels, expr
        used |= series
    # The dashboard shows what the issue asks for, together with DCGM's GPU utilisation and memory.
    for name in ("goodput_step_seconds_bucket", "goodput_tokens_per_second", "goodput_ratio", "goodput_restarts",
                 "goodput_checkpoint_blocking_last_seconds", "goodput_last_committed_step",
                 "goodput_data_wait_ratio", *DCGM_SERIES):
        assert name in used, name
    # Each panel's datasource is the dashboard's variable, so the import works with any Prometheus name.
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)


def test_the_readme_names_files_that_exist_and_the_pinned_versions():
    readme = (DEPLOY / "README.md").read_text()
    for path in set(re.findall(r"\b((?:deploy|images)/[\w./-]+\w)", readme)):
        assert (DEPLOY.parent / path).exists(), path
    (volcano,) = load_all(DEPLOY / "training-operator" / "volcano" / "kustomization.yaml")
    assert re.search(r"/(v[\d.]+)/", volcano["resources"][1]).group(1) in readme
    (operator,) = load_all(DEPLOY / "training-operator" / "kustomization.yaml")
    assert operator["resources"][0].rsplit("=", 1)[1] in readme
    dcgm = (DEPLOY / "observability" / "dcgm-exporter-values.yaml").read_text()
    assert re.search(r"--version ([\d.]+)", dcgm).group(1) in readme
