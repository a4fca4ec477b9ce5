"""Build the Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1) and the ``goodput-nvrx``
``ClusterTrainingRuntime`` it references.

The runtime holds what a cluster admin decides once: the trainer image, the NVRx command (``ft_launcher``
-> ``python -m trainer``, from ``trainer.launch.launcher_command`` like the PyTorchJob's pods), the FSx
claim, a memory-backed /dev/shm, GPU and EFA resources with their tolerations, the gang scheduler
(``podGroupPolicy``) and the restart policy. A TrainJob holds one run: nodes, processes per node, the
trainer's arguments, resources, node selection (on-demand or spot), labels. Both are built from the
same ``JobSpec`` as the PyTorchJob, so a run's pods are the same whichever backend starts them::

    from components.train.pytorchjob import JobSpec
    from components.train.trainjob import RuntimeSpec, runtime_manifest, trainjob_manifest
    runtime_manifest(RuntimeSpec())                     # deploy/trainer-v2/runtime/goodput-nvrx.yaml
    trainjob_manifest(JobSpec(image=IMG, nodes=4, spot=True))

Rendezvous: the Trainer's torch plugin puts ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_MASTER_ADDR`` (``<job>-node-0-0.<job>``, the first pod behind the JobSet's headless Service) and
``PET_MASTER_PORT`` (29500) into the ``node`` container; the runtime's command reads them through
Kubernetes' ``$(VAR)`` expansion, so one runtime serves every job.

Restarts (layer 3) in Trainer v2 terms. Pods never restart in place (``restartPolicy: Never``, which pod
failure policies need) and each node's Job fails on its first failed pod (``backoffLimit: 0``); the
JobSet's failure policy then decides by why the pod failed (``FAILURE_RULES``):

- the pod was disrupted (condition ``DisruptionTarget``: spot reclaim, eviction, preemption, a node
  drained or gone): the node went away, not the program, so recreate the gang without counting it;
- exit 2 (a usage error: ft_launcher's or the trainer's argument parser), 93 (NVRx decided the job must
  not be restarted: no progress across restarts) or 126/127 (the image cannot run the command): the
  program or its settings are wrong and every restart would fail the same way on a gang of GPU nodes,
  so fail now;
- exit 128 (the container could not start, e.g. the NVIDIA container hook on a node whose GPU or driver
  is broken) and any other failure (1: ft_launcher gave up after ``max_restarts`` in-job restarts; 137:
  killed): recreate the gang on new pods, counted against ``backoff_limit`` (``failurePolicy.maxRestarts``).

The command is built for the NVRx release of the image (``nvrx_release``): the runtime's for the runtime's
image, and a TrainJob whose release, launch settings or devices make another command carries its own.
Trainer v2.3 has no elastic training (``--nnodes MIN:MAX``), and a node command reads its node count from
``$(PET_NNODES)``: ``min_nodes``, ``hot_spares`` and ``nvlink_segment`` are refused here and need the
PyTorchJob backend. The node health-check endpoint is the runtime's (its pods mount the socket's directory).
Everything is validated before a manifest exists: the builders raise ``ValueError`` listing every bad
setting. This module imports neither torch nor kfp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from components.train import peer_secret
from components.train.parameters import TRAINER_IMAGE
from components.train.pytorchjob import (
    CONTAINER_NAME, PORT_NAME, MANAGED_BY, JobSpec, _coerced, _DNS1123_SUBDOMAIN, job_manifest, queue_label)
from trainer.launch import launcher_command

__all__ = ["RuntimeSpec", "build_runtime", "build_trainjob", "runtime_manifest", "trainjob_manifest",
           "trainer_command", "node_command", "FAILURE_RULES", "MASTER_POD_SELECTOR", "RUNTIME_NAME"]

API_VERSION = "trainer.kubeflow.org/v1alpha1"
TRAINJOB_KIND = "TrainJob"
RUNTIME_KIND = "ClusterTrainingRuntime"
RUNTIME_NAME = "goodput-nvrx"
# The Trainer finds the training nodes by these names (constants.Node, LabelTrainJobAncestor in v2.3.0).
NODE = "node"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
FRAMEWORK_LABEL = "trainer.kubeflow.org/framework"
# What the torch plugin injects; a TrainJob that sets any of them is refused by the Trainer's webhook.
PET_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
RDZV_PORT = 29500                  # PET_MASTER_PORT: fixed by the Trainer (constants.ContainerTrainerPort)
JOB_NAME_ENV = "GOODPUT_JOB_NAME"  # the rendezvous id, from the JobSet's (= the TrainJob's) name
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOBSET_RJOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
# The pod that hosts the c10d store and whose log the supervisor streams: node 0 of the one node Job.
MASTER_POD_SELECTOR = f"{JOBSET_RJOB_LABEL}={NODE},{COMPLETION_INDEX_LABEL}=0"
PATCH_MANAGER = "goodput.dev/train"
VOLCANO_QUEUE_ANNOTATION = "scheduling.volcano.sh/queue-name"


@dataclass(frozen=True)
class FailureRule:
    """One pod failure policy rule of the node Job and the JobSet rule that acts on it."""

    name: str                      # the JobSet rule's name
    action: str                    # the JobSet's action
    exit_codes: tuple[int, ...] = ()
    disruption: bool = False       # matches the pod condition DisruptionTarget instead of exit codes


# Order matters: the Job controller takes the first match and writes its index into the Job's failure
# message ("... matching FailJob rule at index N"), which is how the JobSet rule finds its case.
FAILURE_RULES = (
    FailureRule("NodeGone", "RestartJobSetAndIgnoreMaxRestarts", disruption=True),
    FailureRule("ProgramIsWrong", "FailJobSet", exit_codes=(2, 93, 126, 127)),
    FailureRule("NodeIsBad", "RestartJobSet", exit_codes=(128,)),
)


def _jobspec_default(name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(JobSpec)}[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _default_pods() -> JobSpec:
    return JobSpec(name=RUNTIME_NAME, image=TRAINER_IMAGE, scheduler="volcano")


@dataclass
class RuntimeSpec:
    """The ClusterTrainingRuntime: pod settings shared by every TrainJob that references it."""

    name: str = field(default=RUNTIME_NAME, metadata={
        "help": "runtime name (cluster-scoped); a TrainJob's runtimeRef"})
    pods: JobSpec = field(default_factory=_default_pods, metadata={
        "help": "the pods' defaults as JobSpec settings: image, image_pull_policy, gpus_per_node, efa_per_node, "
                "cpu, memory, shm_size, pvc, fsx_mount, tolerations, priority_class, service_account, "
                "nvrx_release (of the image), node_health_check_endpoint, "
                "scheduler (the gang: volcano or scheduler-plugins), scheduler_name, backoff_limit (JobSet "
                "restarts), ttl_after_finished_s, termination_grace_s, metrics_port, env, labels, launch; "
                "the rest of JobSpec is a TrainJob's"})
    schedule_timeout_s: int = field(default=0, metadata={
        "help": "scheduler-plugins: seconds the gang may wait to be scheduled as a whole; 0 = the plugin default"})

    @classmethod
    def from_dict(cls, d: dict) -> "RuntimeSpec":
        """A RuntimeSpec from plain values: ``name``, ``schedule_timeout_s`` and JobSpec settings."""
        own = {k: d[k] for k in ("name", "schedule_timeout_s") if k in d}
        pods = {"name": RUNTIME_NAME, "image": TRAINER_IMAGE, "scheduler": "volcano",
                **{k: v for k, v in d.items() if k not in own}}
        return cls(pods=JobSpec.from_dict(pods), **_coerced(cls, own))

    def pod_settings(self) -> JobSpec:
        # The pods' JobSpec builds a PyTorchJob's pod; its job name is no runtime's business (and the runtime
        # name, a DNS subdomain, need not be a valid job name).
        return dataclasses.replace(self.pods, name=NODE)

    def validate(self) -> "RuntimeSpec":
        p = _problems(self.pod_settings())
        if not _DNS1123_SUBDOMAIN.match(self.name) or len(self.name) > 253:
            p.append(f"runtime name {self.name!r} is not a DNS-1123 subdomain")
        if self.schedule_timeout_s < 0:
            p.append(f"schedule_timeout_s must not be negative, got {self.schedule_timeout_s}")
        if self.pods.scheduler == "kueue":
            p.append("scheduler=kueue is a TrainJob's setting (its LocalQueue), not a runtime's: build the runtime "
                     "with its gang scheduler (or none) and set scheduler=kueue and queue on the TrainJobs")
        if self.schedule_timeout_s and self.pods.scheduler != "scheduler-plugins":
            p.append("schedule_timeout_s is a setting of scheduler-plugins (coscheduling): set "
                     "scheduler=scheduler-plugins")
        if len(p) == 1:
            raise ValueError(f"invalid ClusterTrainingRuntime settings: {p[0]}")
        if p:
            raise ValueError("invalid ClusterTrainingRuntime settings:\n  " + "\n  ".join(p))
        return self


def _problems(spec: JobSpec) -> list[str]:
    """The PyTorchJob builder's checks of ``spec``, as a list."""
    return spec.problems()


