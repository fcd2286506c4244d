//! The Kubernetes manifests (deploy/kubernetes) are valid and agree with each
//! other and with the server:
//! - the core resources validate against Kubernetes' own schemas (strict: no
//!   unknown fields) with the pinned `kubernetes-validate` package, for the
//!   pinned Kubernetes version;
//! - the ServiceMonitor validates against the Prometheus Operator's CRD schema
//!   (the pinned `cloudcoil-models-prometheus-operator` models, generated from
//!   the operator's CRDs; a field they do not know is an error too);
//! - the container's args parse with `weft serve`'s own CLI into settings that
//!   pass its exposure check, on the container's ports, with the tenant file
//!   the Secret mounts (which the server's tenant parser accepts); probes,
//!   Service, ServiceMonitor, HPA and the prometheus-adapter rule point at the
//!   right ports, labels and metric.
//!
//! Needs the venv scripts/setup.sh makes (`.venv`, or `WEFT_PYTHON`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use clap::Parser;
use serde_json::{json, Value};
use weft_grpc::server::config::Settings;
use weft_grpc::server::ServeArgs;

/// The Kubernetes version the manifests are validated for.
const KUBERNETES_VERSION: &str = "1.33.0";
/// apiVersions of CRDs (not in Kubernetes' schemas), validated separately.
const CRD_API_VERSIONS: &[&str] = &["monitoring.coreos.com/v1"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn k8s_dir() -> PathBuf {
    root().join("deploy/kubernetes")
}

fn python() -> PathBuf {
    match std::env::var_os("WEFT_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => root().join(".venv/bin/python"),
    }
}

fn run_python(args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new(python())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "{} not runnable ({e}): run scripts/setup.sh",
                python().display()
            )
        });
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

