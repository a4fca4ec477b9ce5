"""``deploy/cluster.yaml`` (eksctl) and ``deploy/device-plugins``: accepted by eksctl, and agreeing with the
PyTorchJob builder: every job the builder makes schedules on the node groups meant for it, and only there."""

from __future__ import annotations

import re

import pytest

from components.train.pytorchjob import CAPACITY_LABELS, EFA_RESOURCE, GPU_RESOURCE, JobSpec, _parse_taint, job_manifest
from components.train.pytorchjob import INSTANCE_TYPE_LABEL

from tests.deploy_checks import DEPLOY, fits, load_all, model_roundtrip_problems, placeholders, render, tolerates

VALUES = dict(CLUSTER_NAME="goodput", AWS_REGION="us-west-2", AWS_ACCOUNT_ID="123456789012", GPU_AZ="us-west-2a",
              SECOND_AZ="us-west-2b")

# The fields eksctl 0.230 accepts (pkg/apis/eksctl.io/v1alpha5/assets/schema.json: every object there has
# additionalProperties: false), for the objects this config uses.
EKSCTL_KEYS = {
    "ClusterConfig": {"accessConfig", "addons", "addonsConfig", "apiVersion", "autoModeConfig", "availabilityZones",
                      "capabilities", "cloudWatch", "controlPlaneScalingConfig", "fargateProfiles", "gitops", "iam",
                      "iamIdentityMappings", "identityProviders", "karpenter", "kind", "kubeAPIServerConfig",
                      "kubeControllerManagerConfig", "kubeSchedulerConfig", "kubernetesNetworkConfig", "localZones",
                      "managedNodeGroups", "metadata", "nodeGroups", "outpost", "privateCluster",
                      "remoteNetworkConfig", "secretsEncryption", "upgradePolicy", "vpc", "zonalShiftConfig"},
    "ClusterMeta": {"annotations", "forceUpdateVersion", "name", "region", "rollbackConfig", "tags", "version"},
    "ClusterIAM": {"fargatePodExecutionRoleARN", "fargatePodExecutionRolePermissionsBoundary",
                   "podIdentityAssociations", "serviceAccounts", "serviceRoleARN", "serviceRolePermissionsBoundary",
                   "vpcResourceControllerPolicy", "withOIDC"},
    "ClusterIAMServiceAccount": {"attachPolicy", "attachPolicyARNs", "attachRoleARN", "metadata",
                                 "permissionsBoundary", "roleName", "roleOnly", "status", "subjectPattern", "tags",
                                 "wellKnownPolicies"},
    "ClusterIAMMeta": {"annotations", "labels", "name", "namespace"},
    "ManagedNodeGroup": {"additionalVolumes", "ami", "amiFamily", "asgSuspendProcesses", "availabilityZones",
                         "bottlerocket", "capacityReservation", "desiredCapacity", "disableIMDSv1", "disablePodIMDS",
                         "ebsOptimized", "efaEnabled", "enableDetailedMonitoring", "iam", "instanceMarketOptions",
                         "instanceName", "instancePrefix", "instanceSelector", "instanceType", "instanceTypes",
                         "labels", "launchTemplate", "maxPodsPerNode", "maxSize", "minSize", "name",
                         "nodeRepairConfig", "outpostARN", "overrideBootstrapCommand", "placement",
                         "preBootstrapCommands", "privateNetworking", "propagateASGTags", "releaseVersion",
                         "securityGroups", "spot", "ssh", "subnets", "tags", "taints", "updateConfig",
                         "volumeEncrypted", "volumeIOPS", "volumeKmsKeyID", "volumeName", "volumeSize",
                         "volumeThroughput", "volumeType"},
    "NodeGroupTaint": {"effect", "key", "value"},
    "NodeGroupIAM": {"attachPolicy", "attachPolicyARNs", "instanceProfileARN", "instanceRoleARN", "instanceRoleName",
                     "instanceRolePermissionsBoundary", "withAddonPolicies"},
    "NodeGroupIAMAddonPolicies": {"albIngress", "appMesh", "appMeshPreview", "autoScaler",
                                  "awsLoadBalancerController", "certManager", "cloudWatch", "ebs", "efs",
                                  "externalDNS", "fsx", "imageBuilder", "xRay"},
    "ClusterCloudWatch": {"clusterLogging"},
    "ClusterCloudWatchLogging": {"enableTypes", "logRetentionInDays"},
}
AMI_FAMILIES = {"AmazonLinux2023", "AmazonLinux2", "Bottlerocket", "Ubuntu2204", "Ubuntu2404"}
TAINT_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
VOLUME_TYPES = {"gp2", "gp3", "io1", "io2", "sc1", "st1"}
EKS_VERSIONS = {"1.30", "1.31", "1.32", "1.33", "1.34", "1.35"}
LOG_TYPES = {"api", "audit", "authenticator", "controllerManager", "scheduler", "all", "*"}

