"""Build the Kubeflow ``PyTorchJob`` (kubeflow.org/v1) that runs the trainer on EKS under NVRx.

One pod per node: Master x1 + Worker x(nodes-1), or Worker x(nodes+hot_spares) with an ``elasticPolicy``
for an elastic job (``min_nodes`` < ``nodes``, NVRx up to 0.5) or one with hot spares (NVRx 0.6+). Every pod
runs ``ft_launcher`` (``trainer.launch.launcher_command``, built for the trainer image's NVRx release,
``nvrx_release``) with a c10d rendezvous on ``<name>-master-0:<port>`` (``<name>-worker-0`` without a
Master): the Service the Training Operator creates for replica 0, whose pod hostname matches, so that pod
hosts the store.

Everything is validated before a manifest exists: ``build_pytorchjob`` raises ``ValueError`` listing
every bad setting. The manifest is made from ``kubeflow.training`` models, never hand-written dicts::

    goodput render-job --nodes 2 --gpus-per-node 8 --image ECR/goodput:0.1.0 --spot | kubectl apply -f -
    goodput render-job --nodes 8 --hot-spares 1 --nvrx-release 0.7.0 --image ECR/goodput:0.1.0-nvrx0.7.0

This module imports neither torch nor kfp.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from components.train import peer_secret
from trainer import compat, layout
from trainer.config import coerce_value
from trainer.launch import LaunchConfig, launcher_command
from trainer.status_report import POD_NAME_ENV

__all__ = ["JobSpec", "build_pytorchjob", "job_manifest", "job_name_for", "label_value", "image_ref_problem",
           "INSTANCE_TYPES", "NodeShape", "node_allocatable", "node_requests", "quantity",
           "CONTAINER_NAME", "PORT_NAME", "RUN_ID_LABEL", "TASK_LABEL"]

API_VERSION = "kubeflow.org/v1"
KIND = "PyTorchJob"
# The Training Operator finds the master port by these names (MASTER_PORT, elastic rendezvous port).
CONTAINER_NAME = "pytorch"
HEALTH_VOLUME = "node-health"      # the node health daemon's socket directory (node_health_check_endpoint)
PORT_NAME = "pytorchjob-port"
RUN_ID_LABEL = "goodput.dev/kfp-run-id"
TASK_LABEL = "goodput.dev/kfp-task"
MANAGED_BY = {"app.kubernetes.io/managed-by": "goodput-pipelines", "app.kubernetes.io/component": "train"}

# Node labels that pin a capacity type (EKS managed node groups, Karpenter).
CAPACITY_LABELS = {
    "eks.amazonaws.com/capacityType": {"spot": {"SPOT"}, "on_demand": {"ON_DEMAND"}},
    "karpenter.sh/capacity-type": {"spot": {"spot"}, "on_demand": {"on-demand", "reserved"}},
}
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
# A p5.48xlarge has 8 H100 and 32 EFA interfaces; per-GPU shares below fit its allocatable.
EFA_PER_P5 = 32
CPU_PER_GPU, MEMORY_GIB_PER_GPU, SHM_GIB_PER_GPU = 20, 200, 64

# EFA + NCCL for p5 (aws-ofi-nccl in the image). A user's ``env`` overrides any of these.
NCCL_ENV = {
    "NCCL_DEBUG": "WARN",
    "NCCL_SOCKET_IFNAME": "^lo,docker,veth",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_PROTO": "simple",
}

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
# The uid/gid both images run as (images/*.Dockerfile): files on FSx stay readable and writable by every step.
RUN_AS = 10001


@dataclass(frozen=True)
class NodeShape:
    """An EC2 instance type as EKS sees it (EC2 documentation; max_pods from EKS's eni-max-pods)."""

    vcpu: int
    memory_gib: int
    gpus: int
    efa: int           # EFA interfaces the EFA device plugin advertises
    max_pods: int
    gpu: str


INSTANCE_TYPES = {
    "p5.48xlarge": NodeShape(192, 2048, 8, 32, 100, "H100 80GB"),
    "p5e.48xlarge": NodeShape(192, 2048, 8, 32, 100, "H200 141GB"),
    "p5en.48xlarge": NodeShape(192, 2048, 8, 16, 100, "H200 141GB"),
    "p4d.24xlarge": NodeShape(96, 1152, 8, 4, 737, "A100 40GB"),
    "p4de.24xlarge": NodeShape(96, 1152, 8, 4, 737, "A100 80GB"),
    **{f"g5.{size}": NodeShape(cpu, mem, gpus, efa, pods, "A10G 24GB") for size, cpu, mem, gpus, efa, pods in (
        ("xlarge", 4, 16, 1, 0, 58), ("2xlarge", 8, 32, 1, 0, 58), ("4xlarge", 16, 64, 1, 0, 234),
        ("8xlarge", 32, 128, 1, 1, 234), ("12xlarge", 48, 192, 4, 1, 737), ("16xlarge", 64, 256, 1, 1, 234),
        ("24xlarge", 96, 384, 4, 1, 737), ("48xlarge", 192, 768, 8, 1, 345))},
    **{f"g6.{size}": NodeShape(cpu, mem, gpus, efa, pods, "L4 24GB") for size, cpu, mem, gpus, efa, pods in (
        ("xlarge", 4, 16, 1, 0, 58), ("2xlarge", 8, 32, 1, 0, 58), ("4xlarge", 16, 64, 1, 0, 234),
        ("8xlarge", 32, 128, 1, 1, 234), ("12xlarge", 48, 192, 4, 1, 234), ("16xlarge", 64, 256, 1, 1, 737),
        ("24xlarge", 96, 384, 4, 1, 737), ("48xlarge", 192, 768, 8, 1, 737))},
    **{f"g6e.{size}": NodeShape(cpu, mem, gpus, efa, pods, "L40S 48GB") for size, cpu, mem, gpus, efa, pods in (
        ("xlarge", 4, 32, 1, 0, 58), ("2xlarge", 8, 64, 1, 0, 58), ("4xlarge", 16, 128, 1, 0, 234),
        ("8xlarge", 32, 256, 1, 1, 234), ("12xlarge", 48, 384, 4, 1, 234), ("16xlarge", 64, 512, 1, 1, 737),
        ("24xlarge", 96, 768, 4, 2, 737), ("48xlarge", 192, 1536, 8, 4, 737))},
}
# What every GPU node also runs (device plugins, FSx CSI, exporters, kube-proxy, VPC CNI), kept free: up to
# 2 vCPU and 8 GiB, at most an eighth of the CPUs and a tenth of the memory on small nodes.
DAEMONSET_CPU, DAEMONSET_MEMORY_GIB = 2, 8
# The kubelet's memory capacity is the kernel's MemTotal, below the nominal size (firmware, kernel, crash
# kernel): about 95-97% on these types; 92% keeps a margin.
MEMTOTAL_SHARE = 0.92


def node_allocatable(shape: NodeShape) -> tuple[int, int]:
    """(millicores, MiB) the kubelet leaves for pods: EKS AMI kube-reserved and the 100 MiB eviction threshold."""
    reserve, left = 0.0, shape.vcpu
    for share, cores in ((0.06, 1), (0.01, 1), (0.005, 2), (0.0025, shape.vcpu)):
        take = min(cores, left)
        reserve, left = reserve + share * take * 1000, left - take
    memory = int(shape.memory_gib * 1024 * MEMTOTAL_SHARE)
    return shape.vcpu * 1000 - math.ceil(reserve), memory - (255 + 11 * shape.max_pods) - 100


def node_requests(shape: NodeShape) -> dict[str, str]:
    """What one trainer pod requests on a whole node: allocatable minus the DaemonSets; /dev/shm a quarter."""
    cpu_m, mem_mib = node_allocatable(shape)
    cpu = (cpu_m - min(DAEMONSET_CPU * 1000, shape.vcpu * 1000 // 8)) // 1000
    memory = (mem_mib - min(DAEMONSET_MEMORY_GIB * 1024, shape.memory_gib * 1024 // 10)) // 1024
    return {"cpu": str(cpu), "memory": f"{memory}Gi", "shm": f"{memory // 4}Gi"}


RESTART_POLICIES = ("OnFailure", "ExitCode", "Always", "Never")
CLEAN_POD_POLICIES = ("Running", "All", "None")
# Kueue admits a whole job against its queue's quota and leaves placement to the default scheduler.
SCHEDULERS = {"": "", "volcano": "volcano", "scheduler-plugins": "scheduler-plugins-scheduler",
              "yunikorn": "yunikorn", "kueue": ""}
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Whole GPUs, or MIG slices as the device plugin's "mixed" strategy names them (nvidia.com/mig-3g.40gb).
GPU_RESOURCE_PATTERN = re.compile(r"^nvidia\.com/(gpu|mig-[1-7]g\.[0-9]+gb)$")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
# The Kubernetes resource.Quantity grammar, as in the CRD schema.
_QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
                       r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class JobSpec:
    """Everything the PyTorchJob is built from. Defaults suit p5.48xlarge nodes with FSx at /fsx."""

    name: str = _f("goodput-train", "job name: a DNS-1035 label; pods are <name>-master-0, <name>-worker-<i>")
    namespace: str = _f("", "namespace; empty = the launcher's own (or kubectl's current one)")
    image: str = _f("", "trainer image (torch with CUDA, nvidia-resiliency-ext, this package); required")
    image_pull_policy: str = _f("IfNotPresent", "Always, IfNotPresent or Never")
    trainer: dict = _f({}, "the trainer's settings, {section: {field: value}} (trainer.config; `python -m trainer "
                           "--help`); data.data and run.out default to paths on FSx")
    # Shape.
    nodes: int = _f(1, "nodes (pods) in the job, one pod per node")
    min_nodes: int = _f(0, "elastic: fewest nodes the job runs with (0 = fixed size = nodes; NVRx 0.4.1 and 0.5 "
                           "only: from 0.6 --nnodes MIN:MAX means hot spares)")
    hot_spares: int = _f(0, "nodes beyond `nodes` that stand by and take a failed node's place at the next in-job "
                            "restart (NVRx >= 0.6: --nnodes N:N+k, nodes+k pods under an elasticPolicy); 0 = none")
    nvlink_segment: int = _f(0, "hot spares by NVLink domain (--ft-segment, NVRx >= 0.6): nodes per segment, "
                                "for multi-node NVLink systems such as GB200 NVL72; 0 = each node on its own")
    gpus_per_node: int = _f(8, "GPUs (or MIG slices, gpu_resource) per pod; 0 = a CPU job")
    gpu_resource: str = _f(GPU_RESOURCE, "the GPU resource: nvidia.com/gpu, or a MIG slice such as "
                                         "nvidia.com/mig-3g.40gb (the device plugin's mixed strategy)")
    instance_type: str = _f("", "EC2 instance type of the nodes (nodeSelector node.kubernetes.io/instance-type); "
                                f"one of {', '.join(INSTANCE_TYPES)} also sizes EFA, CPU, memory and /dev/shm "
                                "to the node (explicit settings win)")
    nproc_per_node: int = _f(0, "trainer processes per pod; 0 = one per GPU (1 on CPU nodes)")
    efa_per_node: int = _f(-1, "EFA interfaces per pod (vpc.amazonaws.com/efa); -1 = the instance type's (32 "
                               "with whole GPUs and no known instance type), else 0")
    cpu: str = _f("", f"CPU request per pod; empty = {CPU_PER_GPU} per GPU (2 without GPUs)")
    memory: str = _f("", f"memory request = limit per pod; empty = {MEMORY_GIB_PER_GPU}Gi per GPU (8Gi without)")
    shm_size: str = _f("", f"size limit of /dev/shm (memory-backed, counts as memory); empty = "
                           f"{SHM_GIB_PER_GPU}Gi per GPU (2Gi without)")
    # Storage.
    pvc: str = _f("fsx-claim", "PersistentVolumeClaim of the FSx for Lustre file system")
    fsx_mount: str = _f("/fsx", "where the FSx claim is mounted in the pods")
    # Placement.
    node_group: str = _f("", "EKS node group (nodeSelector eks.amazonaws.com/nodegroup)")
    node_selector: dict = _f({}, "extra nodeSelector labels")
    spot: bool = _f(False, "tolerate spot nodes (spot_taint); a spot reclaim costs one job restart")
    spot_taint: str = _f("spot=true:NoSchedule", "the taint on spot nodes, key[=value]:effect")
    tolerations: list = _f([], "extra tolerations, as dicts (key, operator, value, effect)")
    priority_class: str = _f("", "PriorityClass of the pods and the gang")
    service_account: str = _f("", "service account of the pods (IRSA role for S3)")
    # Gang scheduling.
    scheduler: str = _f("", "gang scheduler: '' (none), volcano, scheduler-plugins or yunikorn (task groups); or "
                            "kueue: the job waits suspended in a Kueue LocalQueue (queue) until admitted",
                        choices=tuple(SCHEDULERS))
    scheduler_name: str = _f("", "schedulerName of the pods; empty = the gang scheduler's usual name")
    queue: str = _f("", "queue of the job: a Volcano queue, a YuniKorn queue (root.<name>) or a Kueue LocalQueue "
                        "in the job's namespace (deploy/kueue/ makes `goodput`)")
    # Run policy.
    restart_policy: str = _f("OnFailure", "pod restarts: OnFailure, ExitCode, Always or Never",
                             choices=RESTART_POLICIES)
    backoff_limit: int = _f(3, "pod restarts before the job fails (layer 3 of recovery)")
    active_deadline_s: int = _f(0, "job deadline in seconds, running time included (0 = none)")
    ttl_after_finished_s: int = _f(86400, "delete the finished job after this many seconds (-1 = keep)")
    clean_pod_policy: str = _f("Running", "pods deleted when the job finishes: Running, All or None",
                               choices=CLEAN_POD_POLICIES)
    termination_grace_s: int = _f(120, "pod grace after SIGTERM: covers ft_launcher's term timeout and "
                                       "the trainer's emergency checkpoint (--sigterm-grace-s)")
    master_port: int = _f(23456, "port of the c10d rendezvous on replica 0")
    metrics_port: int = _f(9500, "the trainer's Prometheus metrics on this port + local rank (its --metrics-port, "
                                 "declared as container ports metrics-<local rank> for the PodMonitor); 0 = off")
    # Container extras.
    env: dict = _f({}, "environment of the trainer (overrides the EFA/NCCL defaults)")
    labels: dict = _f({}, "extra labels on the job and its pods")
    run_id: str = _f("", "KFP run id (label on the job and pods)")
    task_name: str = _f("", "KFP task name (label on the job and pods)")
    # NVRx.
    nvrx_release: str = _f("", "NVRx release in the trainer image (its io.goodput.nvrx-release label): the launch "
                               f"command is built for it; empty = {compat.IMAGE_RELEASE}, what "
                               "images/trainer.Dockerfile installs by default")
    node_health_check_endpoint: str = _f("", "Unix socket of an nvhcd-compatible node health daemon on every node, "
                                             "in a directory of its own, e.g. /var/run/nvhcd/nvhcd.sock (NVRx >= "
                                             "0.6): ft_launcher asks it before each rendezvous and an unhealthy "
                                             "node leaves the job; the directory is mounted from the node")
    launch: LaunchConfig = field(default_factory=LaunchConfig, metadata={
        "help": "ft_launcher settings (max_restarts, rank-monitor timeouts); node/process counts and "
                "the rendezvous are set by the builder"})

    @classmethod
    def from_dict(cls, d: dict) -> "JobSpec":
        """A JobSpec from plain values (a KFP dict parameter); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown job settings {unknown}; known: {sorted(known)}")
        launch = d.get("launch") or {}
        if not isinstance(launch, LaunchConfig):
            fields = {f.name for f in dataclasses.fields(LaunchConfig)}
            bad = sorted(set(launch) - fields)
            if bad:
                raise ValueError(f"unknown launch settings {bad}; known: {sorted(fields)}")
            launch = LaunchConfig(**_coerced(LaunchConfig, launch))
        return cls(launch=launch, **_coerced(cls, {k: v for k, v in d.items() if k != "launch"}))

    # Derived values -------------------------------------------------------------------------

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nodes

    @property
    def pods(self) -> int:
        """Pods of the job: the training nodes and the hot spares."""
        return self.nodes + max(self.hot_spares, 0)

    @property
    def workers_only(self) -> bool:
        """Elastic or with hot spares: Worker replicas under an elasticPolicy, the store on worker 0."""
        return self.elastic or self.hot_spares > 0

    @property
    def procs(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1

    @property
    def shape(self) -> NodeShape | None:
        return INSTANCE_TYPES.get(self.instance_type)

    @property
    def mig(self) -> bool:
        return self.gpu_resource != GPU_RESOURCE

    @property
    def efa(self) -> int:
        if self.efa_per_node >= 0:
            return self.efa_per_node
        if not self.gpus_per_node or self.mig:      # a MIG slice is a small job: no EFA
            return 0
        return self.shape.efa if self.shape else EFA_PER_P5

    def resources(self) -> dict[str, str]:
        g = self.gpus_per_node
        whole = node_requests(self.shape) if self.shape and g and not self.mig else {}
        return {"cpu": self.cpu or whole.get("cpu") or str(CPU_PER_GPU * g if g else 2),
                "memory": self.memory or whole.get("memory") or (f"{MEMORY_GIB_PER_GPU * g}Gi" if g else "8Gi"),
                "shm": self.shm_size or whole.get("shm") or (f"{SHM_GIB_PER_GPU * g}Gi" if g else "2Gi")}

    @property
    def rdzv_host(self) -> str:
        return f"{self.name}-{'worker' if self.workers_only else 'master'}-0"

    @property
    def release(self) -> compat.Release:
        """The NVRx release the pods' launch command is for (``NVRxCompatError`` for one not checked)."""
        return compat.image_release(self.nvrx_release or None)

    def launcher_extras(self) -> compat.LauncherExtras:
        return compat.LauncherExtras(
            gpu=self.gpus_per_node > 0, min_nodes=self.min_nodes if self.elastic else 0, spare_nodes=self.hot_spares,
            segment=self.nvlink_segment, node_health_check_endpoint=self.node_health_check_endpoint)

    def launch_config(self) -> LaunchConfig:
        """The launcher settings for one pod: counts and the rendezvous filled in by the builder."""
        single = self.pods == 1
        return dataclasses.replace(
            self.launch, nproc_per_node=self.procs, nnodes=self.nodes,
            # One node needs no rendezvous service: a local store (--standalone) avoids waiting for DNS.
            rdzv_endpoint="" if single else f"{self.rdzv_host}:{self.master_port}",
            rdzv_id=self.name)

    def trainer_config(self):
        """The trainer's ``TrainConfig`` (not validated): ``trainer`` with the dataset and run directory defaulted
        to paths on FSx and the metrics port to ``metrics_port``; ``ValueError`` for a bad setting."""
        from trainer.config import TrainConfig, settings_values
        from trainer.data import DEFAULT_DATASET_NAME, default_dataset_version

        values = settings_values(self.trainer, "trainer")
        default_data = layout.dataset_dir(self.fsx_mount, DEFAULT_DATASET_NAME, default_dataset_version())
        values["data"].setdefault("data", str(default_data))
        values["run"].setdefault("out", str(layout.run_dir(self.fsx_mount, self.name)))
        values["metrics"].setdefault("metrics_port", self.metrics_port)
        return TrainConfig.from_values(values)

    def pod_command(self) -> list[str]:
        return launcher_command(self.launch_config(), self.trainer_config().argv(), release=self.release,
                                extras=self.launcher_extras())

    @property
    def health_check_dir(self) -> str:
        """The node's directory holding the health daemon's socket, mounted into the pods ("" without one)."""
        path = compat.uds_path(self.node_health_check_endpoint)
        return str(PurePosixPath(path).parent) if path else ""

    # Validation -----------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every bad setting, one line each (empty when all are good)."""
        p: list[str] = []
        self._check_shape(p)
        self._check_names(p)
        self._check_placement(p)
        self._check_policies(p)
        self._check_trainer(p)
        self._check_nvrx(p)
        return p

    def validate(self) -> "JobSpec":
        """Raise ValueError listing every bad setting; return self when all are good."""
        p = self.problems()
        if len(p) == 1:
            raise ValueError(f"invalid PyTorchJob settings: {p[0]}")
        if p:
            raise ValueError("invalid PyTorchJob settings:\n  " + "\n  ".join(p))
        return self

    def _check_shape(self, p: list[str]) -> None:
        if self.nodes < 1:
            p.append(f"nodes must be at least 1, got {self.nodes}")
        if self.min_nodes < 0 or self.min_nodes > max(self.nodes, 0):
            p.append(f"min_nodes must be in [0, nodes={self.nodes}], got {self.min_nodes}")
        if self.gpus_per_node < 0:
            p.append(f"gpus_per_node must not be negative, got {self.gpus_per_node}")
        if not self.image.strip():
            what = f"{self.gpus_per_node} GPUs per node" if self.gpus_per_node > 0 else "the pods"
            p.append(f"an image is required for {what}: the trainer image (torch, nvidia-resiliency-ext, "
                     "goodput-pipelines), e.g. --image <account>.dkr.ecr.<region>.amazonaws.com/goodput:0.1.0")
        elif image_ref_problem(self.image):
            p.append(f"image {image_ref_problem(self.image)}")
        if self.image_pull_policy not in ("Always", "IfNotPresent", "Never"):
            p.append(f"image_pull_policy must be Always, IfNotPresent or Never, got {self.image_pull_policy!r}")
        if self.nproc_per_node < 0:
            p.append(f"nproc_per_node must not be negative, got {self.nproc_per_node}")
        elif self.gpus_per_node > 0 and self.nproc_per_node > self.gpus_per_node:
            p.append(f"nproc_per_node ({self.nproc_per_node}) exceeds gpus_per_node ({self.gpus_per_node}): "
                     "one process per GPU at most")
        if self.efa_per_node < -1:
            p.append(f"efa_per_node must be -1 (auto) or at least 0, got {self.efa_per_node}")
        elif self.efa > 0 and self.gpus_per_node == 0:
            p.append(f"efa_per_node={self.efa} without GPUs: EFA is for GPU node groups (set it to 0)")
        for key, value in (("cpu", self.cpu), ("memory", self.memory), ("shm_size", self.shm_size)):
            if value and (not _QUANTITY.match(value) or value.startswith("-") or quantity(value) <= 0):
                p.append(f"{key} {value!r} is not a Kubernetes quantity above 0 (e.g. 96, 500m, 512Gi)")
        if not GPU_RESOURCE_PATTERN.match(self.gpu_resource):
            p.append(f"gpu_resource {self.gpu_resource!r} must be nvidia.com/gpu or a MIG slice like "
                     "nvidia.com/mig-3g.40gb")
        if self.instance_type and not _LABEL_NAME.match(self.instance_type):
            p.append(f"instance_type {self.instance_type!r} is not an EC2 instance type name")
        self._check_fits(p)

    def _check_fits(self, p: list[str]) -> None:
        """The pod's requests fit one node of ``instance_type`` (when the type is in the table)."""
        shape = self.shape
        if shape is None:
            return
        if not self.mig and self.gpus_per_node > shape.gpus:
            p.append(f"gpus_per_node={self.gpus_per_node}, but {self.instance_type} has {shape.gpus} GPUs")
        if self.efa > shape.efa:
            p.append(f"efa_per_node={self.efa}, but {self.instance_type} has {shape.efa} EFA interfaces")
        try:
            res = self.resources()
            cpu, mem, shm = quantity(res["cpu"]), quantity(res["memory"]), quantity(res["shm"])
        except ValueError:
            return                          # reported above
        cpu_m, mem_mib = node_allocatable(shape)
        if cpu * 1000 > cpu_m:
            p.append(f"cpu {res['cpu']} exceeds what {self.instance_type} has for pods ({cpu_m / 1000:g})")
        if mem > mem_mib * 2 ** 20:
            p.append(f"memory {res['memory']} exceeds what {self.instance_type} has for pods ({mem_mib // 1024}Gi)")
        if shm > mem:
            p.append(f"shm_size {res['shm']} exceeds the pod's memory {res['memory']} (/dev/shm counts against it)")

    def _check_names(self, p: list[str]) -> None:
        # The operator makes a Service per replica named like the pod, so the name must be a DNS-1035
        # label and still fit 63 characters with the longest replica suffix.
        last_worker = self.pods - 1 if self.workers_only else self.pods - 2
        longest = f"-worker-{last_worker}" if last_worker >= 10 else "-master-0"
        if not _DNS1035.match(self.name):
            p.append(f"name {self.name!r} is not a DNS-1035 label (lowercase letters, digits and '-', "
                     "starting with a letter, ending with a letter or digit)")
        elif len(self.name) + len(longest) > 63:
            p.append(f"name {self.name!r} is too long: pod and service names like {self.name}{longest} must fit "
                     f"63 characters (at most {63 - len(longest)} for the name)")
        if self.namespace and (not _DNS1123_LABEL.match(self.namespace) or len(self.namespace) > 63):
            p.append(f"namespace {self.namespace!r} is not a DNS-1123 label")
        for key, value in (("pvc", self.pvc), ("priority_class", self.priority_class),
                           ("service_account", self.service_account)):
            if value and (not _DNS1123_SUBDOMAIN.match(value) or len(value) > 253):
                p.append(f"{key} {value!r} is not a DNS-1123 subdomain")
        if not self.pvc:
            p.append("pvc is required: checkpoints and summary.json must outlive the pods (the FSx claim)")
        if not self.fsx_mount.startswith("/") or self.fsx_mount.rstrip("/") in ("", "/dev", "/dev/shm"):
            p.append(f"fsx_mount must be an absolute path other than / and /dev, got {self.fsx_mount!r}")
        for what, mapping in (("label", self.labels), ("node_selector", self.node_selector)):
            for k, v in mapping.items():
                err = _label_problem(str(k), str(v))
                if err:
                    p.append(f"{what} {k}={v}: {err}")
        for k in self.env:
            if not _ENV_NAME.match(str(k)):
                p.append(f"env name {k!r} is not a valid environment variable name")
            if str(k) == peer_secret.ENV:
                p.append(f"env {k}: set by the launcher from the job's Secret {peer_secret.secret_name(self.name)}")
        if not 1024 <= self.master_port <= 65535:
            p.append(f"master_port must be in [1024, 65535], got {self.master_port}")

    def _check_placement(self, p: list[str]) -> None:
        try:
            _parse_taint(self.spot_taint)
        except ValueError as e:
            p.append(f"spot_taint: {e}")
        for key, kinds in CAPACITY_LABELS.items():
            value = self.node_selector.get(key)
            if value is None:
                continue
            if self.spot and value in kinds["on_demand"]:
                p.append(f"spot is set, but node_selector {key}={value} allows only on-demand nodes: "
                         "drop --spot or the on-demand selector")
            if not self.spot and value in kinds["spot"]:
                p.append(f"node_selector {key}={value} selects spot nodes, but spot is not set: the pods "
                         "would not tolerate the spot taint (add --spot)")
        for t in self.tolerations:
            if not isinstance(t, dict) or set(t) - {"key", "operator", "value", "effect", "tolerationSeconds"}:
                p.append(f"toleration {t!r}: expected a dict with key, operator, value, effect")
            elif t.get("effect") and t["effect"] not in TAINT_EFFECTS:
                p.append(f"toleration {t!r}: effect must be one of {TAINT_EFFECTS}")
        if self.scheduler not in SCHEDULERS:
            p.append(f"scheduler must be one of {sorted(SCHEDULERS)}, got {self.scheduler!r}")
        if self.queue and self.scheduler not in ("volcano", "yunikorn", "kueue"):
            p.append(f"queue {self.queue!r} needs a scheduler with queues: set scheduler=volcano, yunikorn or kueue")
        if self.scheduler == "kueue" and (not _DNS1123_SUBDOMAIN.match(self.queue) or _label_problem(
                KUEUE_QUEUE_LABEL, self.queue)):
            p.append(f"scheduler=kueue needs queue, the name of a LocalQueue in the job's namespace (e.g. goodput, "
                     f"from deploy/kueue/), got {self.queue!r}")
        if self.queue and self.scheduler == "yunikorn" and not re.match(r"^root(\.[A-Za-z0-9_-]+)*$", self.queue):
            p.append(f"queue {self.queue!r} is not a YuniKorn queue path (root.<name>)")
        if self.scheduler_name and not _DNS1123_SUBDOMAIN.match(self.scheduler_name):
            p.append(f"scheduler_name {self.scheduler_name!r} is not a DNS-1123 subdomain")

    def _check_policies(self, p: list[str]) -> None:
        if self.restart_policy not in RESTART_POLICIES:
            p.append(f"restart_policy must be one of {RESTART_POLICIES}, got {self.restart_policy!r}")
        if self.clean_pod_policy not in CLEAN_POD_POLICIES:
            p.append(f"clean_pod_policy must be one of {CLEAN_POD_POLICIES}, got {self.clean_pod_policy!r}")
        if self.backoff_limit < 0:
            p.append(f"backoff_limit must not be negative, got {self.backoff_limit}")
        if self.active_deadline_s < 0:
            p.append(f"active_deadline_s must not be negative (0 = none), got {self.active_deadline_s}")
        if self.ttl_after_finished_s < -1:
            p.append(f"ttl_after_finished_s must be -1 (keep) or at least 0, got {self.ttl_after_finished_s}")
        try:
            dataclasses.replace(self.launch, nnodes=1, nproc_per_node=1, rdzv_endpoint="").validate()
        except ValueError as e:
            p.append(f"launch: {e}")
        # SIGTERM reaches ft_launcher first; it gives the workers term_timeout_s to write the emergency
        # checkpoint before SIGKILL. The pod's grace must cover that, or the kubelet kills it mid-write.
        if self.termination_grace_s <= self.launch.term_timeout_s:
            p.append(f"termination_grace_s ({self.termination_grace_s}) must exceed ft_launcher's term timeout "
                     f"({self.launch.term_timeout_s:g} s) so the emergency checkpoint can finish")

    def _check_trainer(self, p: list[str]) -> None:
        try:
            cfg = self.trainer_config().validate()
        except ValueError as e:
            p.append(str(e))
            return
        first = cfg.metrics.metrics_port
        if first and (first <= self.master_port < first + self.procs or first + self.procs - 1 > 65535):
            p.append(f"metrics ports {first}..{first + self.procs - 1} (one per local rank) must stay below 65536 "
                     f"and clear of master_port {self.master_port}")
        grace = cfg.checkpoint.sigterm_grace_s
        if grace >= self.termination_grace_s or grace > self.launch.term_timeout_s:
            p.append(f"the trainer's --sigterm-grace-s ({grace:g} s) must stay below ft_launcher's term timeout "
                     f"({self.launch.term_timeout_s:g} s) and termination_grace_s ({self.termination_grace_s} s)")
        # After SIGTERM a rank commits its checkpoint, then waits for the S3 mirror to upload it; both must end
        # before ft_launcher's SIGKILL.
        drain = cfg.checkpoint.mirror_drain_s
        if cfg.checkpoint.mirror and grace + drain > self.launch.term_timeout_s:
            p.append(f"with --ckpt-mirror, --sigterm-grace-s ({grace:g} s) + --ckpt-mirror-drain-s ({drain:g} s) "
                     f"must fit in ft_launcher's term timeout ({self.launch.term_timeout_s:g} s)")
        mount = PurePosixPath(self.fsx_mount)
        for flag, value in (("--out", cfg.run.out), ("--data", cfg.data.data)):
            path = PurePosixPath(value)
            if not path.is_absolute() or mount not in (path, *path.parents):
                p.append(f"trainer {flag} {value} is not on the FSx mount {self.fsx_mount}: the pods would "
                         "not share it and it would vanish with them")

    def _check_nvrx(self, p: list[str]) -> None:
        """The launch command can be built for the image's NVRx release, with what that release offers."""
        try:
            rel = self.release
        except compat.NVRxCompatError as e:
            p.append(f"nvrx_release: {e}")
            return
        if self.hot_spares < 0 or self.nvlink_segment < 0:
            p.append(f"hot_spares and nvlink_segment must not be negative, got {self.hot_spares} and "
                     f"{self.nvlink_segment}")
            return
        try:
            if self.nodes >= 1 and self.procs >= 1:       # else reported by _check_shape
                compat.launcher_args(self.launch_config(), rel, self.launcher_extras())
        except ValueError as e:
            p.append(f"NVRx {rel.version} (nvrx_release): {e}")
        folder = self.health_check_dir
        if folder and (folder in _SHARED_HOST_DIRS or PurePosixPath(folder) in (
                PurePosixPath(self.fsx_mount), PurePosixPath("/dev/shm"))):
            p.append(f"node_health_check_endpoint {self.node_health_check_endpoint}: the pods mount {folder} from "
                     "the node, so the socket must be in a directory of its own, e.g. /var/run/nvhcd/nvhcd.sock")


# Host directories a pod must not mount for a health daemon's socket: they hold far more than the socket.
_SHARED_HOST_DIRS = {"/", "/run", "/var/run", "/var", "/tmp", "/var/tmp", "/dev", "/etc", "/proc", "/sys", "/usr",
                     "/home", "/root", "/var/lib", "/opt", "/mnt"}


def _coerced(cls, d: dict) -> dict:
    """Values from KFP (a dict parameter is a protobuf Struct: every number a float) as the field types of ``cls``
    (``trainer.config.coerce_value``); a value that does not fit is an error naming the field."""
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    return {k: coerce_value(types[k], v, f"job setting {k}") if types[k] in ("int", "float", "bool", "str") else v
            for k, v in d.items()}


def _label_problem(key: str, value: str) -> str:
    prefix, _, name = key.rpartition("/")
    if prefix and (not _DNS1123_SUBDOMAIN.match(prefix) or len(prefix) > 253):
        return f"key prefix {prefix!r} is not a DNS-1123 subdomain"
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        return f"key name {name!r} is not a valid label name"
    if len(value) > 63 or not _LABEL_NAME.match(value):
        return f"value {value!r} is not a valid label value (63 characters of [A-Za-z0-9-_.])"
    return ""


def _parse_taint(taint: str) -> tuple[str, str | None, str]:
    head, sep, effect = taint.rpartition(":")
    if not sep or effect not in TAINT_EFFECTS:
        raise ValueError(f"{taint!r} is not key[=value]:effect with effect in {TAINT_EFFECTS}")
    key, eq, value = head.partition("=")
    if _label_problem(key, value if eq else ""):
        raise ValueError(f"{taint!r}: {_label_problem(key, value if eq else '')}")
    return key, (value if eq else None), effect


# The distribution/reference grammar: [host[:port]/]path[:tag][@sha256:digest], path components lowercase.
_HOST = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_PATH_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(rf"^(?:(?P<host>{_HOST})/)?(?P<path>{_PATH_PART}(?:/{_PATH_PART})*)"
                    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


def image_ref_problem(ref: str, *, pinned: bool = False) -> str:
    """Why ``ref`` is not a usable image reference ('' if it is); ``pinned`` also wants a tag or digest."""
    m = _IMAGE.match(ref or "")
    if not m or len(ref) > 255:
        return (f"{ref!r} is not an image reference (registry/repository:tag or @sha256:digest, lowercase "
                "repository), e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/goodput-trainer:0.1.0")
    if pinned and not (m.group("tag") or m.group("digest")):
        return f"image {ref!r} has no tag or digest: pin one (e.g. {ref}:0.1.0), or every node may pull another"
    return ""


def label_value(text: str) -> str:
    """``text`` as a valid label value: invalid characters become '-', at most 63 characters."""
    v = re.sub(r"[^A-Za-z0-9._-]", "-", str(text))[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", v)


def job_name_for(run_id: str, task_name: str, prefix: str = "gp") -> str:
    """Deterministic job name for a KFP run and task, so a restarted launcher finds its job.

    ``gp-<task>-<hash>``: readable, unique per (run, task), short enough (at most 40 characters) for
    replica suffixes like ``-worker-1023``.
    """
    if not run_id or not task_name:
        raise ValueError("a job name needs both the KFP run id and the task name")
    digest = hashlib.sha256(f"{run_id}/{task_name}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9]+", "-", task_name.lower()).strip("-")[:40 - len(prefix) - 12].strip("-")
    return "-".join(x for x in (prefix, slug, digest) if x)


# Building ---------------------------------------------------------------------------------------

def build_pytorchjob(spec: JobSpec):
    """The validated job as a ``kubeflow.training`` ``KubeflowOrgV1PyTorchJob``."""
    from kubeflow.training import models as m

    spec.validate()
    res = spec.resources()
    labels = {**MANAGED_BY, "goodput.dev/job": spec.name, **_kfp_labels(spec),
              **{str(k): str(v) for k, v in spec.labels.items()}}
    requests = {"cpu": res["cpu"], "memory": res["memory"]}
    limits = {"memory": res["memory"]}
    for resource, count in ((spec.gpu_resource, spec.gpus_per_node), (EFA_RESOURCE, spec.efa)):
        if count:
            requests[resource] = limits[resource] = str(count)
    env = {**(NCCL_ENV if spec.gpus_per_node else {}), **(EFA_ENV if spec.efa else {}),
           **{str(k): str(v) for k, v in spec.env.items()}}
    container = m.V1Container(
        name=CONTAINER_NAME,
        image=spec.image,
        image_pull_policy=spec.image_pull_policy,
        command=spec.pod_command(),
        # The peer secret is the job's own (the launcher makes it): ranks of other jobs cannot talk to these.
        env=[m.V1EnvVar(name=k, value=v) for k, v in env.items()] + [m.V1EnvVar(
            name=peer_secret.ENV, value_from=m.V1EnvVarSource(secret_key_ref=m.V1SecretKeySelector(
                name=peer_secret.secret_name(spec.name), key=peer_secret.KEY)))] + [
            # Rank 0 annotates its own pod with its progress (trainer/status_report.py); a JobSet pod's
            # hostname is not its name.
            m.V1EnvVar(name=POD_NAME_ENV, value_from=m.V1EnvVarSource(
                field_ref=m.V1ObjectFieldSelector(field_path="metadata.name")))],
        ports=[m.V1ContainerPort(name=PORT_NAME, container_port=spec.master_port, protocol="TCP"),
               *_metrics_ports(spec, m)],
        resources=m.V1ResourceRequirements(requests=requests, limits=limits),
        volume_mounts=[m.V1VolumeMount(name="fsx", mount_path=spec.fsx_mount),
                       m.V1VolumeMount(name="dshm", mount_path="/dev/shm"),
                       *([m.V1VolumeMount(name=HEALTH_VOLUME, mount_path=spec.health_check_dir, read_only=True)]
                         if spec.health_check_dir else [])],
    )
    volumes = [
        m.V1Volume(name="fsx", persistent_volume_claim=m.V1PersistentVolumeClaimVolumeSource(claim_name=spec.pvc)),
        # NCCL and the checkpoint staging copy live in shared memory; the default 64 MiB is far too small.
        m.V1Volume(name="dshm", empty_dir=m.V1EmptyDirVolumeSource(medium="Memory", size_limit=res["shm"])),
    ]
    if spec.health_check_dir:
        # The node's health daemon socket. DirectoryOrCreate: a node without the daemon still runs the pod, and
        # NVRx skips a check whose socket is missing when ft_launcher starts.
        volumes.append(m.V1Volume(name=HEALTH_VOLUME, host_path=m.V1HostPathVolumeSource(
            path=spec.health_check_dir, type="DirectoryOrCreate")))
    node_selector = {**({"eks.amazonaws.com/nodegroup": spec.node_group} if spec.node_group else {}),
                     **({INSTANCE_TYPE_LABEL: spec.instance_type} if spec.instance_type else {}),
                     **{str(k): str(v) for k, v in spec.node_selector.items()}}
    pod = m.V1PodSpec(
        containers=[container],
        volumes=volumes,
        node_selector=node_selector or None,
        tolerations=_tolerations(spec, m) or None,
        priority_class_name=spec.priority_class or None,
        service_account_name=spec.service_account or None,
        scheduler_name=(spec.scheduler_name or SCHEDULERS.get(spec.scheduler) or None),
        termination_grace_period_seconds=spec.termination_grace_s,
        # The images' user; fsGroup makes volumes that honour it (EBS, emptyDir) writable to it. FSx for
        # Lustre does not: deploy/fsx/init-job.yaml gives its top directories to this uid once.
        security_context=m.V1PodSecurityContext(run_as_user=RUN_AS, run_as_group=RUN_AS, run_as_non_root=True,
                                                fs_group=RUN_AS, fs_group_change_policy="OnRootMismatch"),
    )
    pod_labels, annotations = dict(labels), None
    if spec.scheduler == "yunikorn":
        pod_labels, annotations = _yunikorn_gang(spec, labels, requests, node_selector, pod.tolerations)
    template = m.V1PodTemplateSpec(metadata=m.V1ObjectMeta(labels=pod_labels, annotations=annotations), spec=pod)

    def replica(count: int):
        return m.KubeflowOrgV1ReplicaSpec(replicas=count, restart_policy=spec.restart_policy, template=template)

    replicas = ({"Worker": replica(spec.pods)} if spec.workers_only else
                {"Master": replica(1), **({"Worker": replica(spec.nodes - 1)} if spec.nodes > 1 else {})})
    elastic = None
    if spec.workers_only:
        # Elastic (NVRx up to 0.5): min..max nodes train. Hot spares (0.6+): `nodes` train, the rest stand by;
        # either way ft_launcher's --nnodes says MIN:MAX, as the operator's PET_NNODES does.
        elastic = m.KubeflowOrgV1ElasticPolicy(
            # Not nProcPerNode: deprecated, and the webhook rejects it next to spec.nprocPerNode.
            min_replicas=spec.min_nodes if spec.elastic else spec.nodes, max_replicas=spec.pods,
            max_restarts=spec.launch.max_restarts, rdzv_backend="c10d", rdzv_port=spec.master_port,
            rdzv_id=spec.name)
    gang = None
    if spec.scheduler in ("volcano", "scheduler-plugins"):     # the operator makes their PodGroup
        gang = m.KubeflowOrgV1SchedulingPolicy(
            min_available=spec.min_nodes if spec.elastic else spec.nodes,
            queue=spec.queue or None, priority_class=spec.priority_class or None)
    run_policy = m.KubeflowOrgV1RunPolicy(
        backoff_limit=spec.backoff_limit,
        active_deadline_seconds=spec.active_deadline_s or None,
        ttl_seconds_after_finished=None if spec.ttl_after_finished_s < 0 else spec.ttl_after_finished_s,
        clean_pod_policy=spec.clean_pod_policy,
        scheduling_policy=gang,
        # Kueue unsuspends the job when it admits it (its webhook would suspend one created running).
        suspend=True if spec.scheduler == "kueue" else None,
    )
    return m.KubeflowOrgV1PyTorchJob(
        api_version=API_VERSION, kind=KIND,
        metadata=m.V1ObjectMeta(name=spec.name, namespace=spec.namespace or None,
                                labels={**labels, **queue_label(spec)}),
        spec=m.KubeflowOrgV1PyTorchJobSpec(
            pytorch_replica_specs=replicas, run_policy=run_policy, elastic_policy=elastic,
            nproc_per_node=str(spec.procs)),
    )


def job_manifest(spec_or_job) -> dict:
    """The job as plain JSON-able data (camelCase keys, no nulls), ready for the API or YAML."""
    from kubernetes.client import ApiClient

    job = build_pytorchjob(spec_or_job) if isinstance(spec_or_job, JobSpec) else spec_or_job
    return ApiClient().sanitize_for_serialization(job)


def queue_label(spec: JobSpec) -> dict[str, str]:
    """The job's (not its pods') Kueue label: pods labelled so would be queued again by Kueue's pod integration."""
    return {KUEUE_QUEUE_LABEL: spec.queue} if spec.scheduler == "kueue" else {}


def _kfp_labels(spec: JobSpec) -> dict[str, str]:
    out = {}
    if spec.run_id:
        out[RUN_ID_LABEL] = label_value(spec.run_id)
    if spec.task_name:
        out[TASK_LABEL] = label_value(spec.task_name)
    return {k: v for k, v in out.items() if v}


def _yunikorn_gang(spec: JobSpec, labels: dict, requests: dict, node_selector: dict, tolerations) -> tuple:
    """YuniKorn gang scheduling by pod annotations (the operator has no YuniKorn PodGroup): one task group
    of every pod, so YuniKorn reserves all nodes with placeholders before any trainer pod starts."""
    from kubernetes.client import ApiClient

    group = {"name": "trainers", "minMember": spec.min_nodes if spec.elastic else spec.nodes,
             "minResource": dict(requests), "nodeSelector": dict(node_selector),
             "tolerations": ApiClient().sanitize_for_serialization(tolerations or [])}
    pod_labels = {**labels, "applicationId": spec.name, **({"queue": spec.queue} if spec.queue else {})}
    annotations = {"yunikorn.apache.org/task-group-name": "trainers",
                   "yunikorn.apache.org/task-groups": json.dumps([group], sort_keys=True),
                   # Placeholders that cannot all be placed give up after 15 minutes; the job then fails.
                   "yunikorn.apache.org/schedulingPolicyParameters":
                       "placeholderTimeoutInSeconds=900 gangSchedulingStyle=Hard"}
    return pod_labels, annotations


_SUFFIX = {"": 1, "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18,
           "m": 10 ** -3, "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "Pi": 2 ** 50, "Ei": 2 ** 60}


def quantity(text: str) -> float:
    """A Kubernetes quantity as a number (cores, bytes): "500m" -> 0.5, "2Gi" -> 2147483648."""
    m = re.match(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$", str(text).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def _tolerations(spec: JobSpec, m) -> list:
    out = []
    if spec.gpus_per_node:
        out.append(m.V1Toleration(key=GPU_RESOURCE, operator="Exists", effect="NoSchedule"))
    if spec.efa:
        out.append(m.V1Toleration(key=EFA_RESOURCE, operator="Exists", effect="NoSchedule"))
    if spec.spot:
        key, value, effect = _parse_taint(spec.spot_taint)
        out.append(m.V1Toleration(key=key, operator="Equal" if value is not None else "Exists", value=value,
                                  effect=effect))
    for t in spec.tolerations:
        out.append(m.V1Toleration(key=t.get("key"), operator=t.get("operator"), value=t.get("value"),
                                  effect=t.get("effect"),
                                  toleration_seconds=None if t.get("tolerationSeconds") is None
                                  else int(t["tolerationSeconds"])))
    return out


def _metrics_ports(spec: JobSpec, m) -> list:
    """``metrics-<local rank>`` on the trainer's --metrics-port + local rank: what the PodMonitor scrapes."""
    first = spec.trainer_config().metrics.metrics_port
    if not first:
        return []
    return [m.V1ContainerPort(name=f"metrics-{i}", container_port=first + i, protocol="TCP")
            for i in range(spec.procs)]
