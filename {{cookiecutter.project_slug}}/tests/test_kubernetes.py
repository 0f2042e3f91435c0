"""Kubernetes: the manifests in k8s/ checked offline, and drills of the container's entry command
on loopback with the environment each operator gives a pod.

k8s/schema.json holds the fields the manifests use, unknown ones rejected: a misspelled field
fails here, without a cluster (an API server rejects it only under strict field validation).
"""

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import PROJECT, SMOKE_CONFIG, finish, newest_checkpoint, project_env, wait_for
from dockerfile_parse import DockerfileParser

from {{ cookiecutter.package_name }} import config
from {{ cookiecutter.package_name }}.base import preemption
from {{ cookiecutter.package_name }}.loop import checkpoint
from {{ cookiecutter.package_name }}.tools import launch

K8S = PROJECT / "k8s"
SCHEMA = json.loads((K8S / "schema.json").read_text())
KUBERNETES_VERSION = "1.33.0"  # the API of the built-in kinds (kubernetes-validate's bundled schemas)


def manifests() -> dict[str, dict]:
    """Every manifest in k8s/ by kind."""
    documents = [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())]
    return {doc["kind"]: doc for doc in documents}


def schema_errors(document: dict) -> list[str]:
    schema = {**SCHEMA, "$ref": f"#/$defs/{document['kind']}"}
    validator = jsonschema.Draft202012Validator(schema)
    return [error.message for error in validator.iter_errors(document)]


def dockerfile(instruction: str) -> list[str]:
    """The values of the Dockerfile's instructions of one kind (FROM, WORKDIR, ENTRYPOINT ...)."""
    parsed = DockerfileParser(str(PROJECT / "Dockerfile")).structure
    return [item["value"] for item in parsed if item["instruction"] == instruction]


def entry_command() -> list[str]:
    """The image's ENTRYPOINT, in exec form, as the Dockerfile declares it."""
    (entry,) = dockerfile("ENTRYPOINT")
    return json.loads(entry)