/// The YAML documents of a file, as JSON (PyYAML's safe loader).
fn yaml_docs(path: &Path) -> Vec<Value> {
    let out = run_python(
        &[
            "-c",
            "import json, sys, yaml\n\
             docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]\n\
             print(json.dumps(docs))",
            path.to_str().unwrap(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Every resource the kustomization applies, with the file it is in.
fn resources() -> Vec<(String, Value)> {
    let k = yaml_docs(&k8s_dir().join("kustomization.yaml"));
    assert_eq!(k.len(), 1);
    assert_eq!(k[0]["kind"], "Kustomization");
    let mut out = Vec::new();
    for f in k[0]["resources"].as_array().expect("resources") {
        let f = f.as_str().unwrap();
        for d in yaml_docs(&k8s_dir().join(f)) {
            out.push((f.to_string(), d));
        }
    }
    out
}

fn one<'a>(rs: &'a [(String, Value)], kind: &str) -> &'a Value {
    let found: Vec<&Value> = rs
        .iter()
        .map(|(_, d)| d)
        .filter(|d| d["kind"] == kind)
        .collect();
    assert_eq!(found.len(), 1, "one {kind}");
    found[0]
}

/// `kubernetes-validate --strict` over `files`: (exit status, stdout).
fn kubernetes_validate(files: &[PathBuf]) -> (bool, String) {
    let mut args = vec![
        "-m",
        "kubernetes_validate",
        "--strict",
        "-k",
        KUBERNETES_VERSION,
    ];
    let names: Vec<String> = files
        .iter()
        .map(|f| f.to_str().unwrap().to_string())
        .collect();
    args.extend(names.iter().map(String::as_str));
    let out = run_python(&args, None);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !text.contains("No module named"),
        "kubernetes-validate is not installed: run scripts/setup.sh\n{text}"
    );
    (out.status.success(), text)
}

#[test]
fn kustomization_lists_every_manifest() {
    let listed: BTreeSet<String> = yaml_docs(&k8s_dir().join("kustomization.yaml"))[0]["resources"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    let present: BTreeSet<String> = std::fs::read_dir(k8s_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml"))
        // Kustomize's own file; Helm values for the adapter, not a resource.
        .filter(|n| n != "kustomization.yaml" && n != "prometheus-adapter-values.yaml")
        .collect();
    assert_eq!(listed, present);
}

#[test]
fn core_resources_validate_against_the_kubernetes_schemas() {
    let rs = resources();
    let mut files = BTreeSet::new();
    let mut expected = Vec::new();
    for (f, d) in &rs {
        let api = d["apiVersion"].as_str().expect("apiVersion");
        if CRD_API_VERSIONS.contains(&api) {
            continue;
        }
        files.insert(k8s_dir().join(f));
        expected.push(format!(
            "passed for resource {}/{}",
            d["kind"].as_str().unwrap().to_lowercase(),
            d["metadata"]["name"].as_str().unwrap()
        ));
    }
    assert!(expected.len() >= 4, "{expected:?}");
    let (ok, text) = kubernetes_validate(&files.into_iter().collect::<Vec<_>>());
    assert!(ok, "kubernetes-validate failed:\n{text}");
    for line in text.lines() {
        assert!(line.starts_with("INFO "), "kubernetes-validate: {line}");
    }
    for e in &expected {
        assert!(text.contains(e.as_str()), "no '{e}' in:\n{text}");
    }

    // The validator fails on what is wrong: an unknown field (strict), a
    // required field missing, a value of the wrong type.
    let dir = tempfile::tempdir().unwrap();
    let dep = one(&rs, "Deployment").clone();
    let mut bad = Vec::new();
    let mut d = dep.clone();
    d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpcc"] = json!({"port": 1});
    bad.push(d);
    let mut d = dep.clone();
    d["spec"]["template"]["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("name");
    bad.push(d);
    let mut d = dep;
    d["spec"]["replicas"] = json!("two");
    bad.push(d);
    for (i, d) in bad.iter().enumerate() {
        // JSON is YAML.
        let p = dir.path().join(format!("bad{i}.yaml"));
        std::fs::write(&p, d.to_string()).unwrap();
        let (ok, text) = kubernetes_validate(&[p]);
        assert!(
            !ok && text.contains("ERROR"),
            "bad manifest {i} passed:\n{text}"
        );
    }
}

/// Validates CRD resources with the Prometheus Operator's models: one error
/// string per problem (schema errors, and fields the schema does not have,
/// which pydantic would otherwise drop).
const CRD_CHECK: &str = r#"
import json, sys
from cloudcoil.models.prometheus_operator import v1

def dropped(a, b, path):
    if isinstance(a, dict):
        out = []
        for k, v in a.items():
            if not isinstance(b, dict) or k not in b:
                out.append(path + "." + k)
            else:
                out += dropped(v, b[k], path + "." + k)
        return out
    if isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            return [path]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in dropped(x, y, "%s[%d]" % (path, i))]
    return [] if a == b else [path + " (changed)"]

errors = []
for d in json.load(sys.stdin):
    what = "%s/%s" % (d.get("kind"), d.get("metadata", {}).get("name"))
    cls = getattr(v1, str(d.get("kind")), None)
    if d.get("apiVersion") != "monitoring.coreos.com/v1" or cls is None:
        errors.append(what + ": not a monitoring.coreos.com/v1 kind")
        continue
    try:
        back = cls.model_validate(d).model_dump(by_alias=True, exclude_unset=True, mode="json")
    except Exception as e:
        errors.append(what + ": " + str(e))
        continue
    for p in dropped(d, back, ""):
        errors.append(what + ": not in the CRD schema: " + p)
print(json.dumps(errors))
"#;

fn crd_errors(docs: &[Value]) -> Vec<String> {
    let out = run_python(
        &["-c", CRD_CHECK],
        Some(&serde_json::to_string(docs).unwrap()),
    );
    assert!(
        out.status.success(),
        "the CRD check did not run (scripts/setup.sh installs its models): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn crd_resources_validate_against_their_crd_schemas() {
    let rs = resources();
    let crds: Vec<Value> = rs
        .iter()
        .map(|(_, d)| d.clone())
        .filter(|d| CRD_API_VERSIONS.contains(&d["apiVersion"].as_str().unwrap()))
        .collect();
    assert!(crds.iter().any(|d| d["kind"] == "ServiceMonitor"));
    let errors = crd_errors(&crds);
    assert!(errors.is_empty(), "{errors:#?}");

    // And it catches what is wrong: a misspelt field, a bad duration, no
    // selector, another group's kind.
    let sm = one(&rs, "ServiceMonitor").clone();
    let mut d1 = sm.clone();
    d1["spec"]["endpoints"][0]["intreval"] = json!("15s");
    let mut d2 = sm.clone();
    d2["spec"]["endpoints"][0]["interval"] = json!("15 seconds");
    let mut d3 = sm.clone();
    d3["spec"].as_object_mut().unwrap().remove("selector");
    let mut d4 = sm;
    d4["apiVersion"] = json!("monitoring.coreos.com/v2");
    for d in [d1, d2, d3, d4] {
        assert_eq!(crd_errors(std::slice::from_ref(&d)).len(), 1, "{d} passed");
    }
}

fn subset(small: &Value, big: &Value) -> bool {
    let (Some(s), Some(b)) = (small.as_object(), big.as_object()) else {
        return false;
    };
    !s.is_empty() && s.iter().all(|(k, v)| b.get(k) == Some(v))
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

#[test]
fn manifests_agree_with_each_other_and_the_server() {
    let rs = resources();
    let dep = one(&rs, "Deployment");
    let svc = one(&rs, "Service");
    let sm = one(&rs, "ServiceMonitor");
    let hpa = one(&rs, "HorizontalPodAutoscaler");
    let secret = one(&rs, "Secret");
    let pod = &dep["spec"]["template"];
    let pod_labels = &pod["metadata"]["labels"];
    assert!(subset(&dep["spec"]["selector"]["matchLabels"], pod_labels));
    assert!(
        subset(&svc["spec"]["selector"], pod_labels),
        "the Service selects the Deployment's pods"
    );
    let containers = pod["spec"]["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    let port = |name: &str| -> u64 {
        c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no container port {name}"))["containerPort"]
            .as_u64()
            .unwrap()
    };
    let (grpc, http, metrics) = (port("grpc"), port("http"), port("metrics"));
    // A probe's or Service's port: a number or a container port's name.
    let resolve = |p: &Value| -> u64 {
        p.as_u64()
            .unwrap_or_else(|| port(p.as_str().expect("port name or number")))
    };

    // The args are `weft serve` flags (the image's entrypoint), parsed by
    // the server's own CLI; settings come from them alone.
    let args: Vec<&str> = c["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(c.get("command").is_none(), "the image's entrypoint runs");
    for e in c["env"].as_array().into_iter().flatten() {
        assert_eq!(e["name"], "WEFT_HOME", "settings go in args: {e}");
    }
    let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("weft serve {args:?}: {e}"));
    let s = Settings::resolve(cli.serve).expect("the server's settings");
    s.check_exposure()
        .expect("off loopback with a tenant file: the server starts");
    assert_eq!(s.listen.to_string(), format!("0.0.0.0:{grpc}"));
    assert_eq!(
        s.http_listen.map(|a| a.to_string()),
        Some(format!("0.0.0.0:{http}"))
    );
    assert_eq!(
        s.metrics_listen.map(|a| a.to_string()),
        Some(format!("0.0.0.0:{metrics}"))
    );

    // The tenant file is the Secret's key, mounted where --tenants says, and
    // the server's parser takes it.
    let tenants = s.tenants.clone().expect("--tenants");
    let vols = pod["spec"]["volumes"].as_array().unwrap();
    let mount = c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| tenants.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("a volume mounted at the tenant file's directory");
    assert_eq!(mount["readOnly"], true);
    let vol = vols
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mount's volume");
    assert_eq!(vol["secret"]["secretName"], secret["metadata"]["name"]);
    let rel = tenants
        .strip_prefix(mount["mountPath"].as_str().unwrap())
        .unwrap();
    let item = vol["secret"]["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| Path::new(i["path"].as_str().unwrap()) == rel)
        .expect("a secret item at the tenant file's path");
    let key = item["key"].as_str().unwrap();
    let text = secret["stringData"][key]
        .as_str()
        .unwrap_or_else(|| panic!("the Secret has no {key}"));
    let t = weft_grpc::server::tenants::Tenants::parse(text).expect("the example tenant file");
    assert!(t.all().len() >= 2);

    // Probes: readiness (and startup) on gRPC health at the gRPC port,
    // liveness on the metrics listener's /healthz.
    for probe in ["readinessProbe", "startupProbe"] {
        assert_eq!(
            c[probe]["grpc"]["port"].as_u64(),
            Some(grpc),
            "{probe} on gRPC health"
        );
    }
    let live = &c["livenessProbe"]["httpGet"];
    assert_eq!(resolve(&live["port"]), metrics);
    assert_eq!(live["path"], "/healthz");
    let src = std::fs::read_to_string(root().join("crates/grpc/src/server/metrics.rs")).unwrap();
    assert!(
        src.contains("\"/healthz\" =>"),
        "the metrics listener serves /healthz"
    );
    // Drain fits in the grace period (after the preStop sleep).
    let sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        .as_u64()
        .unwrap_or(0);
    let grace = pod["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap();
    assert!(
        grace >= sleep + s.drain_timeout.as_secs() + 5,
        "grace {grace} s < preStop {sleep} s + drain {:?} + 5 s",
        s.drain_timeout
    );
    assert!(c["resources"]["requests"]["cpu"].is_string());
    assert!(c["resources"]["limits"]["memory"].is_string());

    // Service: every port reaches a container port; gRPC is h2c.
    let svc_ports = svc["spec"]["ports"].as_array().unwrap();
    let by_name = |n: &str| svc_ports.iter().find(|p| p["name"] == n).unwrap();
    assert_eq!(resolve(&by_name("grpc")["targetPort"]), grpc);
    assert_eq!(by_name("grpc")["appProtocol"], "kubernetes.io/h2c");
    assert_eq!(resolve(&by_name("http")["targetPort"]), http);
    assert_eq!(resolve(&by_name("metrics")["targetPort"]), metrics);

    // ServiceMonitor: selects the Service, scrapes its metrics port.
    assert!(subset(
        &sm["spec"]["selector"]["matchLabels"],
        &svc["metadata"]["labels"]
    ));
    for e in sm["spec"]["endpoints"].as_array().unwrap() {
        assert_eq!(
            resolve(&by_name(e["port"].as_str().unwrap())["targetPort"]),
            metrics
        );
        assert_eq!(e["path"], "/metrics");
    }

    // HPA: scales the Deployment on the waiting-requests gauge Weft exports,
    // as the prometheus-adapter rule names it.
    let target = &hpa["spec"]["scaleTargetRef"];
    assert_eq!(target["kind"], "Deployment");
    assert_eq!(target["apiVersion"], dep["apiVersion"]);
    assert_eq!(target["name"], dep["metadata"]["name"]);
    let m = &hpa["spec"]["metrics"][0];
    assert_eq!(m["type"], "Pods");
    let metric = m["pods"]["metric"]["name"].as_str().unwrap();
    assert_eq!(metric, weft_grpc::server::metrics::REQUESTS_WAITING_ALL);
    let values = yaml_docs(&k8s_dir().join("prometheus-adapter-values.yaml"));
    let rule = values[0]["rules"]["custom"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"]["as"] == metric)
        .expect("an adapter rule serving the HPA's metric");
    assert!(rule["seriesQuery"]
        .as_str()
        .unwrap()
        .starts_with(&format!("{metric}{{")));
    let overrides = &rule["resources"]["overrides"];
    assert_eq!(overrides["pod"]["resource"], "pod");
    assert_eq!(overrides["namespace"]["resource"], "namespace");
    assert!(rule["metricsQuery"]
        .as_str()
        .unwrap()
        .contains("<<.Series>>{<<.LabelMatchers>>}"));
}
