#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Static checks of everything under deploy/: YAML lint, Prometheus config and rules (promtool,
# including rule unit tests), Kustomize rendering of every overlay, a schema check of the
# rendered Kubernetes objects (kubernetes-validate), structural checks no schema knows
# (check_k8s.py), the Grafana dashboard's queries, and the Dockerfile's shape.
# Prints PASS/FAIL per check, then "N passed, N failed"; exits 1 when any check failed.
# Needs: promtool (Debian: prometheus), kubectl (its built-in kustomize), yamllint,
# kubernetes-validate, python3 with PyYAML. JUNIT_XML=path also writes a JUnit report.
set -u
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DEPLOY="$ROOT/deploy"
HERE="$ROOT/tests/prometheus"
KUBE_VERSION=${KUBE_VERSION:-1.30.0}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

passed=0
failed=0
: > "$WORK/cases"

record() {  # name status seconds output-file
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$WORK/cases"
}

run_check() {  # name command...
  local name=$1
  shift
  local out="$WORK/out.$((passed + failed))"
  local t0=$SECONDS
  if "$@" > "$out" 2>&1; then
    echo "PASS $name"
    passed=$((passed + 1))
    record "$name" pass $((SECONDS - t0)) "$out"
  else
    echo "FAIL $name"
    sed 's/^/    /' "$out" | tail -40
    failed=$((failed + 1))
    record "$name" fail $((SECONDS - t0)) "$out"
  fi
}

need() {  # tool: a missing tool is a failure, never a silent pass
  command -v "$1" > /dev/null 2>&1 || { echo "$1 not found: install $2"; return 1; }
}

# Debian's promtool is built without Kubernetes service discovery. Check the Kubernetes config
# fully where promtool knows kubernetes_sd_configs; elsewhere check a copy whose discovery
# blocks are replaced by a static target (every other field, the relabelling and the rule files
# still checked), plus the discovery roles by hand.
check_k8s_prometheus_config() {
  need promtool prometheus || return 1
  if promtool check config "$DEPLOY/prometheus/prometheus.yml" > "$WORK/promcfg.out" 2>&1; then
    cat "$WORK/promcfg.out"
    return 0
  fi
  if ! grep -q "field kubernetes_sd_configs not found" "$WORK/promcfg.out"; then
    cat "$WORK/promcfg.out"
    return 1
  fi
  echo "promtool lacks Kubernetes discovery; checking the rest with a static target"
  mkdir -p "$WORK/promk8s"
  cp -r "$DEPLOY/prometheus/rules" "$WORK/promk8s/"
  python3 - "$DEPLOY/prometheus/prometheus.yml" "$WORK/promk8s/prometheus.yml" <<'PY' || return 1
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
roles = {"node", "service", "pod", "endpoints", "endpointslice", "ingress"}
for sc in cfg["scrape_configs"]:
    sds = sc.pop("kubernetes_sd_configs", None)
    if sds is None:
        continue
    for sd in sds:
        if sd.get("role") not in roles:
            sys.exit("job %s: kubernetes_sd_configs role %r" % (sc["job_name"], sd.get("role")))
    sc["static_configs"] = [{"targets": ["placeholder:9464"]}]
yaml.safe_dump(cfg, open(sys.argv[2], "w"))
PY
  promtool check config "$WORK/promk8s/prometheus.yml"
}

render() {  # overlay
  need kubectl "kubectl (kustomize is built in)" || return 1
  kubectl kustomize "$DEPLOY/k8s/overlays/$1" > "$WORK/$1.yaml" && test -s "$WORK/$1.yaml"
}

schema() {  # overlay: core objects against the Kubernetes OpenAPI schemas; CRDs checked apart
  need kubernetes-validate "pip install kubernetes-validate" || return 1
  kubernetes-validate --strict --no-warn -k "$KUBE_VERSION" "$WORK/$1.yaml"
}

dashboard() {
  python3 "$HERE/check_k8s.py" dashboard "$DEPLOY/grafana/lossd-dashboard.json" \
    "$WORK/dashboard-rules.yml" && promtool check rules "$WORK/dashboard-rules.yml"
}

run_check "yamllint deploy/" \
  sh -c "command -v yamllint >/dev/null || { echo 'pip install yamllint'; exit 1; }; \
         yamllint --strict -c '$DEPLOY/.yamllint.yaml' '$DEPLOY'"
run_check "promtool check config prometheus-static.yml" \
  promtool check config "$DEPLOY/prometheus/prometheus-static.yml"
run_check "promtool check config prometheus.yml (Kubernetes)" check_k8s_prometheus_config
run_check "promtool check rules" promtool check rules "$DEPLOY"/prometheus/rules/*.yml
run_check "promtool test rules (alert unit tests)" \
  promtool test rules "$DEPLOY"/prometheus/tests/*.yml
run_check "PrometheusRule matches the rule files" \
  python3 "$ROOT/tools/make_prometheusrule.py" --check
for overlay in dev-cpu gpu-prod gpu-prod-tls gpu-single cpu-group; do
  run_check "kustomize build overlays/$overlay" render "$overlay"
  run_check "kubernetes-validate $overlay (k8s $KUBE_VERSION, strict)" schema "$overlay"
  run_check "structure $overlay (selectors, probes, grace, GPU, PodMonitor, head export, head group)" \
    python3 "$HERE/check_k8s.py" k8s "$overlay" "$WORK/$overlay.yaml"
done
run_check "kustomize build base" sh -c "kubectl kustomize '$DEPLOY/k8s/base' > /dev/null"
run_check "grafana dashboard (structure, metrics, PromQL)" dashboard
run_check "Dockerfile (multi-stage, bases as build arguments defaulting to CUDA, non-root)" \
  python3 "$HERE/check_k8s.py" dockerfile "$DEPLOY/Dockerfile"

if [ -n "${JUNIT_XML:-}" ]; then
  python3 - "$WORK/cases" "$JUNIT_XML" <<'PY'
import sys
from xml.sax.saxutils import escape, quoteattr
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
fails = sum(1 for r in rows if r[1] == "fail")
out = ['<?xml version="1.0" encoding="utf-8"?>',
       '<testsuites><testsuite name="check_manifests" tests="%d" failures="%d">' % (len(rows), fails)]
for name, status, secs, path in rows:
    out.append('<testcase classname="deploy" name=%s time="%s">' % (quoteattr(name), secs))
    if status == "fail":
        out.append('<failure message="failed">%s</failure>' % escape(open(path).read()[-4000:]))
    out.append("</testcase>")
out.append("</testsuite></testsuites>")
open(sys.argv[2], "w").write("\n".join(out) + "\n")
PY
fi

echo "check_manifests: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