# What a node of each type offers (allocatable, after the kubelet's reservations; EFA = network cards).
INSTANCES = {
    "p5.48xlarge": {"cpu": "191", "memory": "1900Gi", GPU_RESOURCE: "8", EFA_RESOURCE: "32", "gpu": True},
    "p4d.24xlarge": {"cpu": "95", "memory": "1100Gi", GPU_RESOURCE: "8", EFA_RESOURCE: "4", "gpu": True},
    "m7i.4xlarge": {"cpu": "15", "memory": "58Gi", "gpu": False},
}
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@pytest.fixture(scope="module")
def cluster() -> dict:
    (doc,) = load_all(DEPLOY / "cluster.yaml", **VALUES)
    return doc


def eksctl_problems(cfg: dict) -> list[str]:
    """The fields and values eksctl accepts, for what this config uses (a focused copy of its schema and of
    the validation rules that matter here)."""
    p = []

    def keys(obj: dict, kind: str, where: str) -> None:
        unknown = set(obj) - EKSCTL_KEYS[kind]
        if unknown:
            p.append(f"{where}: unknown {kind} fields {sorted(unknown)}")

    keys(cfg, "ClusterConfig", "config")
    if (cfg.get("apiVersion"), cfg.get("kind")) != ("eksctl.io/v1alpha5", "ClusterConfig"):
        p.append("apiVersion/kind must be eksctl.io/v1alpha5 ClusterConfig")
    meta = cfg.get("metadata") or {}
    keys(meta, "ClusterMeta", "metadata")
    if not meta.get("name") or not meta.get("region"):
        p.append("metadata.name and metadata.region are required")
    if str(meta.get("version")) not in EKS_VERSIONS:
        p.append(f"metadata.version {meta.get('version')!r} is not a version eksctl 0.230 supports")
    iam = cfg.get("iam") or {}
    keys(iam, "ClusterIAM", "iam")
    for i, sa in enumerate(iam.get("serviceAccounts") or []):
        keys(sa, "ClusterIAMServiceAccount", f"iam.serviceAccounts[{i}]")
        keys(sa["metadata"], "ClusterIAMMeta", f"iam.serviceAccounts[{i}].metadata")
        if sa.get("attachPolicyARNs") and not iam.get("withOIDC"):
            p.append("IRSA service accounts need iam.withOIDC")
    for i, ng in enumerate(cfg.get("managedNodeGroups") or []):
        where = f"managedNodeGroups[{i}] {ng.get('name')}"
        keys(ng, "ManagedNodeGroup", where)
        if not ng.get("name"):
            p.append(f"{where}: name is required")
        if ng.get("amiFamily") not in AMI_FAMILIES:
            p.append(f"{where}: amiFamily {ng.get('amiFamily')!r}")
        if ng.get("volumeType", "gp3") not in VOLUME_TYPES:
            p.append(f"{where}: volumeType {ng.get('volumeType')!r}")
        if "instanceType" in ng and "instanceTypes" in ng:
            p.append(f"{where}: instanceType and instanceTypes are exclusive")
        if ng.get("spot") and "instanceTypes" not in ng:
            p.append(f"{where}: spot needs instanceTypes")
        if not ng.get("minSize", 0) <= ng.get("desiredCapacity", 0) <= ng.get("maxSize", 0):
            p.append(f"{where}: minSize <= desiredCapacity <= maxSize")
        if ng.get("efaEnabled") and len(ng.get("availabilityZones") or []) != 1:
            p.append(f"{where}: efaEnabled node groups must have exactly one availability zone")
        for az in ng.get("availabilityZones") or []:
            if az not in cfg.get("availabilityZones", [az]):
                p.append(f"{where}: zone {az} is not one of the cluster's")
        for k, v in (ng.get("labels") or {}).items():
            if not isinstance(v, str) or not _LABEL_KEY.match(k) or not _LABEL_VALUE.match(v):
                p.append(f"{where}: label {k}={v!r} is not a valid Kubernetes label")
        for t in ng.get("taints") or []:
            keys(t, "NodeGroupTaint", where + " taint")
            if t.get("effect") not in TAINT_EFFECTS or not _LABEL_KEY.match(t.get("key", "")):
                p.append(f"{where}: taint {t}")
        if "iam" in ng:
            keys(ng["iam"], "NodeGroupIAM", where + ".iam")
            keys(ng["iam"].get("withAddonPolicies") or {}, "NodeGroupIAMAddonPolicies", where + ".iam.addons")
    cw = cfg.get("cloudWatch") or {}
    keys(cw, "ClusterCloudWatch", "cloudWatch")
    keys(cw.get("clusterLogging") or {}, "ClusterCloudWatchLogging", "cloudWatch.clusterLogging")
    if set(cw.get("clusterLogging", {}).get("enableTypes", [])) - LOG_TYPES:
        p.append("cloudWatch.clusterLogging.enableTypes")
    return p