# Commands ---------------------------------------------------------------------------------------

def node_command(spec: JobSpec) -> list[str]:
    """The ft_launcher command of every node pod of ``spec`` (a job's or the runtime's pod settings), up to
    ``-m trainer``, for its NVRx release (``nvrx_release``): counts and the rendezvous come from the torch
    plugin's ``PET_*`` variables (``$(VAR)``, expanded by the kubelet)."""
    launch = dataclasses.replace(spec.launch, nnodes="$(PET_NNODES)", nproc_per_node="$(PET_NPROC_PER_NODE)",
                                 rdzv_endpoint="$(PET_MASTER_ADDR):$(PET_MASTER_PORT)", rdzv_id=f"$({JOB_NAME_ENV})")
    return launcher_command(launch, [], release=spec.release, extras=spec.launcher_extras())


def trainer_command(spec: JobSpec) -> list[str]:
    """The exact argv of a TrainJob's trainer container, before the kubelet expands ``$(PET_*)``: its command
    (the runtime's, or the job's own when it differs: the same list either way) followed by its args
    (``python -m trainer``'s arguments)."""
    return [*node_command(spec), *spec.trainer_config().argv()]


# Validation -------------------------------------------------------------------------------------

def _trainjob_problems(spec: JobSpec, runtime: RuntimeSpec) -> list[str]:
    """Settings a TrainJob cannot carry, or that must agree with the runtime it references."""
    rt, p = runtime.pods, []
    if spec.elastic:
        p.append(f"min_nodes={spec.min_nodes}: Kubeflow Trainer v2.3 has no elastic training (--nnodes MIN:MAX); "
                 "use the pytorchjob backend for elastic jobs, or set min_nodes=0")
    for key in ("hot_spares", "nvlink_segment"):
        if getattr(spec, key):
            p.append(f"{key}={getattr(spec, key)}: a TrainJob's node command takes its node count from the Trainer "
                     "($(PET_NNODES)), and --nnodes N:N+k or --ft-segment need it known; use the pytorchjob backend")
    for key, why in (("restart_policy", "TrainJob pods never restart in place (restartPolicy Never, so that pod "
                                        "failure policies apply); restarts are the runtime's JobSet failure policy"),
                     ("clean_pod_policy", "a PyTorchJob setting; a finished TrainJob's pods go with its JobSet "
                                          "(ttl_after_finished_s of the runtime)"),
                     ("master_port", f"the Trainer fixes the rendezvous port at {RDZV_PORT} (PET_MASTER_PORT)")):
        if getattr(spec, key) != _jobspec_default(key):
            p.append(f"{key}={getattr(spec, key)!r} is not used by a TrainJob: {why}")
    # Settings of the JobSet or of fields a TrainJob cannot patch: they are the runtime's.
    for key in ("backoff_limit", "ttl_after_finished_s", "fsx_mount", "image_pull_policy", "metrics_port",
                "node_health_check_endpoint"):
        if getattr(spec, key) != getattr(rt, key):
            p.append(f"{key}={getattr(spec, key)!r} differs from ClusterTrainingRuntime {runtime.name}'s "
                     f"{getattr(rt, key)!r}: in Trainer v2 it is the runtime's; use the runtime's value, or "
                     f"reference a runtime built with {key}={getattr(spec, key)!r} (RuntimeSpec)")
    for key in ("scheduler", "scheduler_name", "priority_class"):
        if key == "scheduler" and spec.scheduler == "kueue":
            continue            # Kueue admits the TrainJob; the runtime's gang scheduler (if any) still places it
        if getattr(spec, key) not in ("", getattr(rt, key)):
            p.append(f"{key}={getattr(spec, key)!r} differs from ClusterTrainingRuntime {runtime.name}'s "
                     f"{getattr(rt, key)!r}: gang scheduling and priority are the runtime's (leave it empty)")
    for what, mine, theirs in (("GPUs", spec.gpus_per_node, rt.gpus_per_node), ("EFA interfaces", spec.efa, rt.efa)):
        if mine == 0 and theirs > 0:
            p.append(f"0 {what} per node, but ClusterTrainingRuntime {runtime.name} requests {theirs} and a "
                     f"TrainJob can raise or lower that, not remove it: use a runtime built without {what}")
    if spec.metrics_port and spec.procs > rt.procs:
        p.append(f"{spec.procs} processes per node, but ClusterTrainingRuntime {runtime.name} declares metrics "
                 f"ports for {rt.procs} local ranks")
    if spec.metrics_port and spec.metrics_port <= RDZV_PORT < spec.metrics_port + spec.procs:
        p.append(f"metrics ports {spec.metrics_port}..{spec.metrics_port + spec.procs - 1} overlap the rendezvous "
                 f"port {RDZV_PORT}")
    reserved = sorted(set(map(str, spec.env)) & {*PET_ENV, JOB_NAME_ENV})
    if reserved:
        p.append(f"env {reserved}: set by the Trainer's torch plugin and the runtime, not by a job")
    suffix = f"-{NODE}-0-{max(spec.nodes - 1, 0)}"
    if len(spec.name) + len(suffix) > 63:
        p.append(f"name {spec.name!r} is too long: pod host names like {spec.name}{suffix} must fit 63 "
                 f"characters (at most {63 - len(suffix)} for the name)")
    return p


