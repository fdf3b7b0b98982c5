"""compose/kubernetes/: valid Kubernetes objects, and wired together as docs/kubernetes.md says.

Every object is checked against the Kubernetes JSON schemas shipped by
``kubernetes-validate`` (strict: unknown fields fail); the ServiceMonitor is a
Prometheus Operator CRD with no schema there, so its few fields are checked by
hand. Then the wiring: the Service selects the DaemonSet's pods, the sidecar and
the engines mount the same host directory at the same path, the instance id is
the pod name, every ``KVSIDECAR_*`` variable is a real setting and the probes
hit real routes.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="the dev extra installs kubernetes-validate"
)

from engine_ext._settings import EngineSettings
from sidecar import create_app
from sidecar._settings import SidecarSettings

K8S = Path(__file__).resolve().parents[2] / "compose" / "kubernetes"
K8S_VERSION = "1.30"
BASES = [K8S, K8S / "example-vllm"]


def _resources(base: Path) -> list[dict[str, Any]]:
    kust = yaml.safe_load((base / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for name in kust["resources"]:
        docs += [d for d in yaml.safe_load_all((base / name).read_text()) if d]
    return docs


def _all() -> list[dict[str, Any]]:
    return [d for base in BASES for d in _resources(base)]


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in _all() if d["kind"] == kind]
    return doc


def test_every_manifest_is_listed_in_a_kustomization() -> None:
    listed = {
        (base / name).resolve()
        for base in BASES
        for name in yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
    }
    on_disk = {p.resolve() for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == on_disk
    assert {d["kind"] for d in _all()} == {
        "Namespace",
        "DaemonSet",
        "Service",
        "ServiceMonitor",
        "Deployment",
    }


@pytest.mark.parametrize(
    "doc",
    [d for d in _all() if d["kind"] != "ServiceMonitor"],
    ids=lambda d: f"{d['kind']}/{d['metadata']['name']}",
)
def test_objects_pass_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    broken = copy.deepcopy(_one("DaemonSet"))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8570"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = copy.deepcopy(_one("Service"))
    broken["spec"]["internalTrafficPolicy "] = "Local"  # a typo'd field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _pod(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = _one(kind)["spec"]["template"]["spec"]
    return spec


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_service_and_servicemonitor_select_the_sidecar() -> None:
    ds, svc, sm = _one("DaemonSet"), _one("Service"), _one("ServiceMonitor")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert svc["spec"]["internalTrafficPolicy"] == "Local"  # engines talk to their node's sidecar
    port_names = {p["name"] for c in _pod("DaemonSet")["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert sm["spec"]["namespaceSelector"]["matchNames"] == [namespace]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_sidecar_and_engines_share_the_runtime_dir_and_use_pod_names() -> None:
    def host_mounts(pod: dict[str, Any]) -> dict[str, str]:
        host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
        return {
            host[m["name"]]: m["mountPath"]
            for c in pod["containers"]
            for m in c["volumeMounts"]
            if m["name"] in host
        }

    sidecar_pod, engine_pod = _pod("DaemonSet"), _pod("Deployment")
    shared = host_mounts(sidecar_pod)["/run/kvsidecar"]
    assert host_mounts(engine_pod)["/run/kvsidecar"] == shared  # same host dir, same path
    env = _env(engine_pod["containers"][0])
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["KVSIDECAR_INSTANCE_ID"] == "$(POD_NAME)"
    assert env["KVSIDECAR_RUNTIME_DIR"] == f"{shared}/$(POD_NAME)"
    svc = _one("Service")
    namespace = yaml.safe_load((K8S / "kustomization.yaml").read_text())["namespace"]
    assert env["KVSIDECAR_SIDECAR_URL"] == (
        f"http://{svc['metadata']['name']}.{namespace}.svc:{svc['spec']['ports'][0]['port']}"
    )


def test_settings_and_probes_exist() -> None:
    known = {
        f"KVSIDECAR_{n.upper()}"
        for cls in (EngineSettings, SidecarSettings)
        for n in cls.model_fields
    }
    for kind in ("DaemonSet", "Deployment"):
        for container in _pod(kind)["containers"]:
            used = {n for n in _env(container) if n.startswith("KVSIDECAR_")}
            assert used <= known, used - known
    app = create_app(SidecarSettings(db_path=Path("/nonexistent/unused.db")))
    paths = {getattr(r, "path", None) for r in app.routes}
    (container,) = _pod("DaemonSet")["containers"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in paths
    assert container["command"][:2] == ["kvsidecar", "serve"]
    assert container["image"] in {
        i["name"] for i in yaml.safe_load((K8S / "kustomization.yaml").read_text())["images"]
    }


def test_the_sidecar_forgets_replaced_pods(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines are named after their pods, so a replaced pod's id never returns: the
    DaemonSet's sidecar forgets gone instances (else the instance cap fills up and the
    autopilot keeps every dead pod's floor free). Its settings must also load."""
    (container,) = _pod("DaemonSet")["containers"]
    for name, value in _env(container).items():
        if name.startswith("KVSIDECAR_") and isinstance(value, str):
            monkeypatch.setenv(name, value)
    settings = SidecarSettings()
    assert settings.forget_after_s >= settings.heartbeat_timeout_s * 10


def test_kustomize_builds_it_when_available() -> None:
    exe = shutil.which("kustomize") or shutil.which("kubectl")
    if exe is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    args = [exe, "build"] if exe.endswith("kustomize") else [exe, "kustomize"]
    for base in BASES:
        proc = subprocess.run(
            [*args, str(base)], capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 0, proc.stderr
        for doc in yaml.safe_load_all(proc.stdout):
            if doc and doc["kind"] != "ServiceMonitor":
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