def pod_spec(kind: str) -> dict:
    spec = manifests()[kind]["spec"]
    jobset = spec["template"]["spec"] if kind == "TrainingRuntime" else spec
    return jobset["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def grace_seconds() -> int:
    return pod_spec("JobSet")["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("kind", ["TrainJob", "TrainingRuntime", "JobSet"])
def test_each_custom_resource_matches_the_fields_its_crd_defines(kind):
    assert schema_errors(manifests()[kind]) == []


@pytest.mark.parametrize(
    ("kind", "path", "misspelled"),
    [
        ("TrainJob", ["spec", "trainer"], "numNode"),
        ("JobSet", ["spec", "replicatedJobs", 0, "template", "spec"], "podFailurePolicies"),
        (
            "TrainingRuntime",
            ["spec", "template", "spec", "replicatedJobs", 0, "template", "spec", "template", "spec"],
            "terminationGracePeriod",
        ),
    ],
)
def test_a_misspelled_field_fails_the_schema(kind, path, misspelled):
    document = copy.deepcopy(manifests()[kind])
    parent = document
    for key in path:
        parent = parent[key]
    parent[misspelled] = 1
    assert any(repr(misspelled) in error for error in schema_errors(document))


def test_a_trainjob_may_not_set_the_variables_its_operator_injects():
    document = copy.deepcopy(manifests()["TrainJob"])
    document["spec"]["trainer"]["env"] = [{"name": "PET_NNODES", "value": "2"}]
    assert schema_errors(document)


def test_built_in_kinds_pass_kubernetes_validate_strictly():
    built_in = [doc for doc in manifests().values() if "/" not in doc["apiVersion"]]  # the core API group
    assert built_in, "k8s/ holds no built-in kind"
    for document in built_in:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_manifests_follow_the_project_and_each_other():
    cfg, found = config.load(PROJECT / "configs" / "default.yaml"), manifests()
    trainer, runtime = found["TrainJob"]["spec"]["trainer"], found["TrainingRuntime"]
    assert trainer["numNodes"] == cfg.dist.num_nodes == runtime["spec"]["mlPolicy"]["numNodes"]
    assert found["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == cfg.dist.num_nodes
    assert found["TrainJob"]["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    (workdir,) = dockerfile("WORKDIR")
    for kind in ("TrainingRuntime", "JobSet"):
        pod = pod_spec(kind)
        (container,) = pod["containers"]
        assert container["name"] == "node"  # the torch plugin injects PET_* into the container named node
        mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
        assert mounts == {"runs": f"{workdir}/{cfg.run.out_dir}", "dshm": "/dev/shm"}
        claim = next(volume for volume in pod["volumes"] if volume["name"] == "runs")["persistentVolumeClaim"]
        assert claim["claimName"] == found["PersistentVolumeClaim"]["metadata"]["name"]
        assert pod["terminationGracePeriodSeconds"] == grace_seconds()
    assert found["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]  # every node loads checkpoints
    for resources in (trainer["resourcesPerNode"], pod_spec("JobSet")["containers"][0]["resources"]):
        # the torch plugin counts GPUs in the requests; the CPU limit sizes the threads (cpus.usable_cpus)
        assert (
            resources["requests"] == resources["limits"]
            and resources["limits"]["nvidia.com/gpu"] == cfg.dist.gpus_per_node
        )


def test_a_preemption_restarts_every_node_and_a_failure_counts():
    found = manifests()
    runtime = found["TrainingRuntime"]
    assert runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["name"] == "node"  # PET_MASTER_ADDR names it
    assert found["TrainJob"]["spec"]["runtimeRef"]["kind"] == "TrainingRuntime"
    for spec in (runtime["spec"]["template"]["spec"], found["JobSet"]["spec"]):
        (rule,) = spec["failurePolicy"]["rules"]
        assert rule["action"] == "RestartJobSetAndIgnoreMaxRestarts" and rule["onJobFailureReasons"] == [
            "PodFailurePolicy"
        ]
        job = spec["replicatedJobs"][0]["template"]
        stopped, evicted = job["spec"]["podFailurePolicy"]["rules"]
        assert stopped["action"] == evicted["action"] == "FailJob"
        assert stopped["onExitCodes"] == {
            "containerName": "node",
            "operator": "In",
            "values": [preemption.PREEMPTED_EXIT_CODE],
        }
        assert evicted["onPodConditions"] == [{"type": "DisruptionTarget"}]
        assert job["spec"]["backoffLimit"] == 0 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    ancestor = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["metadata"]["labels"]
    assert ancestor == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}  # where the plugin puts PET_*


def test_the_jobsets_pods_find_pod_0_and_their_node_rank():
    job = manifests()["JobSet"]["spec"]["replicatedJobs"][0]
    assert job["replicas"] == 1 and job["template"]["spec"]["completionMode"] == "Indexed"  # JOB_COMPLETION_INDEX
    (container,) = pod_spec("JobSet")["containers"]
    env = {var["name"]: var for var in container["env"]}
    assert (
        int(env["PET_NNODES"]["value"])
        == job["template"]["spec"]["parallelism"]
        == job["template"]["spec"]["completions"]
    )
    label = env["JOBSET_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert label == "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    assert env["PET_MASTER_ADDR"]["value"] == f"$(JOBSET_NAME)-{job['name']}-0-0.$(JOBSET_NAME)"


def test_the_docs_state_what_the_manifests_set():
    readme = (PROJECT / "docs" / "clusters.md").read_text()
    assert f"`terminationGracePeriodSeconds` ({grace_seconds()} s here)" in readme
    restarts = manifests()["JobSet"]["spec"]["failurePolicy"]["maxRestarts"]
    assert restarts == manifests()["TrainingRuntime"]["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"]
    assert f"`failurePolicy.maxRestarts` ({restarts})" in readme
    assert " ".join(entry_command()) in readme


def test_the_image_runs_the_node_launcher_as_pid_1_on_a_torch_the_project_supports():
    entry = entry_command()
    # exec form: no shell as PID 1
    assert entry[:3] == ["python", "-m", "{{ cookiecutter.package_name }}.tools.launch"]
    (base,) = dockerfile("FROM")
    torch_version = tuple(int(part) for part in base.split(":")[1].split("-")[0].split(".")[:2])
    assert base.startswith("pytorch/pytorch:") and torch_version >= (2, 4)  # pyproject: torch>=2.4


def test_a_config_mistake_ends_the_images_entry_with_one_line_and_exit_2():
    command = [sys.executable, *entry_command()[1:], "optim.lrr=1"]  # the manifests' `args` after the image's
    result = subprocess.run(command, cwd=PROJECT, env=project_env(), capture_output=True, text=True, timeout=120)
    typo = "config error: optim.lrr: unknown key; did you mean optim.lr? (from the command line's optim.lrr=1)"
    assert (result.returncode, result.stderr.splitlines()) == (2, [typo])


# ---- drills: two "pods" on loopback, each the image's entry command under the operator's environment


def start_pods(tmp_path: Path, envs: list[dict], *overrides: str) -> list[subprocess.Popen]:
    command = [sys.executable, *entry_command()[1:], "--config", SMOKE_CONFIG, f"run.out_dir={tmp_path}"]
    command.append("data.num_workers=0")
    return [
        subprocess.Popen(
            [*command, *overrides],
            cwd=PROJECT,
            env=project_env(CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo", **env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for env in envs
    ]


def trainjob_env(port: int) -> list[dict]:
    """What Kubeflow Trainer's torch plugin sets on each node's container (PET_MASTER_ADDR is
    <trainjob>-node-0-0.<trainjob> there, the address of pod 0)."""
    common = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "127.0.0.1"}
    return [{**common, "PET_MASTER_PORT": str(port), "PET_NODE_RANK": str(rank)} for rank in range(2)]


def jobset_env(port: int) -> list[dict]:
    """jobset.yaml's container env, for 2 nodes on loopback, and the pod index the Job controller sets."""
    (container,) = pod_spec("JobSet")["containers"]
    assert {var["name"] for var in container["env"]} == {
        "PET_NNODES",
        "JOBSET_NAME",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
    }
    loopback = {"PET_NNODES": "2", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port), "NPROC_PER_NODE": "1"}
    return [{**loopback, "JOB_COMPLETION_INDEX": str(index)} for index in range(2)]


def errors(results) -> str:
    return "\n".join(err[-3000:] for _, _, err in results)


@pytest.mark.slow
@pytest.mark.parametrize("environment", [trainjob_env, jobset_env], ids=["trainjob", "jobset"])
def test_two_pods_train_to_the_end_with_the_operators_environment(tmp_path, environment):
    pods = start_pods(tmp_path, environment(launch.free_port(os.getpid())), "train.max_steps=20")
    results = finish(pods, timeout=120)
    assert [code for code, _, _ in results] == [0, 0], errors(results)
    assert "world size 2 (1 per node)" in results[0][1]  # node rank 0 holds global rank 0
    final = checkpoint.load_file(tmp_path / "smoke" / "checkpoints" / "step_00000020.pt")
    assert final["world_size"] == 2


@pytest.mark.slow
def test_sigterm_to_each_pods_pid_1_checkpoints_within_the_grace_period_and_a_restart_resumes(tmp_path):
    # the kubelet sends SIGTERM to PID 1 of every container it stops (a drain, a preemption)
    envs = trainjob_env(launch.free_port(os.getpid()))
    pods = start_pods(tmp_path, envs, "train.epochs=200", "checkpoint.every_steps=100000")
    metrics = tmp_path / "smoke" / "metrics.jsonl"
    try:
        wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, timeout=60)
        stopped = time.monotonic()
        for pod in pods:
            os.kill(pod.pid, signal.SIGTERM)
    finally:
        results = finish(pods, timeout=grace_seconds())
    assert [code for code, _, _ in results] == [preemption.PREEMPTED_EXIT_CODE] * 2, errors(results)
    assert time.monotonic() - stopped < grace_seconds()
    saved = newest_checkpoint(tmp_path / "smoke").name
    step = int(saved.removeprefix("step_").removesuffix(".pt"))
    # the Job replaces both pods (podFailurePolicy ignores exit 75); they resume from runs/
    restarted = start_pods(tmp_path, trainjob_env(launch.free_port(os.getpid() + 1)), f"train.max_steps={step + 10}")
    results = finish(restarted, timeout=120)
    assert [code for code, _, _ in results] == [0, 0], errors(results)
    assert f"at step {step}" in results[0][1] and f"done: {step + 10} steps" in results[0][1]
