#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Checks of deploy/ that no schema knows: how the rendered Kubernetes objects fit together
(selectors match pod labels, probes hit the gRPC port, grace period covers the drain, GPU only
in the GPU overlay), the PodMonitor's required fields, the Grafana dashboard (every query
parses as PromQL and names only metrics lossd exports) and the Dockerfile's shape.

Usage: check_k8s.py k8s OVERLAY RENDERED.yaml | podmonitor RENDERED.yaml |
       dashboard DASHBOARD.json RULES_OUT.yml | dockerfile Dockerfile
Prints one line per failed property; exits 1 if any failed.
"""

import json
import os
import pathlib
import re
import sys

import yaml

METRICS = {
    "lossd_requests_total", "lossd_request_duration_seconds_bucket",
    "lossd_request_duration_seconds_sum", "lossd_request_duration_seconds_count",
    "lossd_tokens_total", "lossd_bytes_received_total", "lossd_bytes_sent_total",
    "lossd_requests_in_flight", "lossd_memory_in_use_bytes", "lossd_memory_budget_bytes",
    "lossd_gpu_memory_used_bytes", "lossd_gpu_memory_total_bytes", "lossd_gpu_memory_peak_bytes",
    "lossd_gpu_memory_held_bytes", "lossd_gpu_memory_budget_bytes",
    "lossd_weight_cache_bytes", "lossd_weight_cache_hits_total",
    "lossd_weight_cache_misses_total", "lossd_weight_cache_evictions_total",
    "lossd_accumulators", "lossd_compute_flops_total", "lossd_healthy",
    "lossd_heads", "lossd_head_bytes", "lossd_head_budget_bytes", "lossd_head_steps_total",
    "lossd_head_step_seconds_bucket", "lossd_head_step_contributions_total",
    "lossd_head_step_tokens_total", "lossd_head_last_grad_norm", "lossd_head_last_version",
    "lossd_tickets", "lossd_ticket_bytes", "lossd_tickets_expired_total",
    "lossd_ticket_budget_bytes", "lossd_max_tickets",
}

failures = []


def check(cond, msg):
    if not cond:
        failures.append(msg)
    return cond


def flag_value(args, name):
    for a in args:
        if a.startswith("--%s=" % name):
            return a.split("=", 1)[1]
    return None


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_k8s(overlay, path):
    objs = [o for o in yaml.safe_load_all(open(path)) if o]
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    # One workload: a Deployment, or for a head group a StatefulSet (its members are named).
    workload = GROUP_OVERLAYS.get(overlay, {}).get("kind", "Deployment")
    check(len(by_kind.get(workload, [])) == 1, "one %s" % workload)
    check(sum(len(by_kind.get(k, [])) for k in ("Deployment", "StatefulSet")) == 1,
          "one workload (Deployment or StatefulSet) in all")
    if not by_kind.get(workload):
        return
    dep = by_kind[workload][0]
    check_namespaces(dep, objs)
    tpl = dep["spec"]["template"]
    labels = tpl["metadata"]["labels"]
    check(matches(dep["spec"]["selector"]["matchLabels"], labels),
          "%s selector matches its pod labels" % workload)
    pod = tpl["spec"]
    containers = pod["containers"]
    check(len(containers) == 1, "one container")
    c = containers[0]
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    args = c.get("args", [])
    check_ports_and_drain(pod, c, ports, args)
    check_probes(pod, c, ports, args)
    ann = tpl["metadata"].get("annotations", {})
    check(ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") == "9464",
          "pod scrape annotations")
    check_security(pod, c)
    check_resources(overlay, dep, by_kind, pod, c, args)
    check_head_export(overlay, dep, by_kind, pod, c, args)
    check_head_group(overlay, dep, by_kind, labels, pod, c, args)
    check_services(by_kind, labels, ports)
    check_podmonitors(by_kind.get("PodMonitor", []), labels, ports)
    if by_kind.get("PodMonitor"):
        rules_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                 "deploy", "prometheus", "rules")
        check_prometheusrules(by_kind.get("PrometheusRule", []), rules_dir)


def check_namespaces(dep, objs):
    ns = dep["metadata"].get("namespace")
    check(ns, "Deployment has a namespace")
    for o in objs:
        if o["kind"] != "Namespace":
            check(o["metadata"].get("namespace") == ns,
                  "%s/%s in namespace %s" % (o["kind"], o["metadata"]["name"], ns))


def duration_seconds(value):
    """An absl duration flag's value ("5s", "1m30s", "500ms", "0") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"([0-9.]+)(ms|h|m|s)", value or "")
    if value in (None, "0") or not parts:
        return 0
    return sum(float(n) * units[u] for n, u in parts)