def test_cluster_config_is_one_eksctl_accepts(cluster):
    assert placeholders((DEPLOY / "cluster.yaml").read_text()) == set(VALUES)
    assert eksctl_problems(cluster) == []


def test_the_eksctl_check_is_strict(cluster):
    """Not vacuous: a misspelt field, an unknown taint effect, EFA across zones and a bad label are caught."""
    import copy

    bad = copy.deepcopy(cluster)
    gpu = bad["managedNodeGroups"][1]
    gpu["efaEnable"] = True
    gpu["taints"][0]["effect"] = "NO_SCHEDULE"
    gpu["availabilityZones"] = ["us-west-2a", "us-west-2b"]
    gpu["labels"]["bad key!"] = "x"
    problems = "\n".join(eksctl_problems(bad))
    for fragment in ("efaEnable", "taint", "exactly one availability zone", "bad key!"):
        assert fragment in problems


def test_node_groups_system_on_demand_and_spot_gpus(cluster):
    groups = {g["name"]: g for g in cluster["managedNodeGroups"]}
    system = [g for g in groups.values() if not any(INSTANCES[t]["gpu"] for t in _types(g))]
    gpu = [g for g in groups.values() if g not in system]
    assert len(system) == 1 and not system[0].get("taints") and not system[0].get("spot")
    assert {t for g in gpu for t in _types(g)} <= {"p5.48xlarge", "p4d.24xlarge"}
    assert any(not g.get("spot") for g in gpu) and any(g.get("spot") for g in gpu)
    for g in gpu:
        # EFA on every GPU group, in private subnets (instances with several network cards get no public IP).
        assert g["efaEnabled"] and g["privateNetworking"] and g["amiFamily"] == "AmazonLinux2023"
        # GPU groups carry the labels the device plugins and DCGM exporter select GPU/EFA nodes by.
        assert g["labels"]["nvidia.com/gpu.present"] == "true" == g["labels"]["vpc.amazonaws.com/efa.present"]
        # Cluster Autoscaler can scale them from zero only if their labels and taints are on the ASG.
        assert g["propagateASGTags"] and g["iam"]["withAddonPolicies"]["autoScaler"]