def _validate_trainjob(spec: JobSpec, runtime: RuntimeSpec) -> None:
    runtime.validate()
    p = _problems(spec) + _trainjob_problems(spec, runtime)
    if len(p) == 1:
        raise ValueError(f"invalid TrainJob settings: {p[0]}")
    if p:
        raise ValueError("invalid TrainJob settings:\n  " + "\n  ".join(p))


# Building ---------------------------------------------------------------------------------------

def _pod(spec: JobSpec):
    """The PyTorchJob builder's pod for ``spec``, as a trainer-api ``IoK8sApiCoreV1PodTemplateSpec``."""
    from kubeflow_trainer_api import models as m

    replicas = job_manifest(spec)["spec"]["pytorchReplicaSpecs"]
    return m.IoK8sApiCoreV1PodTemplateSpec.from_dict(next(iter(replicas.values()))["template"])


def build_runtime(runtime: RuntimeSpec | None = None):
    """The validated ``goodput-nvrx`` runtime as a ``TrainerV1alpha1ClusterTrainingRuntime``."""
    from kubeflow_trainer_api import models as m

    runtime = (runtime or RuntimeSpec()).validate()
    rt = runtime.pods
    pod = _pod(runtime.pod_settings()).spec
    (c,) = pod.containers
    assert c.name == CONTAINER_NAME
    c.name = NODE
    c.command = node_command(rt)
    # The torch plugin adds the rendezvous port itself; the metrics ports stay for the PodMonitor.
    c.ports = [port for port in c.ports or [] if port.name != PORT_NAME] or None
    # The peer secret is each job's own (its TrainJob's env), never the runtime's.
    c.env = [*(e for e in c.env or [] if e.name != peer_secret.ENV), m.IoK8sApiCoreV1EnvVar(
        name=JOB_NAME_ENV, value_from=m.IoK8sApiCoreV1EnvVarSource(field_ref=m.IoK8sApiCoreV1ObjectFieldSelector(
            field_path=f"metadata.labels['{JOBSET_NAME_LABEL}']")))]
    pod.restart_policy = "Never"
    rules = []
    for r in FAILURE_RULES:
        if r.disruption:
            rules.append(m.IoK8sApiBatchV1PodFailurePolicyRule(action="FailJob", on_pod_conditions=[
                m.IoK8sApiBatchV1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget", status="True")]))
        else:
            rules.append(m.IoK8sApiBatchV1PodFailurePolicyRule(
                action="FailJob", on_exit_codes=m.IoK8sApiBatchV1PodFailurePolicyOnExitCodesRequirement(
                    container_name=NODE, operator="In", values=list(r.exit_codes))))
    node_job = m.JobsetV1alpha2ReplicatedJob(
        name=NODE,
        template=m.IoK8sApiBatchV1JobTemplateSpec(
            metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels={ANCESTOR_LABEL: "trainer"}),
            spec=m.IoK8sApiBatchV1JobSpec(
                # Any failed pod fails its Job at once; the JobSet's rules decide what happens next.
                backoff_limit=0, completion_mode="Indexed", pod_failure_policy=m.IoK8sApiBatchV1PodFailurePolicy(
                    rules=rules),
                template=m.IoK8sApiCoreV1PodTemplateSpec(
                    metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels={**MANAGED_BY, **{
                        str(k): str(v) for k, v in rt.labels.items()}}),
                    spec=pod))))
    failure_policy = m.JobsetV1alpha2FailurePolicy(
        max_restarts=rt.backoff_limit, restart_strategy="Recreate",
        rules=[m.JobsetV1alpha2FailurePolicyRule(
            name=r.name, action=r.action, target_replicated_jobs=[NODE], on_job_failure_reasons=["PodFailurePolicy"],
            on_job_failure_message_patterns=[f"matching FailJob rule at index {i}$"])
            for i, r in enumerate(FAILURE_RULES)])
    gang = None
    if rt.scheduler == "volcano":
        gang = m.TrainerV1alpha1PodGroupPolicy(volcano=m.TrainerV1alpha1VolcanoPodGroupPolicySource())
    elif rt.scheduler == "scheduler-plugins":
        gang = m.TrainerV1alpha1PodGroupPolicy(coscheduling=m.TrainerV1alpha1CoschedulingPodGroupPolicySource(
            schedule_timeout_seconds=runtime.schedule_timeout_s or None))
    return m.TrainerV1alpha1ClusterTrainingRuntime(
        api_version=API_VERSION, kind=RUNTIME_KIND,
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=runtime.name, labels={
            FRAMEWORK_LABEL: "torch", "app.kubernetes.io/part-of": "goodput-pipelines"}),
        spec=m.TrainerV1alpha1TrainingRuntimeSpec(
            ml_policy=m.TrainerV1alpha1MLPolicy(num_nodes=1, torch=m.TrainerV1alpha1TorchMLPolicySource()),
            pod_group_policy=gang,
            template=m.TrainerV1alpha1JobSetTemplateSpec(spec=m.JobsetV1alpha2JobSetSpec(
                failure_policy=failure_policy, replicated_jobs=[node_job],
                ttl_seconds_after_finished=None if rt.ttl_after_finished_s < 0 else rt.ttl_after_finished_s))))