def stop_before_drain(c, args):
    """Seconds between the kubelet's stop and lossd's drain: a preStop sleep, then
    --shutdown_grace (lossd's own: not ready while still serving; 5 s left out)."""
    cmd = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pre_stop = int(cmd[1]) if len(cmd) == 2 and cmd[0] == "sleep" else 0
    grace = flag_value(args, "shutdown_grace")
    return pre_stop + (5 if grace is None else duration_seconds(grace))


def check_ports_and_drain(pod, c, ports, args):
    check(ports.get("grpc") == 50051 and ports.get("metrics") == 9464,
          "container ports grpc=50051 and metrics=9464, got %s" % ports)
    check(flag_value(args, "port") == "50051", "--port=50051")
    check(flag_value(args, "metrics_port") == "9464", "--metrics_port=9464")
    drain = int(flag_value(args, "drain_seconds") or 30)
    before = stop_before_drain(c, args)
    # Endpoints drop asynchronously after the pod is marked terminating: lossd keeps serving
    # (not ready) for a few seconds first.
    check(before >= 3, "--shutdown_grace (plus any preStop) of at least 3 s, got %g" % before)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    check(grace > drain + before,
          "terminationGracePeriodSeconds %d > --drain_seconds %d + --shutdown_grace/preStop %g" % (
              grace, drain, before))


def check_probes(pod, c, ports, args):
    # With TLS on the gRPC port the kubelet's gRPC probes (plaintext only) need lossd's
    # plaintext health-only port, and the certificate must come from a Secret.
    tls = flag_value(args, "tls_cert") is not None
    probe_port = 50051
    if tls:
        probe_port = int(flag_value(args, "health_port") or 0)
        check(probe_port not in (0, 50051), "TLS: --health_port set apart from --port")
        check(ports.get("health") == probe_port, "TLS: a container port 'health' = --health_port")
        mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
        secrets = {v["name"]: v["secret"].get("secretName") for v in pod.get("volumes", [])
                   if "secret" in v}
        cert, key = flag_value(args, "tls_cert"), flag_value(args, "tls_key") or ""
        check(any(cert.startswith(mounts.get(n, "?") + "/") and key.startswith(
            mounts.get(n, "?") + "/") for n in secrets),
              "TLS: --tls_cert and --tls_key are read from a mounted Secret")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c.get(probe)
        if check(p is not None, "%s present" % probe):
            check(p.get("grpc", {}).get("port") == probe_port,
                  "%s is a gRPC health probe on %d" % (probe, probe_port))


def check_security(pod, c):
    sc = pod.get("securityContext", {})
    check(sc.get("runAsNonRoot") is True and sc.get("runAsUser", 0) != 0, "pod runs as non-root")
    csc = c.get("securityContext", {})
    check(csc.get("allowPrivilegeEscalation") is False, "no privilege escalation")
    check(csc.get("readOnlyRootFilesystem") is True, "read-only root filesystem")


def check_resources(overlay, dep, by_kind, pod, c, args):
    res = c.get("resources", {})
    check(res.get("requests", {}).get("cpu") and res.get("requests", {}).get("memory"),
          "cpu and memory requests")
    check(res.get("limits", {}).get("memory"), "memory limit")
    gpu_req = res.get("limits", {}).get("nvidia.com/gpu")
    backend = flag_value(args, "backend")
    if overlay in ("gpu-prod", "gpu-prod-tls"):
        check(gpu_req == "1" and res.get("requests", {}).get("nvidia.com/gpu") == "1",
              "GPU overlay requests nvidia.com/gpu: 1")
        check(backend == "cuda", "GPU overlay runs --backend=cuda")
        check(dep["spec"].get("replicas", 1) >= 2, "GPU overlay has several replicas")
        check(any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])),
              "GPU overlay tolerates the nvidia.com/gpu taint")
        check(len(by_kind.get("PodMonitor", [])) == 1, "GPU overlay has a PodMonitor")
    elif overlay == "gpu-single":
        check(gpu_req == "1" and backend == "cuda", "gpu-single: one GPU, --backend=cuda")
    elif overlay in ("dev-cpu", "cpu-group"):
        check(gpu_req is None, "CPU overlay requests no GPU")
        check(backend == "cpu", "CPU overlay runs --backend=cpu")
        members = dep["spec"].get("replicas", 1) if overlay in GROUP_OVERLAYS else 1
        check_cpu_budgets(res, args, members)