def _types(group: dict) -> list[str]:
    return group.get("instanceTypes") or [group["instanceType"]]


def _nodes(cluster: dict) -> dict[str, dict]:
    """One node per (group, instance type), labelled as EKS labels managed node group nodes."""
    nodes = {}
    for g in cluster["managedNodeGroups"]:
        for t in _types(g):
            capacity = "SPOT" if g.get("spot") else "ON_DEMAND"
            nodes[g["name"]] = {
                "labels": {**g.get("labels", {}), "eks.amazonaws.com/nodegroup": g["name"],
                           "eks.amazonaws.com/capacityType": capacity, INSTANCE_TYPE_LABEL: t,
                           "kubernetes.io/os": "linux"},
                "taints": g.get("taints", []),
                "allocatable": {k: v for k, v in INSTANCES[t].items() if k != "gpu"},
            }
    return nodes


def _placeable(cluster: dict, **job) -> set[str]:
    manifest = job_manifest(JobSpec(image="ecr/goodput-trainer:0.1.0", nodes=2, **job))
    pods = [r["template"]["spec"] for r in manifest["spec"]["pytorchReplicaSpecs"].values()]
    return {name for name, node in _nodes(cluster).items() if all(not fits(pod, node) for pod in pods)}


def test_the_capacity_label_the_builder_checks_is_the_one_eks_sets(cluster):
    # The builder refuses spot/on-demand contradictions using exactly these label values (CAPACITY_LABELS).
    eks = CAPACITY_LABELS["eks.amazonaws.com/capacityType"]
    for name, node in _nodes(cluster).items():
        spot = node["labels"]["eks.amazonaws.com/capacityType"]
        assert spot in (eks["spot"] | eks["on_demand"])
        assert (spot in eks["spot"]) == any(t["key"] == "spot" for t in node["taints"])
    # ... and the spot groups' taint is the builder's default spot_taint.
    key, value, effect = _parse_taint(JobSpec().spot_taint)
    spot_taints = [t for g in cluster["managedNodeGroups"] if g.get("spot") for t in g["taints"] if t["key"] == key]
    assert spot_taints and all((t["value"], t["effect"]) == (value, effect) for t in spot_taints)


@pytest.mark.parametrize("job,groups", [
    # Defaults: 8 GPUs + 32 EFA per pod, no spot toleration -> p5 on-demand only.
    (dict(), {"gpu-p5-ondemand"}),
    # --spot tolerates spot nodes; it does not require them.
    (dict(spot=True), {"gpu-p5-ondemand", "gpu-p5-spot"}),
    (dict(spot=True, node_selector={"eks.amazonaws.com/capacityType": "SPOT"}), {"gpu-p5-spot"}),
    (dict(spot=True, node_group="gpu-p5-spot"), {"gpu-p5-spot"}),
    (dict(node_selector={"eks.amazonaws.com/capacityType": "ON_DEMAND"}), {"gpu-p5-ondemand"}),
    # The pipeline's instance_type parameter (node.kubernetes.io/instance-type).
    (dict(spot=True, node_selector={INSTANCE_TYPE_LABEL: "p5.48xlarge"}), {"gpu-p5-ondemand", "gpu-p5-spot"}),
    # p4d: 4 EFA interfaces and ~1.1 TiB of memory, so the per-pod defaults must come down (cluster.yaml says so).
    (dict(spot=True, efa_per_node=4, cpu="90", memory="1000Gi", shm_size="256Gi",
          node_selector={INSTANCE_TYPE_LABEL: "p4d.24xlarge"}), {"gpu-p4d-spot"}),
    (dict(spot=True, node_selector={INSTANCE_TYPE_LABEL: "p4d.24xlarge"}), set()),
    # ... which instance_type does by itself: the pods are sized to the node from the builder's table.
    (dict(spot=True, instance_type="p4d.24xlarge"), {"gpu-p4d-spot"}),
    (dict(spot=True, instance_type="p5.48xlarge"), {"gpu-p5-ondemand", "gpu-p5-spot"}),
    # A spot node group without --spot: not tolerated, the pods would stay Pending.
    (dict(node_group="gpu-p5-spot"), set()),
    # A CPU job (no GPU tolerations) goes to the system group.
    (dict(gpus_per_node=0, nproc_per_node=2), {"system"}),
])
def test_builder_jobs_land_on_the_intended_node_groups(cluster, job, groups):
    assert _placeable(cluster, **job) == groups