def build_trainjob(spec: JobSpec, runtime: RuntimeSpec | None = None):
    """The validated job as a ``TrainerV1alpha1TrainJob`` referencing ``runtime`` (default ``goodput-nvrx``)."""
    from kubeflow_trainer_api import models as m

    runtime = runtime or RuntimeSpec()
    _validate_trainjob(spec, runtime)
    template = _pod(spec)
    pod, (c,) = template.spec, template.spec.containers
    # The runtime's command is for its own launch settings, NVRx release and devices: a job that differs in any
    # carries its own.
    command = node_command(spec)
    if command == node_command(runtime.pods):
        command = None
    # What only the pod spec can say, as a patch: list fields (tolerations, volumes by name) are replaced
    # whole, so the job's own placement is complete without the runtime's.
    pod_patch = m.TrainerV1alpha1PodSpecPatch(
        node_selector=pod.node_selector, tolerations=pod.tolerations, volumes=pod.volumes,
        service_account_name=pod.service_account_name,
        termination_grace_period_seconds=pod.termination_grace_period_seconds)
    queue = {VOLCANO_QUEUE_ANNOTATION: spec.queue} if spec.queue and spec.scheduler != "kueue" else None
    patch = m.TrainerV1alpha1RuntimePatch(
        manager=PATCH_MANAGER,
        training_runtime_spec=m.TrainerV1alpha1TrainingRuntimeSpecPatch(template=m.TrainerV1alpha1JobSetTemplatePatch(
            metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels=template.metadata.labels, annotations=queue),
            spec=m.TrainerV1alpha1JobSetSpecPatch(replicated_jobs=[m.TrainerV1alpha1ReplicatedJobPatch(
                name=NODE, template=m.TrainerV1alpha1JobTemplatePatch(spec=m.TrainerV1alpha1JobSpecPatch(
                    template=m.TrainerV1alpha1PodTemplatePatch(
                        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(labels=template.metadata.labels),
                        spec=pod_patch))))]))))
    return m.TrainerV1alpha1TrainJob(
        api_version=API_VERSION, kind=TRAINJOB_KIND,
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=spec.name, namespace=spec.namespace or None,
            labels={**template.metadata.labels, **queue_label(spec)}),
        spec=m.TrainerV1alpha1TrainJobSpec(
            # Kueue unsuspends the job when it admits it (its webhook would suspend one created running).
            suspend=True if spec.scheduler == "kueue" else None,
            runtime_ref=m.TrainerV1alpha1RuntimeRef(api_group="trainer.kubeflow.org", kind=RUNTIME_KIND,
                                                    name=runtime.name),
            active_deadline_seconds=spec.active_deadline_s or None,
            trainer=m.TrainerV1alpha1Trainer(
                image=spec.image, num_nodes=spec.nodes, num_proc_per_node=spec.procs,
                command=command,
                args=spec.trainer_config().argv(), env=c.env, resources_per_node=c.resources),
            runtime_patches=[patch]))


def trainjob_manifest(spec_or_job, runtime: RuntimeSpec | None = None) -> dict:
    """The TrainJob as plain JSON-able data (camelCase keys, no nulls), ready for the API or YAML."""
    job = build_trainjob(spec_or_job, runtime) if isinstance(spec_or_job, JobSpec) else spec_or_job
    return job.to_dict()


def runtime_manifest(runtime: RuntimeSpec | None = None) -> dict:
    """The ClusterTrainingRuntime as plain JSON-able data."""
    return build_runtime(runtime).to_dict()