def group_extra_per_head_byte(members):
    """What a member of a group of `members` holds beside --head_bytes, per byte of it, at
    the worst optimizer (k state tensors) and copy dtype (c B): during a step gloo's
    ReduceScatterHalvingDoubling holds two receive buffers the size of the whole fp32
    gradient (8 B a parameter), and an export's gather keeps the whole fp32 master and
    optimizer state (4 + 4 k B) until the head's version moves; a member's store holds
    4 + c (gradient sum, copy) + (4 + 4 k) / S B a parameter (the head store's HeadBytes)."""
    if members <= 1:
        return 0.0
    return max((8 + 4 + 4 * k) / (4 + c + (4 + 4 * k) / members)
               for k in (0, 1, 2, 3) for c in (2, 4))


def check_cpu_budgets(res, args, members=1):
    # On the CPU backend every budget is host memory (tickets' X is host memory on any
    # backend), and idle pooled buffers come on top of the admission budget: together they must leave the process room under its limit.
    # A group's member also holds buffers beside its head store (group_extra_per_head_byte).
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    limit = res.get("limits", {}).get("memory", "0")
    limit_bytes = int(limit[:-2]) * units[limit[-2:]] if limit[-2:] in units else int(limit)
    defaults = {"memory_budget_bytes": 8 << 30, "weight_cache_bytes": 4 << 30,
                "accumulator_bytes": 8 << 30, "head_bytes": 16 << 30,
                "ticket_bytes": 4 << 30, "host_buffer_pool_bytes": 2 << 30}
    held = sum(int(flag_value(args, f) or d) for f, d in defaults.items())
    heads = int(flag_value(args, "head_bytes") or defaults["head_bytes"])
    held += int(heads * group_extra_per_head_byte(members))
    check(held <= 0.8 * limit_bytes,
          "CPU overlay: budgets and buffer pool%s (%d bytes) within 80%% of the memory limit "
          "(%s)" % (" and a group member's step and export buffers" if members > 1 else "",
                    held, limit))


# Overlays that deploy a head group (docs/hosted_head.md "Deploying a group").
GROUP_OVERLAYS = {"cpu-group": {"kind": "StatefulSet"}}


def check_head_group(overlay, sts, by_kind, labels, pod, c, args):
    """A head group's members: stable names through the headless Service, gloo's listener on
    the pod's own address, and a NetworkPolicy (if any) that lets the members reach each
    other's ephemeral gloo ports and member 0's gRPC port."""
    address = flag_value(args, "head_group_address")
    if overlay not in GROUP_OVERLAYS:
        check(address is None, "--head_group_address in a group overlay alone, got %r" % address)
        return
    spec = sts["spec"]
    headless = [s["metadata"]["name"] for s in by_kind.get("Service", [])
                if s["spec"].get("clusterIP") == "None"]
    check(spec.get("serviceName") in headless,
          "StatefulSet serviceName %r is the headless Service %s (members' stable names)" % (
              spec.get("serviceName"), headless))
    check(spec.get("replicas", 1) >= 2, "a group of 2 members or more, got %s" %
          spec.get("replicas", 1))
    check(spec.get("podManagementPolicy") == "Parallel",
          "members start in parallel (podManagementPolicy: Parallel)")
    check(spec.get("updateStrategy", {}).get("type") == "OnDelete",
          "members are replaced only when deleted (updateStrategy OnDelete): a restart ends "
          "the group's heads")
    # gloo binds the address and the other members dial it: the pod's IP, from the API.
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
           for e in c.get("env", [])}
    var = re.fullmatch(r"\$\((\w+)\)", address or "")
    check(var is not None and env.get(var.group(1)) == "status.podIP",
          "--head_group_address is $(VAR) of an env VAR from status.podIP, got %r" % address)
    check(duration_seconds(flag_value(args, "head_group_timeout")) > 0,
          "--head_group_timeout set")
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    for np in by_kind.get("NetworkPolicy", []):
        check_group_network_policy(np, labels, ports)