def test_device_plugins_run_on_every_gpu_node_whatever_its_taints(cluster):
    docs = load_all(DEPLOY / "device-plugins" / "nvidia-device-plugin.yaml") + \
        load_all(DEPLOY / "device-plugins" / "efa-device-plugin.yaml")
    kustomization = load_all(DEPLOY / "device-plugins" / "kustomization.yaml")[0]
    assert kustomization["resources"] == ["nvidia-device-plugin.yaml", "efa-device-plugin.yaml"]
    nodes = _nodes(cluster)
    # eksctl installed these names; ours replace them (a DaemonSet's selector cannot change, so it must match).
    expected = {"nvidia-device-plugin-daemonset": "nvidia-device-plugin-ds",
                "aws-efa-k8s-device-plugin": "aws-efa-k8s-device-plugin"}
    for ds in docs:
        assert model_roundtrip_problems(ds) == []
        name = ds["metadata"]["name"]
        assert ds["metadata"]["namespace"] == "kube-system"
        assert ds["spec"]["selector"]["matchLabels"] == {"name": expected[name]}
        assert ds["spec"]["template"]["metadata"]["labels"]["name"] == expected[name]
        pod = ds["spec"]["template"]["spec"]
        image = pod["containers"][0]["image"]
        assert re.search(r":v\d+\.\d+\.\d+$", image), image          # pinned
        placed = {n for n, node in nodes.items() if not fits(pod, node)}
        gpu_groups = {g["name"] for g in cluster["managedNodeGroups"] if g.get("efaEnabled")}
        assert placed == gpu_groups, name
        for g in cluster["managedNodeGroups"]:
            for taint in g.get("taints", []):
                assert tolerates(pod["tolerations"], taint)


def test_irsa_service_accounts_match_rbac_and_the_policies(cluster):
    accounts = {(sa["metadata"]["namespace"], sa["metadata"]["name"]): sa for sa in cluster["iam"]["serviceAccounts"]}
    rbac = load_all(DEPLOY / "rbac.yaml")
    (binding,) = [d for d in rbac if d["kind"] == "RoleBinding"]
    runner = binding["subjects"][0]
    assert (runner["namespace"], runner["name"]) in accounts          # the launcher's account has the S3 role
    assert accounts[("kubeflow", "pipeline-runner")]["attachPolicyARNs"] == \
        ["arn:aws:iam::123456789012:policy/goodput-pipeline"]
    assert accounts[("kubeflow", "goodput-trainer")]["attachPolicyARNs"] == \
        ["arn:aws:iam::123456789012:policy/goodput-trainer"]
    for name in ("pipeline", "trainer", "fsx-link"):
        assert (DEPLOY / "iam" / f"{name}-policy.json").is_file()
    # The FSx CSI controller (dynamic provisioning) gets its role under the name the driver's manifests use.
    assert ("kube-system", "fsx-csi-controller-sa") in accounts


def test_rendering_refuses_stray_dollars_and_missing_values(tmp_path):
    t = tmp_path / "t.yaml"
    t.write_text("a: ${A}\nb: $B\n")
    with pytest.raises(AssertionError, match="outside"):
        render(t, A="1", B="2")
    t.write_text("a: ${A}\n")
    with pytest.raises(AssertionError, match="no value"):
        render(t)