def check_group_network_policy(np, labels, ports):
    name = np["metadata"]["name"]
    spec = np["spec"]
    if not matches(spec.get("podSelector", {}).get("matchLabels", {}), labels) or \
            "Ingress" not in spec.get("policyTypes", ["Ingress"]):
        return
    rules = spec.get("ingress", [])

    def port_open(rule, port):  # rule lets TCP `port` in (a named port or a range)
        if not rule.get("ports"):
            return True
        for p in rule["ports"]:
            if p.get("protocol", "TCP") != "TCP":
                continue
            lo = ports.get(p["port"], p["port"]) if "port" in p else 1
            hi = p.get("endPort", lo) if "port" in p else 65535
            if isinstance(lo, int) and lo <= port <= hi:
                return True
        return False

    def from_members(rule):
        return not rule.get("from") or any(
            matches(f.get("podSelector", {}).get("matchLabels", {}), labels)
            and "namespaceSelector" not in f for f in rule["from"])

    check(any(port_open(r, 50051) and not r.get("from") for r in rules),
          "NetworkPolicy %s admits trainers on the gRPC port" % name)
    # Member 0's store is on its gRPC port; gloo listens on an ephemeral port (Linux's
    # default range 32768-60999; a pod may set another).
    for port in (50051, 32768, 45000, 60999, 65535):
        check(any(port_open(r, port) and from_members(r) for r in rules),
              "NetworkPolicy %s lets the members reach each other's TCP port %d" % (name, port))


# What the grace period and the startup probe allow for the head export and import: a
# network volume's usual sustained speed, and the time to exit once the export is written.
HEAD_FILE_BYTES_PER_S = 200e6
EXIT_SECONDS = 10
STARTUP_SECONDS = 120  # the CUDA backend's start-up, before any head is read


def quantity_bytes(q):
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


def check_head_export(overlay, dep, by_kind, pod, c, args):
    """--head_export_dir: the folder outlives the pod, belongs to one pod at a time, and
    the pod has time to write it on drain and read it back at start."""
    folder = flag_value(args, "head_export_dir")
    check((folder is not None) == (overlay == "gpu-single"),
          "--head_export_dir set in gpu-single alone, got %r" % folder)
    if not folder:
        return
    # lossd names a file by its head alone and imports (then deletes) every file at start:
    # two pods on one folder overwrite and take each other's heads.
    check(dep["spec"].get("replicas", 1) == 1, "--head_export_dir: one replica")
    check(dep["spec"].get("strategy", {}).get("type") == "Recreate",
          "--head_export_dir: Recreate (the old pod exports before the new one imports)")
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c.get("volumeMounts", [])}
    volume = mounts.get(folder.rstrip("/"))
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
              for v in pod.get("volumes", []) if "persistentVolumeClaim" in v}
    claim = claims.get(volume)
    check(claim, "--head_export_dir=%s is the mount of a PersistentVolumeClaim" % folder)
    pvcs = {o["metadata"]["name"]: o for o in by_kind.get("PersistentVolumeClaim", [])}
    head_bytes = int(flag_value(args, "head_bytes") or 16 << 30)
    if check(claim in pvcs, "PersistentVolumeClaim %s is in the overlay" % claim):
        spec = pvcs[claim]["spec"]
        check(spec.get("accessModes") == ["ReadWriteOncePod"],
              "claim %s is ReadWriteOncePod (one pod at a time), got %s" % (
                  claim, spec.get("accessModes")))
        size = quantity_bytes(spec["resources"]["requests"]["storage"])
        check(size >= head_bytes, "claim %s (%d bytes) holds --head_bytes %d" % (
            claim, size, head_bytes))
    # The export writes at most --head_bytes, after the grace and the drain.
    transfer = head_bytes / HEAD_FILE_BYTES_PER_S
    drain = int(flag_value(args, "drain_seconds") or 30)
    before = stop_before_drain(c, args)
    grace = pod.get("terminationGracePeriodSeconds", 30)
    need = before + drain + transfer + EXIT_SECONDS
    check(grace >= need, "terminationGracePeriodSeconds %d covers --shutdown_grace/preStop %g + "
          "drain %d + export %.0f + exit %d" % (grace, before, drain, transfer, EXIT_SECONDS))
    sp = c.get("startupProbe", {})
    window = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
    check(window >= STARTUP_SECONDS + transfer, "startup probe window %d s covers start-up "
          "%d + import %.0f" % (window, STARTUP_SECONDS, transfer))


def check_services(by_kind, labels, ports):
    services = by_kind.get("Service", [])
    check(len(services) == 2, "two Services (ClusterIP and headless)")
    headless = [s for s in services if s["spec"].get("clusterIP") == "None"]
    if check(len(headless) == 1, "one headless Service"):
        # The replica pool resolves it: a draining (not ready) pod must leave the answer, and
        # the gRPC port must be the one the clients are told to dial.
        spec = headless[0]["spec"]
        check(spec.get("publishNotReadyAddresses") is not True,
              "headless Service lists ready pods only (publishNotReadyAddresses not true)")
        check(any(p.get("name") == "grpc" and p.get("port") == 50051 and
                  p.get("targetPort") == "grpc" for p in spec["ports"]),
              "headless Service serves the gRPC port 50051")
    for s in services:
        name = s["metadata"]["name"]
        check(matches(s["spec"].get("selector", {}), labels), "Service %s selects the pods" % name)
        for p in s["spec"]["ports"]:
            check(p.get("targetPort") in ports, "Service %s targets a named container port %s" % (
                name, p.get("targetPort")))
    pdbs = by_kind.get("PodDisruptionBudget", [])
    if check(len(pdbs) == 1, "one PodDisruptionBudget"):
        check(matches(pdbs[0]["spec"]["selector"]["matchLabels"], labels),
              "PodDisruptionBudget selects the pods")


def check_prometheusrules(prs, rules_dir):
    """The operator's copy of the rules says what the rule files say."""
    want = []
    for path in sorted(pathlib.Path(rules_dir).glob("*.yml")):
        want.extend(yaml.safe_load(path.read_text())["groups"])
    check(len(prs) == 1, "one PrometheusRule beside the PodMonitor, got %d" % len(prs))
    for pr in prs:
        name = pr["metadata"].get("name")
        check(pr.get("apiVersion") == "monitoring.coreos.com/v1", "PrometheusRule apiVersion")
        check(pr["metadata"].get("labels"),
              "PrometheusRule %s has labels (a ruleSelector matches them)" % name)
        check(pr.get("spec", {}).get("groups") == want,
              "PrometheusRule %s holds the groups of %s (run tools/make_prometheusrule.py)"
              % (name, rules_dir))


def check_podmonitors(pms, pod_labels=None, ports=None):
    for pm in pms:
        name = pm["metadata"].get("name")
        check(pm["metadata"].get("labels"),
              "PodMonitor %s has labels (a podMonitorSelector matches them)" % name)
        check(pm.get("apiVersion") == "monitoring.coreos.com/v1", "PodMonitor apiVersion")
        check(name, "PodMonitor has a name")
        spec = pm.get("spec", {})
        sel = spec.get("selector", {}).get("matchLabels", {})
        check(sel, "PodMonitor %s has selector.matchLabels" % name)
        if pod_labels is not None:
            check(matches(sel, pod_labels), "PodMonitor %s selects the lossd pods" % name)
        # The alert rules select job="lossd": without a jobLabel the operator names the job
        # "<namespace>/<podmonitor>" and LossdInstanceDown could never fire.
        job_label = spec.get("jobLabel")
        check(job_label, "PodMonitor %s sets jobLabel (the rules select job=\"lossd\")" % name)
        if pod_labels is not None and job_label:
            check(pod_labels.get(job_label) == "lossd",
                  "PodMonitor %s jobLabel %s is 'lossd' on the pods" % (name, job_label))
        eps = spec.get("podMetricsEndpoints", [])
        check(eps, "PodMonitor %s has podMetricsEndpoints" % name)
        for ep in eps:
            check(ep.get("port") and (ports is None or ep["port"] in ports),
                  "PodMonitor endpoint port %s names a container port" % ep.get("port"))
            check(ep.get("path", "/metrics") == "/metrics", "PodMonitor path /metrics")


def check_dashboard(path, rules_out):
    d = json.load(open(path))
    check(d.get("title") and d.get("uid"), "dashboard has title and uid")
    panels = d.get("panels", [])
    ids = [p.get("id") for p in panels]
    check(len(ids) == len(set(ids)), "panel ids unique")
    exprs = []
    for p in panels:
        if p.get("type") == "row":
            continue
        gp = p.get("gridPos", {})
        check(all(k in gp for k in "xywh") and gp["x"] + gp["w"] <= 24,
              "panel %r has a gridPos inside 24 columns" % p.get("title"))
        tg = p.get("targets", [])
        check(tg, "panel %r has queries" % p.get("title"))
        # A rate or a count on a 0-100% axis reads as nonsense (evictions/s once sat beside
        # the hit ratio): every query of a percent panel must be a ratio.
        if p.get("fieldConfig", {}).get("defaults", {}).get("unit") in ("percent", "percentunit"):
            for t in tg:
                check("/" in t.get("expr", ""), "percent panel %r shows a non-ratio query %r"
                      % (p.get("title"), t.get("legendFormat", t.get("refId"))))
        for t in tg:
            e = t.get("expr", "")
            check(e, "panel %r query has an expr" % p.get("title"))
            exprs.append((p.get("title"), e))
            for m in re.findall(r"\b(lossd_[a-z_]+)\b", e):
                check(m in METRICS, "panel %r uses unknown metric %s" % (p.get("title"), m))
    text = json.dumps(d)
    for want, what in (("lossd_request_duration_seconds_bucket", "latency"),
                       ("phase", "latency by phase"), ("lossd_tokens_total", "tokens/s"),
                       ("lossd_bytes_received_total", "GB/s"),
                       ("lossd_gpu_memory_used_bytes", "GPU memory"),
                       ("by (code)", "errors by code")):
        check(want in text, "dashboard shows %s" % what)
    # Grafana's variables replaced by plain values, so promtool can parse every query.
    rules = {"groups": [{"name": "dashboard", "rules": []}]}
    for i, (title, e) in enumerate(exprs):
        e = e.replace("$__rate_interval", "1m").replace("$namespace", ".*").replace("$pod", ".*")
        rules["groups"][0]["rules"].append({"record": "dashboard:query_%d" % i, "expr": e})
    with open(rules_out, "w") as f:
        yaml.safe_dump(rules, f)


def check_dockerfile(path):
    text = open(path).read()
    froms = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.M | re.I)
    check(len(froms) >= 2, "multi-stage build (%d FROM lines)" % len(froms))
    # The bases are build arguments; their defaults are the CUDA images.
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, re.M))
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), f[0])
             for f in froms]
    check(all(f[0].startswith("${") for f in froms if f[0] != "build"),
          "every base is a build argument: %s" % [f[0] for f in froms])
    if froms:
        check("nvidia/cuda" in bases[0] and "devel" in bases[0],
              "build stage defaults to a CUDA devel base: %s" % bases[0])
        check("nvidia/cuda" in bases[-1] and "runtime" in bases[-1],
              "final stage defaults to a CUDA runtime base: %s" % bases[-1])
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    check(users and users[-1].split(":")[0] not in ("root", "0"), "final USER is not root")
    check(re.search(r'^ENTRYPOINT\s+\[', text, re.M), "ENTRYPOINT in exec form (lossd is PID 1)")
    check(re.search(r"^EXPOSE\s+.*50051", text, re.M), "EXPOSE 50051")
    check("bazel" in text and "//service:lossd" in text, "builds //service:lossd with Bazel")
    final = text[text.rfind("FROM"):]
    check("apt-get install" not in final, "runtime stage installs no packages")


def main():
    mode = sys.argv[1]
    if mode == "k8s":
        check_k8s(sys.argv[2], sys.argv[3])
    elif mode == "podmonitor":
        check_podmonitors([o for o in yaml.safe_load_all(open(sys.argv[2]))
                           if o and o.get("kind") == "PodMonitor"])
    elif mode == "dashboard":
        check_dashboard(sys.argv[2], sys.argv[3])
    elif mode == "dockerfile":
        check_dockerfile(sys.argv[2])
    else:
        sys.exit("unknown mode %s" % mode)
    for f in failures:
        print("  not ok: %s" % f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
